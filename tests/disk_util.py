"""A small real file system to fill up: the full-disk tests' tmpfs and filler (tests/system/test_safety.py and the
commands' own full-disk tests)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

TMPFS_BYTES = 32 << 20


@contextlib.contextmanager
def tmpfs(folder: Path):
    """A small real tmpfs (the tests run as root, here and in CI) to fill up."""
    folder.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.fail(f"the disk-full tests need to mount a tmpfs (run as root): {mount.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill_disk(filler: Path, leave: int) -> None:
    """Zeros into ``filler`` until ``leave`` bytes of its file system are free."""
    stat = os.statvfs(filler.parent)
    size = max(stat.f_bavail * stat.f_frsize - leave, 0)
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while size > 0:
            size -= f.write(b"\0" * min(size, 1 << 20))
