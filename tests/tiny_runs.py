"""Tiny training runs driven through the real CLI: a run config for a tiny model on the bundled corpus,
launching, killing and reading runs (metrics, checkpoints, final models, the one error line).

Shared by the checkpoint, fault, safety, operator-error and Slurm tests."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.torchrun_util import REPO_ROOT, WORKERS_DIR
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.checkpoint import ModelState, load_from
from titan_recur.storage.model_io import WEIGHTS_NAME, read_model_args

TRAIN = ["-m", "titan_recur.train"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
LAUNCH_TIMEOUT = 240
CORPUS = REPO_ROOT / "assets" / "corpus"

CONFIG = """
[job]
seed = 0
deterministic = true

[model]
path = "{model}"

[training]
steps = 12
local_batch_size = 2
global_batch_size = 8
seq_len = 16
ac_mode = "per_iteration"

[recurrence]
mean_recurrence = 3
backprop_depth = 2
curriculum = "linear"
warmup_fraction = 0.5

[optimizer]
name = "muon"
lr = 0.01
adamw_lr = 0.003

[checkpoint]
interval = 3
keep_latest_k = 2

[metrics]
log_freq = 1
enable_tensorboard = false
"""
CORPUS_DATA = f"""
[[data.sources]]
name = "general"
path = "{CORPUS / "general.jsonl"}"
kind = "jsonl"
shuffle_buffer = 8

[[data.sources]]
name = "math"
path = "{CORPUS / "math.jsonl"}"
kind = "jsonl"
shuffle_buffer = 8
"""


def write_config(path: Path, model: Path, data: str) -> Path:
    path.write_text(CONFIG.format(model=model) + data)
    return path


# ------------------------------------------------------------------------------------------ helpers


def read_metrics(dump: Path) -> list[dict]:
    """Complete lines of metrics.jsonl (a line being written while a run is killed is skipped)."""
    path = dump / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def assert_logged_as_reference(records: list[dict], reference: list[dict], note: str = "") -> None:
    """Every logged loss and grad norm equals the reference run's at the same step, bit for bit."""
    ref = {r["step"]: r for r in reference}
    for r in records:
        step = r["step"]
        assert (r["loss"], r["grad_norm"]) == (ref[step]["loss"], ref[step]["grad_norm"]), f"step {step} {note}"


def assert_same_final_model(dump: Path, reference: Path) -> None:
    got, want = (load_file(str(d / "final_model" / WEIGHTS_NAME)) for d in (dump, reference))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def read_checkpoint(folder: Path, tmp: Path) -> dict:
    """Everything in a DCP step folder (tensors and the pickled non-tensor state), without a process group."""
    out = tmp / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def assert_equal_nested(a: object, b: object, path: str = "") -> None:
    if isinstance(a, bytes):  # a rank-local pickled blob: compare what it holds
        assert isinstance(b, bytes), path
        assert_equal_nested(pickle.loads(a), pickle.loads(b), path)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_equal_nested(a[key], b[key], f"{path}.{key}")
    else:
        assert a == b, path


def load_model_from_step(model_dir: Path, folder: Path) -> dict[str, torch.Tensor]:
    model = RecurrentLM(read_model_args(model_dir))
    load_from(folder, {"model": ModelState(model)})
    return model.state_dict()


def start_torchrun(args: list[str], log: Path) -> subprocess.Popen:
    """torchrun with 2 ranks in a new session, output to ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def start_ranks(args: list[str], nproc: int, logs: Path) -> list[subprocess.Popen]:
    """One process per rank without a launcher (as ``srun`` starts them), so each exit code is visible."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        env = {
            **ENV,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(nproc),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nproc),
        }
        with open(logs / f"rank{rank}.log", "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def wait_for_step(dump: Path, step: int, procs: list[subprocess.Popen], log: Path, logged_before: int = 0) -> None:
    """Until this launch (the metrics lines after ``logged_before``) has logged ``step`` or a later one."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not any(r["step"] >= step for r in read_metrics(dump)[logged_before:]):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                kill_group(p)
            raise AssertionError(f"run ended or timed out before step {step}:\n{log.read_text()[-6000:]}")
        time.sleep(0.05)


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, queue = [], [root]
    while queue:
        tree.append(queue.pop())
        queue += children.get(tree[-1], [])
    return tree


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process groups of ``proc`` and of every descendant (torchrun starts each worker in its
    own session, so killing torchrun's group alone would leave the workers running)."""
    if proc.poll() is None:
        groups = set()
        for pid in process_tree(proc.pid):
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def resumed_step(output: str) -> int:
    """The step a run resumed from, from its log (0: started fresh)."""
    steps = re.findall(r"\] resumed from \S+ at step (\d+)", output)
    return int(steps[-1]) if steps else 0


def run_single_jobs(jobs: list[dict], tmp: Path) -> list[dict]:
    """Single-process runs in one interpreter (tests/dist_workers/ckpt_worker.py)."""
    jobs_file, results_file = tmp / "jobs.json", tmp / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    proc = subprocess.run(
        [sys.executable, str(WORKERS_DIR / "ckpt_worker.py"), str(jobs_file), str(results_file)],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(results_file.read_text())


def error_line(result: dict) -> str:
    """The run's error: exactly one line starting with 'error:' on stderr, and no traceback."""
    lines = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    return lines[0]


# ---------------------------------------------------------------------------- the training worker

WORKER = str(Path("tests") / "dist_workers" / "train_worker.py")
STEPS = 5  # the optimizer steps of a worker run


def run_single(args: list[str]) -> None:
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, WORKER, *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def worker_args(model_dir: Path, tmp: Path, name: str, *extra: str) -> tuple[list[str], Path]:
    out = tmp / f"{name}.pt"
    return ["--model", str(model_dir), "--dump", str(tmp / name), "--out", str(out), *extra], out
