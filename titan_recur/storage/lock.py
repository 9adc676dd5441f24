"""One run per dump folder: ``run.lock``, taken by one process of a run before it reads or writes the folder.

The lock file names its holder (host, pid, the process's start time, Slurm job id and restart count).
A second run on a folder whose holder is alive is refused in one line naming it. A stale lock is taken
over: its holder's process is gone (same host: the pid is dead or is another process now), or it was
an earlier incarnation of this requeued Slurm job (same job id, another restart count), or Slurm says
the holder's job no longer runs. The file appears whole (written aside, then hard-linked into place,
which fails if another run got there first), and a take-over is serialised by a second exclusive file,
so of several processes that find the same stale lock exactly one takes it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

LOCK_NAME = "run.lock"
_TAKEOVER_SUFFIX = ".takeover"
# A take-over guard older than this was left by a process that died mid take-over.
_TAKEOVER_STALE_S = 60.0


class DumpFolderLockedError(ValueError):
    """Another live run holds the dump folder; the message is one line naming it."""


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (/proc/PID/stat field 22), None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
        "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "token": secrets.token_hex(8),
    }


def describe_holder(holder: dict[str, Any]) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('since')}"


def stale_reason(holder: dict[str, Any]) -> str | None:
    """Why the lock's holder is gone (None: it may be alive)."""
    my_job = os.environ.get("SLURM_JOB_ID")
    if my_job and holder.get("slurm_job_id") == my_job:
        if holder.get("slurm_restart_count") != os.environ.get("SLURM_RESTART_COUNT", "0"):
            return f"an earlier run of this requeued Slurm job {my_job}"
    if holder.get("host") == socket.gethostname():
        start = _process_start(int(holder.get("pid", -1)))
        if start is None:
            return f"its process {holder.get('pid')} is gone"
        if holder.get("process_start") is not None and start != holder["process_start"]:
            return f"pid {holder.get('pid')} is another process now"
        return None
    if holder.get("slurm_job_id") and shutil.which("squeue"):
        state = _slurm_job_state(holder["slurm_job_id"])
        if state is not None and state not in ("RUNNING", "COMPLETING", "SUSPENDED", "CONFIGURING"):
            return f"its Slurm job {holder['slurm_job_id']} is {state or 'gone'}"
    return None


def _slurm_job_state(job_id: str) -> str | None:
    """The job's state per squeue ("" when Slurm no longer knows it), None when squeue cannot say."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return "" if "Invalid job id" in out.stderr else None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


def read_holder(path: Path) -> dict[str, Any] | None:
    """The lock file's holder, None if there is no lock; an unreadable one (a torn copy) reads as {}."""
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


class DumpFolderLock:
    """The lock of one dump folder, held by this process from :meth:`acquire` to :meth:`release`."""

    def __init__(self, folder: Path, holder: dict[str, Any]) -> None:
        self.path = Path(folder) / LOCK_NAME
        self.holder = holder

    @classmethod
    def acquire(cls, folder: str | Path) -> DumpFolderLock:
        """Take the folder's lock (creating the folder), taking over a stale one; DumpFolderLockedError if held."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        lock = cls(folder, _me())
        if lock._create():
            return lock
        holder = read_holder(lock.path)
        if holder is None:  # released meanwhile
            if lock._create():
                return lock
            holder = read_holder(lock.path) or {}
        reason = stale_reason(holder) if holder else "its lock file is unreadable"
        if reason is None:
            raise DumpFolderLockedError(
                f"job.dump_folder {folder} is in use by another run ({describe_holder(holder)}): one run per dump "
                f"folder; wait for it, or use another folder (if that run is gone, delete {lock.path})"
            )
        lock._take_over(holder, reason)
        return lock

    def _create(self) -> bool:
        """Write the lock aside, then hard-link it into place: True if this process now holds it."""
        aside = self.path.with_name(f".{LOCK_NAME}.{self.holder['pid']}.{self.holder['token']}")
        try:
            aside.write_text(json.dumps(self.holder) + "\n")
            os.link(aside, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            aside.unlink(missing_ok=True)

    def _take_over(self, stale: dict[str, Any], reason: str) -> None:
        """Replace a stale lock; one process at a time (an exclusive guard file), and only the lock it judged."""
        guard = self.path.with_name(self.path.name + _TAKEOVER_SUFFIX)
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if time.time() - guard.stat().st_mtime > _TAKEOVER_STALE_S:
                guard.unlink(missing_ok=True)
                return self._take_over(stale, reason)
            raise DumpFolderLockedError(f"{self.path}: another run is taking over this stale lock right now") from None
        try:
            os.close(fd)
            if read_holder(self.path) != stale:  # someone else took it over first
                raise DumpFolderLockedError(
                    f"job.dump_folder {self.path.parent} is in use by another run "
                    f"({describe_holder(read_holder(self.path) or {})}): it took over the stale lock first"
                )
            self.path.unlink(missing_ok=True)
            if not self._create():
                raise DumpFolderLockedError(f"{self.path}: taken by another run during the take-over")
        finally:
            guard.unlink(missing_ok=True)
        print(f"[titan_recur] took over the stale lock {self.path} of {describe_holder(stale)}: {reason}", flush=True)

    def release(self) -> None:
        """Remove the lock if it is still this process's (idempotent)."""
        holder = read_holder(self.path)
        if holder and holder.get("token") == self.holder["token"]:
            self.path.unlink(missing_ok=True)
