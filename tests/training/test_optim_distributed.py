"""Distributed Muon + AdamW on FSDP2 / HSDP (2 ranks, gloo) against single-process runs.

One torchrun launch runs tests/dist_workers/optim_worker.py; this side asserts on its JSON report.
"""

import json

import pytest
from torchrun_util import WORKERS_DIR, run_torchrun

NPROC = 2
N_STEPS = 3
MUON_LR, ADAMW_LR = 1e-2, 1e-3
# Largest Muon scale factor sqrt(rows / cols) in the worker: fused gate+up, (47 + 47) x 32.
MAX_MUON_SCALE = (94 / 32) ** 0.5
# bf16 spacing for magnitudes in [1, 2): Newton-Schulz outputs have singular values near 1, so every
# entry of an orthogonalised update lies below 2 and a 1-ulp change in one is at most this.
BF16_ULP = 2.0**-7
# Two runs whose gradients differ only by reduction order (~1e-8) flip the bf16 rounding of a few
# update entries by 1 ulp; five bf16 Newton-Schulz iterations re-round and spread that to a few ulps
# of the output (2 measured). After one step the params may therefore differ by lr * scale * 4 ulps.
FIRST_STEP_BOUND = MUON_LR * MAX_MUON_SCALE * 4 * BF16_ULP
# Later steps see different params, hence different grads, and the drift compounds without a per-ulp
# bound; instead it must stay a small part of how far training moved the matrices (2.6% measured).
MAX_RELATIVE_DRIFT = 0.10


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """One report per rank; everything but the local shard sizes is global and must agree."""
    out = tmp_path_factory.mktemp("optim") / "report.json"
    run_torchrun([str(WORKERS_DIR / "optim_worker.py"), "--out", str(out)], nproc=NPROC, timeout=120)
    per_rank = json.loads(out.read_text())
    assert len(per_rank) == NPROC
    global_parts = [{k: v for k, v in r.items() if not k.startswith("edge_1d")} for r in per_rank]
    assert all(part == global_parts[0] for part in global_parts), "ranks disagree on global measurements"
    return per_rank


@pytest.fixture(scope="module")
def report(reports: list[dict]) -> dict:
    return reports[0]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fsdp", "hsdp_tied_fused"])
def test_sharded_training_matches_single_process(report: dict, scenario: str) -> None:
    result = report[scenario]
    assert len(result["steps"]) == N_STEPS
    for step in result["steps"]:
        # Same params (see synced_diff) and the same global batch: grads differ by reduction order only.
        assert step["grad_diff"] <= 1e-6
        # Clipping was active, and the DTensor norm and clipped grads agree with one process.
        assert step["norm"] > 1.0 and step["norm_diff"] <= 1e-6 and step["clipped_grad_diff"] <= 1e-6
        # Fed the sharded run's grads, single-process Muon + AdamW land on exactly the same params.
        assert step["synced_diff"] == 0.0
        # Independent single-process run: AdamW moves each element by about lr per step at most.
        assert step["ref_adamw_diff"] < ADAMW_LR
    first, last = result["steps"][0], result["steps"][-1]
    assert first["ref_muon_diff"] <= FIRST_STEP_BOUND
    assert last["ref_muon_rel_drift"] <= MAX_RELATIVE_DRIFT


@pytest.mark.parametrize("scenario", ["fsdp", "hsdp_tied_fused"])
def test_muon_step_collectives(report: dict, scenario: str) -> None:
    """Two all-to-alls per step for all 29 matrices together; AdamW on shards needs none."""
    result = report[scenario]
    assert result["n_muon_matrices"] == 29
    assert result["muon_comms"] == {"c10d.alltoall_base_": 2 * N_STEPS}
    assert result["adamw_comms"] == {}


def test_placements_and_state_round_trip(report: dict) -> None:
    assert report["fsdp"]["placements"] == "(Shard(dim=0),)"
    assert report["hsdp_tied_fused"]["placements"] == "(Replicate(), Shard(dim=0))"
    for scenario in ("fsdp", "hsdp_tied_fused"):
        assert report[scenario]["state_round_trip_diff"] == 0.0


@pytest.mark.parametrize("scenario", ["edge_1d", "edge_1d_bf16"])
def test_uneven_and_empty_shards_bit_exact(reports: list[dict], report: dict, scenario: str) -> None:
    """Shapes (1,6) (5,3) (3,7)+(1,7) fused (2,2): rank 1 holds 0 rows of some; 4 steps, bit-exact, with
    Newton-Schulz in CPU's float32 and in bf16 (the pieces travel in its dtype)."""
    assert [r[scenario]["local_rows"] for r in reports] == [[1, 3, 2, 1, 1], [0, 2, 1, 0, 1]]
    for sharded in (r[scenario] for r in reports):
        assert sharded["diff"] == 0.0
        assert sharded["comms"] == {"c10d.alltoall_base_": 2 * 4}
    # (Replicate, Shard(0)) over a 2 x 1 mesh: every rank holds whole matrices, so no collectives.
    replicas = report["edge_replicas"]
    assert replicas["diff"] == 0.0 and replicas["comms"] == {}
    assert replicas["local_rows"] == [1, 5, 3, 1, 2]
