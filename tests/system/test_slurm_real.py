"""The shipped launcher under a real Slurm: a private two-node cluster on this machine (tests/slurm_cluster.py).

slurm/llama1b_retrofit.sh trains the debug config on 2 nodes x 1 rank (torchrun's c10d rendezvous,
gloo). SIGUSR1 to the batch shell, as ``--signal=B:USR1@300`` sends it before the time limit, must
give: a checkpoint and exit 42, the launcher's self-requeue, a resume from that checkpoint and a
finished run whose model equals an uninterrupted 2-rank run's, with no traceback in the job log.
Skipped (with the reason) without Slurm and munge or without root; TITAN_RECUR_REQUIRE_SLURM=1 (CI)
makes that a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.slurm_cluster import TERMINAL_JOB_STATES, SlurmCluster, clean_env, free_ports, missing, poll, tail
from tests.tiny_runs import assert_same_final_model, resumed_step
from tests.torchrun_util import REPO_ROOT, run_torchrun
from titan_recur.storage.checkpoint import scan_checkpoints
from titan_recur.utils.exit_codes import EXIT_PREEMPTED

CONFIG = "train_configs/debug_model.toml"
# Short and exact: 12 tiny steps, a checkpoint every 2, bit-reproducible kernels.
OVERRIDES = [
    "--training.steps",
    "12",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "32",
    "--checkpoint.interval",
    "2",
    "--validation.enable",
    "false",
    "--metrics.enable_tensorboard",
    "false",
    "--job.deterministic",
    "true",
]
# Hang guards only: every wait polls for its event.
CHECKPOINT_TIMEOUT_S = 300.0
FORWARD_TIMEOUT_S = 120.0
JOB_TIMEOUT_S = 400.0
REFERENCE_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    """The private cluster for this module, stopped at its end (also when a test failed)."""
    reason = missing()
    if reason is not None:
        if os.environ.get("TITAN_RECUR_REQUIRE_SLURM") == "1":
            pytest.fail(f"TITAN_RECUR_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    running = SlurmCluster.start()
    try:
        yield running
    finally:
        running.stop()


def job_env(cluster: SlurmCluster, run_name: str) -> dict[str, str]:
    """What sbatch exports to the job: this cluster, the launcher's settings, this checkout and interpreter."""
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = clean_env(
        PATH=cluster.env["PATH"],
        SLURM_CONF=cluster.env["SLURM_CONF"],
        CONFIG=CONFIG,
        RUN_NAME=run_name,
        GPUS_PER_NODE="1",
        RDZV_HOST="127.0.0.1",  # the node names n1, n2 do not resolve on this machine
        RDZV_PORT=str(free_ports(1)[0]),
        PYTHONPATH=python_path,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    if sys.prefix != sys.base_prefix:  # the launcher activates it: its torchrun, this interpreter
        env["VENV"] = sys.prefix
    return env


def submit(cluster: SlurmCluster, run_name: str, log: Path) -> int:
    """sbatch the shipped script, asking only for what this CPU cluster has (no GPUs, 1 CPU per node)."""
    done = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            f"--output={log}",
            "slurm/llama1b_retrofit.sh",
            *OVERRIDES,
        ],
        cwd=REPO_ROOT,
        env=job_env(cluster, run_name),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


def trainer_pids(run_name: str) -> list[int]:
    """The run's trainers (torchrun's workers): its dump folder on their command line, LOCAL_RANK set."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"titan_recur.train" not in argv or f"outputs/{run_name}".encode() not in argv:
                continue
            if not any(v.startswith(b"LOCAL_RANK=") for v in (proc / "environ").read_bytes().split(b"\0")):
                continue  # a torchrun agent
        except OSError:  # gone meanwhile
            continue
        pids.append(int(proc.name))
    return pids


def still_running(cluster: SlurmCluster, job_id: int, log: Path) -> None:
    """AssertionError with the job log when the job has ended (so a wait for its progress stops)."""
    state = cluster.job(job_id).get("JobState")
    assert state not in TERMINAL_JOB_STATES, f"job {job_id} ended ({state}) early\n{tail(log)}"


def preempt(cluster: SlurmCluster, job_id: int, run_name: str, log: Path) -> None:
    """Once a checkpoint exists, SIGUSR1 to the batch shell only: ``scancel --signal=USR1 --batch``.

    The trainers are paused (SIGSTOP) from then until both torchrun agents have passed the signal on
    to them, so however fast this machine trains, the signal lands mid-run.
    """
    checkpoints = REPO_ROOT / "outputs" / run_name / "checkpoints"

    def checkpointed() -> bool:
        still_running(cluster, job_id, log)
        return bool(checkpoints.is_dir() and scan_checkpoints(checkpoints).complete)

    poll(checkpointed, "a first complete checkpoint", CHECKPOINT_TIMEOUT_S, lambda: tail(log))
    pids = trainer_pids(run_name)
    assert len(pids) == 2, f"trainer processes {pids}, expected 2\n{tail(log)}"
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        cluster.client("scancel", "--signal=USR1", "--batch", str(job_id))
        forwarded = [f"Sending process {pid} closing signal SIGUSR1" for pid in pids]
        poll(
            lambda: all(line in log.read_text() for line in forwarded),
            "torchrun forwarding SIGUSR1 to both trainers",
            FORWARD_TIMEOUT_S,
            lambda: tail(log),
        )
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # a trainer that died keeps its own error
                os.kill(pid, signal.SIGCONT)


def wait_until_ended(cluster: SlurmCluster, job_id: int, log: Path) -> dict[str, str]:
    """The job's final ``scontrol show job`` record, once it has ended (requeued runs included)."""
    record: dict[str, str] = {}

    def ended() -> bool:
        record.update(cluster.job(job_id))
        return record.get("JobState") in TERMINAL_JOB_STATES

    poll(ended, f"job {job_id} requeued and ended", JOB_TIMEOUT_S, lambda: tail(log))
    return record


def assert_preempted_requeued_resumed(text: str, run_name: str, job_id: int) -> None:
    """The job log tells the whole story, in the launcher's and the trainer's words, without a traceback."""
    assert "Traceback" not in text, text
    assert "[launch] SIGUSR1 (time limit near): forwarding to the job step" in text, text
    saved = re.search(
        rf"preemption signal at step (\d+): checkpoint outputs/{run_name}/checkpoints/step-\1 written; "
        rf"exiting with {EXIT_PREEMPTED}",
        text,
    )
    assert saved, text
    assert re.search(r"\[launch\] torchrun on n[12]: got SIGUSR1", text), text
    assert f"[launch] preempted: scontrol requeue {job_id}" in text, text
    assert f"dump folder outputs/{run_name} (restart 1)" in text, text
    assert resumed_step(text) == int(saved[1]), text
    assert "[launch] training finished" in text, text


@pytest.mark.slow
def test_preempted_job_requeues_resumes_and_matches_an_uninterrupted_run(cluster, tmp_path):
    run_name = f"slurm_real_{uuid.uuid4().hex[:8]}"
    dump, reference, log = REPO_ROOT / "outputs" / run_name, tmp_path / "reference", tmp_path / "job.out"
    uninterrupted = ["-m", "titan_recur.train", "--config", CONFIG, "--job.dump_folder", str(reference), *OVERRIDES]
    # The uninterrupted run trains alongside the job (it fills the job's waits on 2 cores).
    with ThreadPoolExecutor(max_workers=1) as pool:
        reference_run = pool.submit(run_torchrun, uninterrupted, 2, REFERENCE_TIMEOUT_S)
        try:
            job_id = submit(cluster, run_name, log)
            preempt(cluster, job_id, run_name, log)
            record = wait_until_ended(cluster, job_id, log)
            text = log.read_text()
            assert (record["JobState"], record["Restarts"]) == ("COMPLETED", "1"), text
            assert_preempted_requeued_resumed(text, run_name, job_id)
            reference_run.result()
            assert_same_final_model(dump, reference)
        finally:
            shutil.rmtree(dump, ignore_errors=True)
