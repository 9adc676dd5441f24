"""One run per folder: ``run.lock`` in the dump folder and in the checkpoint folder, taken by one process
of a run before it reads or writes them.

The lock file names its holder (host, boot id, PID namespace, pid, the process's start time, Slurm job
id and restart count), and the holder keeps an exclusive flock on it (its lease) for as long as it
lives, where the file system supports flock. A second run is refused in one line naming the holder,
unless the holder is provably gone: it was an earlier incarnation of this requeued Slurm job (same job
id, another restart count); or nobody holds its lease and, on this kernel (same boot id), its pid is
dead or another process in the same PID namespace, or, in another PID namespace (a container), it had
taken a lease; or Slurm says its job no longer runs. A held lease means alive, whatever else; a pid of
another PID namespace or another boot (the same hostname on another machine) proves nothing.

The file appears whole: written aside, then hard-linked into place, which fails if another run got
there first; where the file system has no hard links, created exclusively (O_EXCL) and written under
its lease. A take-over is serialised by a second exclusive file, so of several processes that find the
same stale lock exactly one takes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
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
# A take-over guard (or an unreadable lock file) older than this was left by a process that died writing it.
_TAKEOVER_STALE_S = 60.0
# os.link's failures on a file system without hard links (some FUSE and object-store mounts).
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
# The leases this process holds: a forked child (a DataLoader worker) closes its copies, so that a
# child outliving its killed parent does not keep the lease alive.
_HELD: set[int] = set()


def _close_inherited_leases() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited_leases)


class DumpFolderLockedError(ValueError):
    """Another live run holds the folder; the message is one line naming it."""


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (/proc/PID/stat field 22), None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@functools.cache
def _boot_id() -> str | None:
    """This kernel's boot: a pid or PID namespace means something only within the same one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


@functools.cache
def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid_ns": _pid_namespace(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
        "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "token": secrets.token_hex(8),
    }


def describe_holder(holder: dict[str, Any]) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    ns = holder.get("pid_ns")
    where = f" of PID namespace {ns}" if ns and ns != _pid_namespace() else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{where}{job}, since {holder.get('since')}"


def stale_reason(holder: dict[str, Any], lease_held: bool | None = None) -> str | None:
    """Why the lock's holder is provably gone (None: it may be alive). ``lease_held``: whether a process
    holds the lock file's lease (None: the file system cannot say)."""
    my_job = os.environ.get("SLURM_JOB_ID")
    if my_job and holder.get("slurm_job_id") == my_job:
        if holder.get("slurm_restart_count") != os.environ.get("SLURM_RESTART_COUNT", "0"):
            return f"an earlier run of this requeued Slurm job {my_job}"
    if lease_held:
        return None
    if _boot_id() is not None and holder.get("boot_id") == _boot_id():
        reason = _gone_from_this_kernel(holder, lease_held)
        if reason is not None:
            return reason
    if holder.get("slurm_job_id") and shutil.which("squeue"):
        state = _slurm_job_state(holder["slurm_job_id"])
        if state is not None and state not in ("RUNNING", "COMPLETING", "SUSPENDED", "CONFIGURING"):
            return f"its Slurm job {holder['slurm_job_id']} is {state or 'gone'}"
    return None


def _gone_from_this_kernel(holder: dict[str, Any], lease_held: bool | None) -> str | None:
    """In this PID namespace the pid answers; in another one (a container) only the lease it took does."""
    pid = holder.get("pid")
    if holder.get("pid_ns") is not None and holder.get("pid_ns") == _pid_namespace():
        start = _process_start(int(pid if pid is not None else -1))
        if start is None:
            return f"its process {pid} is gone"
        if holder.get("process_start") is not None and start != holder["process_start"]:
            return f"pid {pid} is another process now"
        return None
    if holder.get("lease") and lease_held is False:
        return f"no process holds its lease (pid {pid} of PID namespace {holder.get('pid_ns')})"
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


def _parse_holder(data: bytes) -> dict[str, Any]:
    """A lock file's holder; an unreadable one (a torn copy, one being written) reads as {}."""
    try:
        holder = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def read_holder(path: Path) -> dict[str, Any] | None:
    """The lock file's holder, None if there is no lock; an unreadable one reads as {}."""
    try:
        return _parse_holder(path.read_bytes())
    except FileNotFoundError:
        return None
    except OSError:
        return {}


def _take_lease(fd: int) -> bool:
    """An exclusive flock on this process's own new lock file; False where the file system has none."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _lease_held(fd: int) -> bool | None:
    """Whether a process holds the lease of this open lock file (a shared probe, released at once)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def inspect_lock(path: Path) -> tuple[dict[str, Any] | None, bool | None]:
    """(holder, lease held) of the lock file, both read from one open file, so of the same lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    with open(fd, "rb") as f:
        return _parse_holder(f.read()), _lease_held(fd)


def _young(path: Path) -> bool:
    """Written less than _TAKEOVER_STALE_S ago (a lock file being written by its holder right now)."""
    try:
        return time.time() - path.stat().st_mtime < _TAKEOVER_STALE_S
    except FileNotFoundError:
        return False


class DumpFolderLock:
    """The lock of one folder of a run, held by this process from :meth:`acquire` to :meth:`release`."""

    def __init__(self, folder: Path, holder: dict[str, Any], what: str = "job.dump_folder") -> None:
        self.path = Path(folder) / LOCK_NAME
        self.holder = holder
        self.what = what  # the setting that names the folder, for messages
        self._fd: int | None = None

    @classmethod
    def acquire(cls, folder: str | Path, what: str = "job.dump_folder") -> DumpFolderLock:
        """Take the folder's lock (creating the folder), taking over a stale one; DumpFolderLockedError if held."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        lock = cls(folder, _me(), what)
        if lock._create():
            return lock
        holder, lease_held = inspect_lock(lock.path)
        if holder is None:  # released meanwhile
            if lock._create():
                return lock
            holder, lease_held = inspect_lock(lock.path)
        reason = lock._stale(holder or {}, lease_held)
        if reason is None:
            raise DumpFolderLockedError(
                f"{what} {folder} is in use by another run ({describe_holder(holder or {})}): one run per folder; "
                f"wait for it, or use another folder (if that run is gone, delete {lock.path})"
            )
        lock._take_over(holder or {}, reason)
        return lock

    def _stale(self, holder: dict[str, Any], lease_held: bool | None) -> str | None:
        if holder:
            return stale_reason(holder, lease_held)
        return None if lease_held or _young(self.path) else "its lock file is unreadable"

    def _create(self) -> bool:
        """Write the lock aside under its lease, then hard-link it into place: True if this process now holds it."""
        aside = self.path.with_name(f".{LOCK_NAME}.{self.holder['pid']}.{self.holder['token']}")
        fd = os.open(aside, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            self._write(fd)
            os.link(aside, self.path)
        except OSError as err:
            os.close(fd)
            if isinstance(err, FileExistsError):
                return False
            if err.errno in _NO_HARD_LINKS:
                return self._create_exclusive()
            raise
        finally:
            aside.unlink(missing_ok=True)
        self._hold(fd)
        return True

    def _create_exclusive(self) -> bool:
        """Without hard links: create the lock file exclusively, take its lease, then write it."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            return False
        try:
            self._write(fd)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._hold(fd)
        return True

    def _write(self, fd: int) -> None:
        self.holder["lease"] = _take_lease(fd)
        os.write(fd, (json.dumps(self.holder) + "\n").encode())
        os.fsync(fd)  # visible to other nodes (NFS) before the file appears

    def _hold(self, fd: int) -> None:
        self._fd = fd
        _HELD.add(fd)

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
                    f"{self.what} {self.path.parent} is in use by another run "
                    f"({describe_holder(read_holder(self.path) or {})}): it took over the stale lock first"
                )
            self.path.unlink(missing_ok=True)
            if not self._create():
                raise DumpFolderLockedError(f"{self.path}: taken by another run during the take-over")
        finally:
            guard.unlink(missing_ok=True)
        print(f"[titan_recur] took over the stale lock {self.path} of {describe_holder(stale)}: {reason}", flush=True)

    def release(self) -> None:
        """Remove the lock if it is still this process's, then give up its lease (idempotent)."""
        holder = read_holder(self.path)
        if holder and holder.get("token") == self.holder["token"]:
            self.path.unlink(missing_ok=True)
        if self._fd is not None:
            _HELD.discard(self._fd)
            os.close(self._fd)
            self._fd = None
