"""Slurm recipes: syntax, headers, the dry-run commands and the requeue logic, with fake srun/scontrol.

No Slurm is needed: the launcher's dry run fakes the allocation from SLURM_* variables, and the real
path runs against small stand-ins for srun and scontrol that record how they were called.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import clean_env
from titan_recur.config import load_config

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "slurm"
SCRIPTS = {
    "llama1b_retrofit.sh": "train_configs/llama3_2_1b.toml",
    "tinyllama_retrofit.sh": "train_configs/tinyllama.toml",
    "olmo2_retrofit.sh": "train_configs/olmo2_1b.toml",
}
TWO_NODES = {
    "SLURM_JOB_ID": "12345",
    "SLURM_JOB_NODELIST": "gpu[001-002]",
    "SLURM_NNODES": "2",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_CPUS_PER_TASK": "64",
}
PASS_THROUGH = ["--training.steps", "100", "--job.description", "two words"]
NODE_LINE = re.compile(r"^\[launch\] node (\d+) (\S+): (.*)$")


# Stands in for the dry run's preflight (`python -m titan_recur.train ... --check`): records its argv.
FAKE_PYTHON = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_CHECK_ARGS"
if [[ -n ${FAKE_CHECK_ERROR:-} ]]; then echo "error: $FAKE_CHECK_ERROR" >&2; exit 2; fi
echo "[titan_recur] check passed"
"""


@pytest.fixture
def fake_python(tmp_path) -> dict[str, str]:
    """Environment entries that make the dry run's preflight a recording stand-in."""
    script = tmp_path / "fake_python"
    script.write_text(FAKE_PYTHON)
    script.chmod(0o755)
    return {"PYTHON": str(script), "FAKE_CHECK_ARGS": str(tmp_path / "check.args")}


def run_script(script: Path, args: list[str], env: dict[str, str], cwd: Path, timeout: float = 20):
    return subprocess.run(
        ["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("script", sorted(p.name for p in SLURM.glob("*.sh")))
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_model_script_is_covered():
    assert {p.name for p in SLURM.glob("*_retrofit.sh")} == set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_sbatch_headers(script):
    lines = (SLURM / script).read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("#"))
    headers = [line for line in lines if line.startswith("#SBATCH")]
    # sbatch stops reading directives at the first command.
    assert all(lines.index(h) < first_command for h in headers)
    options = dict(h.split()[1].lstrip("-").split("=", 1) for h in headers if "=" in h)
    flags = {h.split()[1] for h in headers if "=" not in h.split()[1]}
    assert options["ntasks-per-node"] == "1"
    assert options["gpus-per-node"] == "8"
    assert int(options["nodes"]) * 8 * 16 == 1024  # 64 GPUs x 16 sequences = the global batch
    assert int(options["cpus-per-task"]) >= 16
    assert re.fullmatch(r"\d+:\d\d:\d\d|\d+-\d+(:\d\d){0,2}", options["time"])
    assert options["signal"] == "B:USR1@300"
    assert options["output"] == "logs/%x-%j.out"
    assert options["open-mode"] == "append"  # a requeued job appends to its log
    assert "--requeue" in flags


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_script_launches_its_config(script, tmp_path, fake_python):
    """Each batch script hands the shared launcher its own default config (a dry run shows the command)."""
    result = run_script(SLURM / script, ["--dry-run"], clean_env(**TWO_NODES, **fake_python), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    node = next(NODE_LINE.match(line) for line in result.stdout.splitlines() if NODE_LINE.match(line))
    argv = shlex.split(node[3])
    assert argv[argv.index("--config") + 1] == SCRIPTS[script]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_default_config_parses(script):
    load_config(str(REPO / SCRIPTS[script]))


def test_dry_run_two_nodes(tmp_path, fake_python):
    """2 nodes x 8 GPUs: one torchrun line per node, c10d on the head node, args passed through."""
    env = clean_env(**TWO_NODES, **fake_python)
    result = run_script(SLURM / "llama1b_retrofit.sh", ["--dry-run", *PASS_THROUGH], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    nodes = [NODE_LINE.match(line) for line in out if NODE_LINE.match(line)]
    assert [(m[1], m[2]) for m in nodes] == [("0", "gpu001"), ("1", "gpu002")]
    expected_tail = [
        "-m",
        "titan_recur.train",
        "--config",
        "train_configs/llama3_2_1b.toml",
        "--job.dump_folder",
        "outputs/llama3_2_1b",
        *PASS_THROUGH,
    ]
    for m in nodes:
        argv = shlex.split(m[3])
        assert argv[0] == "torchrun"
        opts = dict(itertools.pairwise(argv[1:]))
        assert opts["--nnodes"] == "2"
        assert opts["--nproc-per-node"] == "8"
        assert opts["--rdzv-backend"] == "c10d"
        assert opts["--rdzv-endpoint"] == "gpu001:29500"
        assert opts["--rdzv-id"] == "12345"
        assert "SIGUSR1" in opts["--signals-to-handle"].split(",")
        assert "--node-rank" not in argv and "--node_rank" not in argv  # c10d assigns node ranks
        assert argv[-len(expected_tail) :] == expected_tail
    # The srun line: one task per node, all nodes, the torchrun command after it.
    command = next(line for line in out if line.startswith("[launch] command: "))
    argv = shlex.split(command.removeprefix("[launch] command: "))
    assert argv[0] == "srun"
    srun_opts = argv[: argv.index("torchrun")]
    for opt in ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=64"):
        assert opt in srun_opts
    assert shlex.join(argv[argv.index("torchrun") :]) == shlex.join(shlex.split(nodes[0][3]))
    assert any("scontrol requeue 12345" in line and "42" in line for line in out)
    assert out[-1] == "[launch] dry run: nothing was started"
    # What the trainer receives is a valid command line for the config.
    trainer_args = shlex.split(nodes[0][3])
    trainer_args = trainer_args[trainer_args.index("--config") + 2 :]
    cfg = load_config(str(REPO / "train_configs/llama3_2_1b.toml"), trainer_args)
    assert cfg.training.steps == 100 and cfg.job.dump_folder == "outputs/llama3_2_1b"


def test_dry_run_defaults_without_slurm(tmp_path, fake_python):
    """Outside Slurm: the #SBATCH --nodes of the script, 8 GPUs, placeholder hosts; env overrides apply."""
    env = clean_env(DRY_RUN="1", CONFIG="train_configs/llama3_2_1b_2_4_2.toml", RDZV_PORT="29600", **fake_python)
    result = run_script(SLURM / "llama1b_retrofit.sh", [], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    nodes = [NODE_LINE.match(line) for line in result.stdout.splitlines() if NODE_LINE.match(line)]
    assert [m[2] for m in nodes] == [f"node{i}" for i in range(8)]
    argv = shlex.split(nodes[0][3])
    assert argv[argv.index("--nnodes") + 1] == "8"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "node0:29600"
    assert argv[-4:] == [
        "--config",
        "train_configs/llama3_2_1b_2_4_2.toml",
        "--job.dump_folder",
        "outputs/llama3_2_1b_2_4_2",
    ]


def test_dry_run_runs_the_preflight_for_the_allocation(tmp_path, fake_python):
    """The trainer's --check on the head node, with the passed-through args and nodes x GPUs ranks."""
    result = run_script(
        SLURM / "llama1b_retrofit.sh", ["--dry-run", *PASS_THROUGH], clean_env(**TWO_NODES, **fake_python), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    argv = Path(fake_python["FAKE_CHECK_ARGS"]).read_text().splitlines()
    assert argv == [
        "-m",
        "titan_recur.train",
        "--config",
        "train_configs/llama3_2_1b.toml",
        "--job.dump_folder",
        "outputs/llama3_2_1b",
        *PASS_THROUGH,
        "--check",
        "--world-size",
        "16",
    ]
    assert "[titan_recur] check passed" in result.stdout


def test_dry_run_fails_when_the_preflight_fails(tmp_path, fake_python):
    env = clean_env(**TWO_NODES, **fake_python, FAKE_CHECK_ERROR="model.path x: no such folder")
    result = run_script(SLURM / "llama1b_retrofit.sh", ["--dry-run"], env, cwd=tmp_path)
    assert result.returncode == 2
    assert "error: model.path x: no such folder" in result.stderr and "preflight failed (status 2)" in result.stderr
    assert "dry run: nothing was started" not in result.stdout
    skipped = run_script(SLURM / "llama1b_retrofit.sh", ["--dry-run"], {**env, "PREFLIGHT": "0"}, cwd=tmp_path)
    assert skipped.returncode == 0 and "preflight: skipped" in skipped.stdout


def test_dry_run_preflight_with_the_real_trainer(tmp_path):
    """The real check, on the debug config: a missing model folder fails the dry run in one line."""
    env = clean_env(
        DRY_RUN="1",
        CONFIG="train_configs/debug_model.toml",
        SLURM_NNODES="1",
        GPUS_PER_NODE="2",
        PYTHON=sys.executable,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
    )
    result = run_script(SLURM / "launch.sh", ["--model.path", "no/such/model"], env, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: model.path no/such/model: no such folder (convert a model first: tools/convert_hf.py)"]


def test_not_in_slurm_without_dry_run_fails(tmp_path):
    result = run_script(SLURM / "olmo2_retrofit.sh", [], clean_env(), cwd=tmp_path)
    assert result.returncode == 2
    assert "not inside a Slurm job" in result.stderr


def test_expand_hostlist():
    """The fallback for `scontrol show hostnames` (zero padding, lists, several bracket groups)."""
    script = f'LAUNCH_LIB_ONLY=1 source {shlex.quote(str(SLURM / "launch.sh"))}; expand_hostlist "$1"'
    cases = {
        "gpu[001-003,7],cpu5": ["gpu001", "gpu002", "gpu003", "gpu7", "cpu5"],
        "r[1-2]n[08-10]": ["r1n08", "r1n09", "r1n10", "r2n08", "r2n09", "r2n10"],
        "node[8-11]": ["node8", "node9", "node10", "node11"],
        "a-1,b-2": ["a-1", "b-2"],
    }
    for nodelist, hosts in cases.items():
        result = subprocess.run(["bash", "-c", script, "x", nodelist], capture_output=True, text=True)
        assert result.stdout.split() == hosts, nodelist


# ---------------------------------------------------------------- the real path, against fake srun/scontrol

FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/srun.args"
mode=${FAKE_SRUN_MODE:-exit:0}
if [[ $mode == exit:* ]]; then exit "${mode#exit:}"; fi
# Like torchrun: exits (status 1) once it got SIGUSR1; or when the test writes a status to "stop".
trap 'echo USR1 >> "$FAKE_DIR/srun.signals"; exit 1' USR1
touch "$FAKE_DIR/srun.started"
for _ in $(seq 1 400); do
  if [[ -f $FAKE_DIR/stop ]]; then exit "$(cat "$FAKE_DIR/stop")"; fi
  sleep 0.02
done
exit 99
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then echo "${3//,/$'\\n'}"; exit 0; fi
echo "$*" >> "$FAKE_DIR/scontrol.calls"
exit "${FAKE_SCONTROL_STATUS:-0}"
"""


@pytest.fixture
def fake_cluster(tmp_path):
    """A copy of the repository's slurm/ + one config, and fake srun/scontrol first on PATH."""
    repo = tmp_path / "repo"
    shutil.copytree(SLURM, repo / "slurm")
    (repo / "train_configs").mkdir()
    shutil.copy(REPO / "train_configs/llama3_2_1b.toml", repo / "train_configs")
    bin_dir, fake = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir()
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_DIR=str(fake),
        REPO=str(repo),
        SLURM_JOB_ID="777",
        SLURM_JOB_NODELIST="n1,n2",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="4",
    )
    return repo, fake, env


def scontrol_calls(fake: Path) -> list[str]:
    calls = fake / "scontrol.calls"
    return calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize(
    "srun_status, extra_env, expected_rc, requeued",
    [
        (0, {}, 0, False),  # finished
        (42, {}, 0, True),  # preempted: requeue
        (1, {}, 1, False),  # crash: no requeue
        (3, {}, 3, False),  # non-finite loss: no requeue
        (42, {"SLURM_RESTART_COUNT": "5", "MAX_REQUEUES": "5"}, 42, False),  # requeue budget spent
        (42, {"FAKE_SCONTROL_STATUS": "1"}, 42, True),  # requeue refused by Slurm
    ],
)
def test_exit_status_and_requeue(fake_cluster, srun_status, extra_env, expected_rc, requeued):
    repo, fake, env = fake_cluster
    env.update(FAKE_SRUN_MODE=f"exit:{srun_status}", **extra_env)
    result = run_script(repo / "slurm/llama1b_retrofit.sh", ["--training.steps", "7"], env, cwd=repo)
    assert result.returncode == expected_rc, result.stdout + result.stderr
    assert scontrol_calls(fake) == (["requeue 777"] if requeued else [])
    args = (fake / "srun.args").read_text().splitlines()
    assert args[: args.index("torchrun")] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert args[args.index("--nproc-per-node") + 1] == "4"
    assert args[args.index("--rdzv-endpoint") + 1] == "n1:29500"
    assert args[-6:] == [
        "--config",
        "train_configs/llama3_2_1b.toml",
        "--job.dump_folder",
        "outputs/llama3_2_1b",
        "--training.steps",
        "7",
    ]
    assert (repo / "logs").is_dir() and (repo / "outputs/llama3_2_1b").is_dir()


def wait_for(path: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def start_waiting_launch(repo, env: dict) -> subprocess.Popen:
    """The batch script with a fake srun that blocks until the test releases it."""
    env["FAKE_SRUN_MODE"] = "wait"
    return subprocess.Popen(
        ["bash", str(repo / "slurm/llama1b_retrofit.sh")],
        env=env,
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_usr1_is_forwarded_and_requeues(fake_cluster):
    """--signal=B:USR1@300: the batch shell forwards SIGUSR1 to srun, then requeues on its failure."""
    repo, fake, env = fake_cluster
    proc = start_waiting_launch(repo, env)
    try:
        wait_for(fake / "srun.started")
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert (fake / "srun.signals").read_text().split() == ["USR1"]  # forwarded exactly once
    assert proc.returncode == 0, out
    assert scontrol_calls(fake) == ["requeue 777"]
    assert "SIGUSR1" in out


def test_sigterm_does_not_requeue(fake_cluster):
    """scancel / scheduler preemption: SIGTERM reaches the step from Slurm; the shell waits, no requeue."""
    repo, fake, env = fake_cluster
    proc = start_waiting_launch(repo, env)
    try:
        wait_for(fake / "srun.started")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert proc.poll() is None  # still waiting for the step to finish its checkpoint
        (fake / "stop").write_text("1")
        out, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert not (fake / "srun.signals").exists()  # not forwarded: Slurm signals the step itself
    assert proc.returncode == 1, out
    assert scontrol_calls(fake) == []


def test_the_torchrun_stand_in_logs_a_lost_exit_barrier_store_in_one_line():
    """A finished run's agents meet at an exit barrier on the rendezvous store; when the agent hosting the store
    exits first, torch logs a traceback on the others (seen in the real-Slurm test under load). The stand-in's
    program turns that record into one line; torch's own logger and a fake main() stand in for the race."""
    program = re.search(r"TORCHRUN_QUIET_PY='(.*?)'\n", (SLURM / "launch.sh").read_text(), re.S).group(1)
    race = """
import torch.distributed.run
from torch.distributed.elastic.utils.logging import get_logger


def main():
    try:
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")
    except RuntimeError:
        get_logger("torch.distributed.elastic.agent.server.api").exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.01)


torch.distributed.run.main = main
"""
    result = subprocess.run([sys.executable, "-c", race + program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "Failed to recv" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()  # torch's logging prefix, then the message
    assert line.endswith(
        "] exit barrier: the rendezvous store ended before this node left it (its workers had finished)"
    )
