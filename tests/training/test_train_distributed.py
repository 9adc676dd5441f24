"""The trainer on real processes: FSDP2 (2 ranks) and HSDP (2x2) against one process, collective counts, compile."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_runs import STEPS, WORKER, run_single, worker_args
from tests.torchrun_util import run_torchrun

# AdamW normalises each coordinate by its own gradient history, so a gradient that is ~0 up to 1e-8
# of reduction-order noise can move its parameter by up to lr in either direction: the only sound
# per-element bound after s steps is 2 * lr * s. Most parameters must agree far tighter (median check).
ADAMW_LR = 5e-5
ADAMW_PARAM_ATOL = 2 * ADAMW_LR * STEPS
# Muon orthogonalises in bf16 (8-bit mantissa). Inputs that differ by float reduction noise (1e-7
# relative) give Newton-Schulz outputs differing by up to 2^-6 (measured over 500 random 8..64-wide
# matrices; outputs are <= ~0.7), and the difference compounds through the momentum and the next
# steps' gradients. Bound: an eighth of the largest possible update per step, lr * sqrt(max(1, rows/
# cols)) (<= 2 here) * 2^-3, summed over the steps; the median parameter must still agree to 1e-5.
MUON_LR = 1e-3  # both learning rates are the paper's defaults, set by the worker
MUON_PARAM_ATOL = MUON_LR * 2 * 2**-3 * STEPS + ADAMW_PARAM_ATOL
PARAM_MEDIAN_ATOL = {"adamw": 1e-6, "muon": 1e-5}
# After a Muon step the two runs' parameters differ by that bf16 rounding, so gradients are compared
# at 1e-6 where the parameters are still identical (step 1); losses are compared at every step.
GRAD_STEPS = {"adamw": STEPS, "muon": 1}


def assert_runs_agree(single: dict, multi: dict, optimizer: str) -> None:
    param_atol = ADAMW_PARAM_ATOL if optimizer == "adamw" else MUON_PARAM_ATOL
    grad_steps = GRAD_STEPS[optimizer]
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert len(single["grads"]) == len(multi["grads"]) == STEPS
    for step, (g1, g2) in enumerate(zip(single["grads"][:grad_steps], multi["grads"][:grad_steps], strict=True)):
        assert g1.keys() == g2.keys()
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=0, msg=f"grad {name} at step {step + 1}")
    diffs = []
    for name, p1 in single["params"].items():
        diff = (multi["params"][name] - p1).abs()
        assert diff.max() <= param_atol, f"param {name} differs by {diff.max():.3g} > {param_atol:.3g}"
        diffs.append(diff.flatten())
    assert torch.cat(diffs).median() <= PARAM_MEDIAN_ATOL[optimizer]


# Each optimizer and each AC mode once on 2 ranks; the HSDP test below adds (muon, per_iteration) on 4,
# and the checkpoint tests train with the debug config's (muon, per_iteration) on 2 ranks.
@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "ac"), [("adamw", "per_iteration"), ("muon", "none")])
def test_fsdp_two_ranks_match_single_process(tiny_model_dir, tmp_path, optimizer, ac):
    """Also: every FSDP unit runs its forward, the untied head's unit included while the loss is chunked
    (4 chunks a micro-batch), so no unit is gathered, resharded or reduced outside FSDP's schedule."""
    extra = ("--optimizer", optimizer, "--ac", ac, "--steps", str(STEPS), "--accum", "2")
    extra += ("--training.loss_chunk_tokens", "8")
    single_args, single_out = worker_args(tiny_model_dir, tmp_path, "single", *extra)
    multi_args, multi_out = worker_args(tiny_model_dir, tmp_path, "multi", *extra)
    run_single(single_args)
    run_torchrun([WORKER, *multi_args], nproc=2)
    multi = torch.load(multi_out)
    assert multi["silent_fsdp_modules"] == []
    assert_runs_agree(torch.load(single_out), multi, optimizer)


@pytest.mark.slow
def test_document_masking_two_ranks_match_single_process(tiny_model_dir, tmp_path):
    """training.attention_mask = "document" under FSDP2 on 2 ranks (per-iteration checkpointing, 2 micro-steps):
    losses, gradients and parameters of one process; and the mask is on (causal attention's losses differ)."""
    extra = ("--optimizer", "adamw", "--ac", "per_iteration", "--steps", str(STEPS), "--accum", "2")
    documents = (*extra, "--training.attention_mask", "document")
    single_args, single_out = worker_args(tiny_model_dir, tmp_path, "single", *documents)
    multi_args, multi_out = worker_args(tiny_model_dir, tmp_path, "multi", *documents)
    causal_args, causal_out = worker_args(tiny_model_dir, tmp_path, "causal", *extra)
    run_single(single_args)
    run_single(causal_args)
    run_torchrun([WORKER, *multi_args], nproc=2)
    single, multi = torch.load(single_out), torch.load(multi_out)
    assert_runs_agree(single, multi, "adamw")
    assert all(abs(a - b) > 1e-4 for a, b in zip(single["losses"], torch.load(causal_out)["losses"], strict=True))


@pytest.mark.slow
def test_hsdp_two_by_two_matches_single_process(tiny_model_dir, tmp_path):
    extra = ("--optimizer", "muon", "--ac", "per_iteration", "--steps", str(STEPS))
    single_args, single_out = worker_args(tiny_model_dir, tmp_path, "single", *extra)
    multi_args, multi_out = worker_args(tiny_model_dir, tmp_path, "hsdp", *extra, "--dp-replicate", "2")
    run_single(single_args)
    run_torchrun([WORKER, *multi_args], nproc=4)
    assert_runs_agree(torch.load(single_out), torch.load(multi_out), "muon")


@pytest.mark.slow
def test_one_optimizer_step_issues_the_same_collectives_for_every_depth(tiny_model_dir, tmp_path):
    """Per optimizer step, whatever (n, k): the core (one FSDP unit) is all-gathered once in forward and at
    most once more for backward, reduce-scattered once; the step's scalars take one all-reduce; and
    titan_recur's code reads one value back to the host (the reduced scalars)."""
    args, out = worker_args(
        tiny_model_dir, tmp_path, "collectives", "--mode", "collectives", "--ac", "per_iteration", "--optimizer", "muon"
    )
    run_torchrun([WORKER, *args], nproc=2)
    counts = json.loads(out.read_text())
    assert set(counts) == {"0,1", "3,1", "2,2", "15,1", "14,2"}
    for depth, step in counts.items():
        assert step["forward"].get("all_gather", 0) == 1, (depth, step)
        assert step["forward"].get("reduce_scatter", 0) == 0, (depth, step)
        assert step["after_forward"].get("all_gather", 0) <= 1, (depth, step)
        assert step["after_forward"].get("reduce_scatter", 0) == 1, (depth, step)
        assert step["all_reduce"] == 1, (depth, step)
        assert len(step["host_syncs"]) == 1, (depth, step)


def assert_no_recompile_after_warmup(compiled: dict) -> None:
    """Once a step has run both kinds of iteration (no-grad, n > 0, and grad), no (n, k) compiles anything new."""
    warm = next(i for i, (n, k) in enumerate(compiled["depths"]) if n > 0 and k > 0)
    assert warm < len(compiled["depths"]) - 3, "the test needs steps after the warm-up"
    counts = compiled["recompiles_per_step"]
    assert counts[-1] == counts[warm], f"recompiles after warm-up step {warm + 1}: {counts}"


@pytest.mark.slow
def test_compiled_blocks_under_fsdp_match_eager(tiny_model_dir, tmp_path):
    """The production path (blocks and whole core iterations compiled inside FSDP2 units, 2 ranks, AC per
    iteration) over 30 steps of sampled (n, k): no recompile after warm-up, losses equal eager's."""
    common = ("--mode", "compile", "--steps", "30", "--ac", "per_iteration", "--recurrence.curriculum", "none")
    compiled_args, compiled_out = worker_args(
        tiny_model_dir, tmp_path, "compiled", *common, "--training.compile", "true"
    )
    eager_args, eager_out = worker_args(tiny_model_dir, tmp_path, "eager", *common)
    run_torchrun([WORKER, *compiled_args], nproc=2, timeout=600)  # a cold inductor cache on a loaded machine
    run_torchrun([WORKER, *eager_args], nproc=2)
    compiled, eager = json.loads(compiled_out.read_text()), json.loads(eager_out.read_text())
    assert len({tuple(d) for d in compiled["depths"]}) >= 4, "the test needs varying (n, k)"
    assert compiled["depths"] == eager["depths"]
    assert compiled["unique_graphs"] <= 4, compiled
    assert_no_recompile_after_warmup(compiled)
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-4, atol=1e-5)
