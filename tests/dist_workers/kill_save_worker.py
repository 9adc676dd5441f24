"""kill -9 at random moments inside checkpoint saves of a 2-rank run, then resume; and frozen ranks
(SIGSTOP). See tests/system/test_safety.py.

Usage: kill_save_worker.py SPEC.json RESULT.json. SPEC: {"argv": trainer args (without the dump folder),
"root": folder, "world": 2, "kills": 10, "seed": int, "steps": int, "modes": ["disabled", "async"],
"stalls": {NAME: {"argv": trainer args (without the dump folder; "{timeout}" becomes the stall timeout),
"after_step": int}}}.

This process imports the trainer once and forks every rank of every launch from itself (gloo, CPU),
so a launch costs a process-group start and a Trainer build, not an interpreter start. It runs one
uninterrupted reference, timing its saves (from ``step-N.partial`` appearing to ``step-N``
appearing); then per checkpoint.async_mode ``kills`` launches, each killed (SIGKILL to a random rank,
the other up to 20 ms later) a random fraction (0-1.5) of a save duration after the ``.partial``
folder of the next or second-next step appeared; after each kill it checks every complete step folder
against its manifest; then a final launch runs to the end. The draws come from
``random.Random(seed)``. Each stall launch SIGSTOPs the last rank once ``after_step`` is logged and
records how long rank 0 takes to exit; its timeouts are derived from the reference's step times on this
machine (``stall_timeout``). RESULT: {"reference": dump, "save_seconds": [...], MODE: {"dump",
"kills": [{"step", "delay", "in_save", "complete"}], "final_rc"}, "stall_timeout_s": int, "stalls": {NAME: {"rc": rank 0's exit
code, "seconds": from the SIGSTOP to that exit, "log": rank 0's output}}}.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

import titan_recur.cli.train as train
from titan_recur.storage.checkpoint import scan_checkpoints, verify_checkpoint

# What the trainer imports lazily, once here rather than in every forked rank (deterministic mode
# imports torch._inductor: seconds).
torch.use_deterministic_algorithms(True)

POLL_S = 0.0005
LAUNCH_TIMEOUT_S = 300


class Launch:
    """One process per rank forked from this one, each running titan_recur.cli.train.main(argv)."""

    def __init__(self, argv: list[str], world: int, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.pids, self.codes = [], {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                os.environ.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    WORLD_SIZE=str(world),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world),
                )
                fd = os.open(f"{log}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = 1
                try:
                    code = train.main(argv)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            self.pids.append(pid)

    def poll(self) -> bool:
        """True once any rank has exited (its code is kept)."""
        for pid in self.pids:
            if pid not in self.codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[pid] = os.waitstatus_to_exitcode(status)
        return bool(self.codes)

    def wait(self) -> list[int]:
        for pid in self.pids:
            if pid not in self.codes:
                self.codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return [self.codes[pid] for pid in self.pids]

    def kill(self, rng: random.Random) -> None:
        """SIGKILL a random rank, then the others a few milliseconds later (as a launcher tearing down)."""
        first = rng.randrange(len(self.pids))
        order = [self.pids[first]] + [pid for i, pid in enumerate(self.pids) if i != first]
        for i, pid in enumerate(order):
            if i == 1:
                time.sleep(rng.uniform(0, 0.02))
            if pid not in self.codes:
                os.kill(pid, signal.SIGKILL)
        self.wait()

    def wait_until(self, condition) -> bool:
        """Poll until ``condition()``; False when a rank exited first."""
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not condition():
            if self.poll() or time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True


def reference_run(argv: list[str], world: int, dump: Path, log: Path) -> list[float]:
    """An uninterrupted launch; returns the durations of its saves (partial folder visible -> renamed)."""
    folder = dump / "checkpoints"
    run = Launch([*argv, "--job.dump_folder", str(dump)], world, log)
    started: dict[int, float] = {}
    durations: list[float] = []
    while not run.poll():
        names = set(os.listdir(folder)) if folder.is_dir() else set()
        now = time.monotonic()
        for name in names:
            if name.startswith("step-") and name.endswith(".partial"):
                started.setdefault(int(name[5:-8]), now)
        for step, start in list(started.items()):
            if f"step-{step}" in names:
                durations.append(now - start)
                del started[step]
        time.sleep(POLL_S)
    if run.wait() != [0] * world:
        raise SystemExit(f"the reference run failed: {run.codes}; see {log}.rank*")
    return durations


def killed_runs(
    argv: list[str], world: int, steps: int, kills: int, dump: Path, save_s: float, rng: random.Random, logs: Path
) -> dict:
    """``kills`` launches each killed inside a save, a check of every complete step after each, then the
    rest of the run in one more launch (which saves only at the end)."""
    argv = [*argv, "--job.dump_folder", str(dump)]
    folder = dump / "checkpoints"
    records = []
    for index in range(kills):
        latest = (scan_checkpoints(folder).complete or [0])[-1]
        step = min(latest + rng.randint(1, 2), steps - 1)
        delay = rng.uniform(0, 1.5 * save_s)
        run = Launch(argv, world, logs / f"{dump.name}-launch{index}.log")
        partial = folder / f"step-{step}.partial"
        if not run.wait_until(partial.exists):
            raise SystemExit(f"launch {index} ended before saving step {step}: {run.wait()}; see {logs}")
        time.sleep(delay)
        in_save = partial.exists()
        run.kill(rng)
        complete = scan_checkpoints(folder).complete
        for s in complete:  # every step folder that looks complete is complete
            verify_checkpoint(folder / f"step-{s}")
        records.append({"step": step, "delay": delay, "in_save": in_save, "complete": complete})
    final = Launch([*argv, "--checkpoint.interval", str(steps)], world, logs / f"{dump.name}-final.log").wait()
    return {"dump": str(dump), "kills": records, "final_rc": final}


def stall_timeout(metrics: Path, save_seconds: list[float]) -> int:
    """The stall launches' step / collective timeout: 10x the slowest step (with its save) this machine
    just took in the reference run, at least 3 s, so a loaded machine's honest step never trips it."""
    step_times = [
        json.loads(line)["step_time"]
        for line in metrics.read_text().splitlines()
        if line.endswith("}") and "step_time" in json.loads(line)
    ]
    return max(3, round(10 * (max(step_times, default=0.0) + max(save_seconds, default=0.0))))


def stall_run(argv: list[str], world: int, after_step: int, dump: Path, log: Path) -> dict:
    """Freeze the last rank (SIGSTOP) once ``after_step`` is logged; rank 0's exit code and time to exit."""
    metrics = dump / "metrics.jsonl"
    run = Launch([*argv, "--job.dump_folder", str(dump)], world, log)

    def logged() -> bool:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        return any(json.loads(line)["step"] >= after_step for line in lines if line.endswith("}"))

    if not run.wait_until(logged):
        raise SystemExit(f"the stall launch ended before step {after_step}: {run.wait()}; see {log}.rank*")
    os.kill(run.pids[-1], signal.SIGSTOP)
    start = time.monotonic()
    code = os.waitstatus_to_exitcode(os.waitpid(run.pids[0], 0)[1])
    seconds = time.monotonic() - start
    run.codes[run.pids[0]] = code
    for pid in run.pids[1:]:
        os.kill(pid, signal.SIGKILL)
    run.wait()
    return {"rc": code, "seconds": seconds, "log": Path(f"{log}.rank0").read_text()}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    root, world, steps = Path(spec["root"]), spec["world"], spec["steps"]
    rng = random.Random(spec["seed"])
    durations = reference_run(spec["argv"], world, root / "reference", root / "reference.log")
    save_s = statistics.median(durations)
    result = {"reference": str(root / "reference"), "save_seconds": durations}
    for mode in spec["modes"]:
        argv = [*spec["argv"], "--checkpoint.async_mode", mode]
        result[mode] = killed_runs(argv, world, steps, spec["kills"], root / mode, save_s, rng, root)
    timeout = stall_timeout(root / "reference" / "metrics.jsonl", durations)
    result["stall_timeout_s"] = timeout
    result["stalls"] = {
        name: stall_run(
            [arg.replace("{timeout}", str(timeout)) for arg in stall["argv"]],
            world,
            stall["after_step"],
            root / name,
            root / f"{name}.log",
        )
        for name, stall in spec.get("stalls", {}).items()
    }
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
