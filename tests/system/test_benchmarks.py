"""The benchmark scripts run (tiny shapes on the CPU) and their figures are consistent with the library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.torchrun_util import DEBUG_CONFIG, REPO_ROOT, load_tool, run_torchrun
from titan_recur import RecurrentLM
from titan_recur.config import load_config
from titan_recur.storage.model_io import read_model_args
from titan_recur.training import cost_model
from titan_recur.training.optim import build_optimizers
from titan_recur.training.profiling import STEP_PHASES

MODEL = REPO_ROOT / "assets" / "tiny_llama_recurrent"


@pytest.mark.slow
def test_bench_step_runs_the_fsdp_trainer_step_and_reports_mfu(tmp_path: Path):
    out = tmp_path / "points.jsonl"
    run_torchrun(
        [
            "tools/bench_step.py",
            "--model",
            str(MODEL),
            "--num-steps",
            "2,1",
            "--seq-len",
            "32",
            "--local-batch",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--peak-flops",
            "1e12",
            "--jsonl",
            str(out),
        ],
        nproc=1,
    )
    point = json.loads(out.read_text().splitlines()[-1])
    assert point["world_size"] == 1 and point["num_steps"] == [2, 1] and point["device"] == "cpu"
    per_token = cost_model.training_flops_per_token(read_model_args(MODEL), (2, 1), 32, "per_iteration").total
    assert point["model_flops_per_token"] == per_token
    # approx: the bench divides in another order, and the last bit depends on the measured (machine) speed
    assert point["mfu"] == pytest.approx(per_token * point["tokens_per_sec_per_device"] / 1e12, rel=1e-12)
    assert point["tokens_per_sec_per_device"] == pytest.approx(2 * 32 / point["step_seconds"], rel=1e-12)
    assert point["no_grad_iteration_ms"] is not None and point["grad_iteration_ms"] is not None
    # The step's split: each phase measured, the rest (scalars' all-reduce, clipping, data) is "other".
    phases = [point[f"{name}_seconds"] for name in STEP_PHASES]
    assert all(seconds > 0 for seconds in phases)
    assert point["other_seconds"] == pytest.approx(point["step_seconds"] - sum(phases), rel=1e-9, abs=1e-12)
    args = read_model_args(MODEL)
    assert point["paper_flops_per_token"] == cost_model.paper_flops_per_token(args, 3, 1)
    cfg = load_config(DEBUG_CONFIG, [])
    muon = build_optimizers(RecurrentLM(args), cfg.optimizer, cfg.lr_scheduler, 1).optimizers[0]
    assert point["optimizer_flops_per_step"] == muon.orthogonalisation_flops() > 0
    assert point["peak_memory_gib"] is None and point["estimated_memory_gib"] > 0  # no allocator peak on a CPU


@pytest.mark.slow
def test_bench_step_times_document_masking_on_rows_of_documents(tmp_path: Path):
    """--attention-mask document runs the trainer's step with training.attention_mask = "document" on rows that hold
    documents (the batches carry document_ids, which the model turns into its block-diagonal mask)."""
    bench_step = load_tool("bench_step")
    argv = ["--model", str(MODEL), "--num-steps", "2,1", "--seq-len", "32", "--local-batch", "2"]
    args = bench_step.parse_args([*argv, "--steps", "1", "--warmup", "1", "--attention-mask", "document"])
    args.document_len = 8
    batch = next(bench_step.random_batches(args, 512, eos_id=2, seed=0))
    assert batch["document_ids"][:, -1].min() > 0  # several documents in each row
    done = subprocess.run(
        [sys.executable, "tools/bench_step.py", *argv, "--steps", "1", "--warmup", "1", "--json"]
        + ["--attention-mask", "document", "--document-len", "8"],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    point = json.loads(done.stdout.splitlines()[-1])
    assert (point["attention_mask"], point["document_len"]) == ("document", 8)
    assert point["tokens_per_sec_per_device"] > 0


def test_bench_loss_chunked_peak_below_plain():
    done = subprocess.run(
        [
            sys.executable,
            "tools/bench_loss.py",
            "--vocab",
            "4096",
            "--dim",
            "32",
            "--tokens",
            "1024",
            "--chunks",
            "0,128",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| ") and "MiB" not in line]
    plain, chunked = (row for row in rows if row[1].strip() in ("plain", "128"))
    assert float(chunked[3]) < 0.5  # peak relative to the plain loss's
    assert plain[5] == chunked[5] or abs(float(plain[5]) - float(chunked[5])) < 1e-4  # the same loss


TINY_SHAPE_FLAGS = ["--dim", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--vocab", "64", "--seq-len", "16"]


def markdown_rows(stdout: str) -> list[list[str]]:
    """The data rows of the markdown tables a benchmark prints."""
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| r |") and not line.startswith("| n |")
    ]


@pytest.mark.slow
def test_bench_recurrence_prints_memory_and_the_cost_models_flop_ratio():
    """The shared shape flags build the model (tools/bench_models.py); the FLOP column is the cost model's."""
    done = subprocess.run(
        [sys.executable, "tools/bench_recurrence.py", *TINY_SHAPE_FLAGS, "--batch", "1", "--k", "1"]
        + ["--memory-points", "0", "--time-points", "1,2", "--repeats", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    memory, r1, r2 = markdown_rows(done.stdout)
    assert memory[:2] == ["0", "1"] and float(memory[2]) > 0 and memory[3] == "1.000"
    args = cost_model.ModelArgs(
        vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, n_prelude=1, n_core=2, n_coda=1
    )
    flops = [cost_model.training_flops_per_token(args, (r - 1, 1), 16).total for r in (1, 2)]
    assert r1[0] == "1" and r1[3] == "1.00"
    assert r2[0] == "2" and r2[3] == f"{flops[1] / flops[0]:.2f}" != "1.00"


def test_bench_precision_errors_are_bf16_sized():
    """bf16 against fp32 on the same random model: logits differ at bf16's resolution, neither 0 nor O(1)."""
    done = subprocess.run(
        [sys.executable, "tools/bench_precision.py", *TINY_SHAPE_FLAGS, "--batch", "1"]
        + ["--recurrences", "1,2", "--time-r", "0", "--seeds", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    rows = markdown_rows(done.stdout)
    assert [(row[0], row[1]) for row in rows] == [("1", "fsdp"), ("1", "autocast"), ("2", "fsdp"), ("2", "autocast")]
    for row in rows:
        assert 1e-4 < float(row[2].split()[0]) < 5e-2, row


@pytest.mark.slow
def test_bench_data_measures_every_backend_and_the_pre_tokenized_loader():
    """Tokenizers trained on the bundled corpus (nothing downloaded), then tokens/s of each loader path."""
    done = subprocess.run(
        [sys.executable, "tools/bench_data.py", "--vocab", "400", "--seconds", "0.2", "--seq-len", "64"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    rates = {
        line.split("  ")[1].split(" (")[0].strip(): float(line.split()[-2].replace(",", ""))
        for line in done.stdout.splitlines()
        if line.startswith(("tokenize+pack", "pre-tokenized"))
    }
    assert set(rates) == {"HF tokenizers", "tiktoken", "sentencepiece", "parquet rows"}, done.stdout
    assert all(rate > 0 for rate in rates.values()), rates


@pytest.mark.parametrize(
    "argv, words",
    [
        (["quality", "--checkpoint", "{missing}", "--data", "{corpus}"], ["{missing}", "no such checkpoint"]),
        (["task", "--checkpoint", "{missing}", "--task-dir", "{tmp}"], ["{missing}", "no such checkpoint"]),
        (["speculative", "--checkpoint", "{missing}", "--task-dir", "{tmp}"], ["{missing}", "no such checkpoint"]),
        (
            ["task", "--checkpoint", "{model}", "--task-dir", "{tmp}", "--lengths", "6-7"],
            ["--task-dir", "eval_6.jsonl"],
        ),
        (["speculative", "--checkpoint", "{model}", "--task-dir", "{tmp}", "--lengths", "x"], ["--lengths"]),
    ],
)
def test_bench_generate_input_errors_are_one_line(tmp_path: Path, capsys, argv: list[str], words: list[str]):
    """A missing model or task folder: one line, exit 2, before any model is loaded."""
    from tests.torchrun_util import load_tool

    paths = {"{missing}": str(tmp_path / "missing"), "{corpus}": str(REPO_ROOT / "assets" / "corpus" / "math.jsonl")}
    paths |= {"{tmp}": str(tmp_path), "{model}": str(MODEL)}
    argv = [paths.get(a, a) for a in argv]
    assert load_tool("bench_generate").main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_generate.py: error: "), lines
    assert all(paths.get(w, w) in lines[0] for w in words), lines[0]


# --- tools/bench_gpu.sh on a bare GPU machine ---------------------------------------------------


def bare_gpu_machine(tmp_path: Path) -> dict[str, str]:
    """The environment a lent GPU machine gives tools/bench_gpu.sh: no .venv (a `python3` on PATH holds torch and
    transformers: here one that runs this interpreter), titan_recur not installed (the editable install's finder is
    shadowed), no `datasets` or `torchdata` (modules that raise ImportError shadow them) and $OUT a folder."""
    site = tmp_path / "site"
    (site / "torchdata").mkdir(parents=True)
    refusal = "raise ImportError('not installed on this machine')\n"
    (site / "datasets.py").write_text(refusal)
    (site / "torchdata" / "__init__.py").write_text(refusal)
    for finder in Path(sysconfig.get_paths()["purelib"]).glob("__editable___titan_recur*_finder.py"):
        (site / finder.name).write_text("def install() -> None:\n    pass  # titan_recur is not installed here\n")
    python3 = tmp_path / "bin" / "python3"
    python3.parent.mkdir()
    python3.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python3.chmod(0o755)
    (tmp_path / "out").mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PY", "BENCH_JSONL", "PYTHONPATH")}
    return env | {
        "PATH": f"{python3.parent}{os.pathsep}{env['PATH']}",
        "PYTHONPATH": str(site),
        "VENV_PYTHON": str(tmp_path / "no_venv" / "bin" / "python"),
        "OUT": str(tmp_path / "out"),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }


def test_the_bare_machine_lacks_titan_recur_datasets_and_torchdata(tmp_path: Path):
    """The stand-in hides what it says it hides."""
    env = bare_gpu_machine(tmp_path)
    for module in ("titan_recur", "datasets", "torchdata"):
        done = subprocess.run(["python3", "-c", f"import {module}"], cwd=tmp_path, env=env, capture_output=True)
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 1 and last.startswith((b"ImportError", b"ModuleNotFoundError")), (module, last)


def test_the_gpu_benchmarks_import_without_datasets_and_torchdata(tmp_path: Path):
    """P0-10 item 4: bench_step (the trainer) and bench_generate imported `datasets` and `torchdata`, which a GPU
    machine may lack, though they read no data; the data loader now imports them where it reads or loads."""
    env = bare_gpu_machine(tmp_path)
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env['PYTHONPATH']}"  # as tools/bench_gpu.sh sets it
    code = "import sys; sys.path.insert(0, 'tools'); import bench_generate, bench_step, titan_recur.training.trainer"
    done = subprocess.run(["python3", "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_bench_gpu_dry_run_writes_every_point_on_a_bare_machine(tmp_path: Path):
    """P0-10 item 4: tools/bench_gpu.sh gave no figure on a GPU machine (it wrote its JSON lines to $OUT, which is
    a folder there; it wanted .venv/bin/python, an installed titan_recur, datasets and torchdata). DRY_RUN=1 runs
    WINDOW=1's points on the CPU, tiny, in that machine's environment: each one writes its JSON lines."""
    env = bare_gpu_machine(tmp_path) | {"DRY_RUN": "1"}
    done = subprocess.run(["bash", "tools/bench_gpu.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    points = [json.loads(line) for line in (out / "bench_gpu.jsonl").read_text().splitlines()]
    assert not [p for p in points if "failed" in p], done.stdout[-3000:]
    assert [(p["bench"], p["batch"], p["engine"]) for p in points[:3]] == [
        ("decode_speed", batch, "full") for batch in (1, 8, 64)
    ]
    assert points[3]["bench"] == "decode_check" and points[3]["argmax_agreement"] > 0.9
    assert [(p["local_batch"], p["ac_mode"], p["device"]) for p in points[4:]] == [
        (8, "per_iteration", "cpu"),
        (16, "per_iteration", "cpu"),
        (8, "none", "cpu"),
    ]
    log = (out / "bench_gpu.log").read_text()
    assert log.startswith("== python: python3\n")  # no .venv: the python3 on PATH
    assert log.count("| batch | r | engine |") == 3 and "fast vs eager" in log and log.count("tok/s/device") == 3
