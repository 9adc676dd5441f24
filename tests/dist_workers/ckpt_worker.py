"""Runs single-process training jobs back to back in one interpreter (imports cost seconds per process).

Usage: ckpt_worker.py JOBS.json RESULTS.json. JOBS is a list of {"argv": [...], "watch": PATH,
"copy": [SRC, DST], "truncate": PATH, "flip_byte": PATH, "fill": {"file", "leave_like", "factor"},
"unlink": [PATH, ...], "resume_only": PATH}. Each job calls titan_recur.cli.train.main(argv) and records its exit
code (None if it raised), stdout and stderr. Before it, in this order: "copy" copies a folder tree;
"unlink" removes files; "truncate" cuts that file to half its size; "flip_byte" inverts the bits
of its middle byte; "fill" writes zeros into "file" until its file system has only "factor" times the
size of the folder "leave_like" left (0 or no "leave_like": until it is full). "watch" records
{relative path: [size, mtime_ns]} of everything under PATH before and after the job; "resume_only"
instead builds the Trainer, calls resume() and saves the step, the model parameters and the optimizer
state sizes to that path.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch


def snapshot(folder: str) -> dict[str, list[int]]:
    root = Path(folder)
    return {str(p.relative_to(root)): [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(root.rglob("*"))}


def resume_only(argv: list[str], out: str) -> int:
    """Build the trainer, resume, and record what was loaded (step, parameters, optimizer state sizes)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titan_recur.config import parse_args
    from titan_recur.training.trainer import Trainer

    trainer = Trainer(parse_args(argv))
    trainer.resume()
    params = get_model_state_dict(trainer.model)
    optimizer_states = [len(o.state) for o in trainer.optimizers.optimizers]
    torch.save({"step": trainer.step, "params": params, "optimizer_states": optimizer_states}, out)
    trainer.close()
    return 0


def fill(file: str, leave_like: str | None = None, factor: float = 0.0) -> None:
    """Zeros into ``file`` until only ``factor`` x the size of the folder ``leave_like`` is free."""
    leave = int(factor * sum(p.stat().st_size for p in Path(leave_like).rglob("*") if p.is_file())) if leave_like else 0
    stat = os.statvfs(Path(file).parent)
    size = max(stat.f_bavail * stat.f_frsize - leave, 0)
    with open(file, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):  # full
            while size > 0:
                size -= f.write(b"\0" * min(size, 1 << 20))


def prepare(job: dict) -> None:
    if job.get("copy"):
        shutil.copytree(*job["copy"])
    for path in job.get("unlink", []):
        Path(path).unlink()
    if job.get("truncate"):
        path = Path(job["truncate"])
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    if job.get("flip_byte"):
        path = Path(job["flip_byte"])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    if job.get("fill"):
        fill(**job["fill"])


def run_job(job: dict) -> dict:
    from titan_recur.cli.train import main

    result: dict = {}
    prepare(job)
    if job.get("watch"):
        result["before"] = snapshot(job["watch"])
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            if job.get("resume_only"):
                result["rc"] = resume_only(job["argv"], job["resume_only"])
            else:
                result["rc"] = main(job["argv"])
        except BaseException:  # (DCP raises BaseExceptions) report it with the job's output, keep the others
            result["rc"] = None
            traceback.print_exc()
    if job.get("watch"):
        result["after"] = snapshot(job["watch"])
    result["stdout"], result["stderr"] = stdout.getvalue(), stderr.getvalue()
    return result


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    results = [run_job(job) for job in jobs]
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
