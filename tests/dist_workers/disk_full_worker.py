"""Two ranks fail the same checkpoint save; their disk-full readings must agree (tests/system/test_safety.py).

argv: FOLDER (a checkpoints folder on a small tmpfs) OUT (json). Rank 0 fills the file system with a file
inside the step's incomplete folder, so that removing the folder frees the space. Both ranks then fail the
save with an error that does not say the disk is full (as torch.save's "unexpected pos" does), rank 1 a
second later: each rank's CheckpointWriteError message is written to OUT.RANK.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_util import finish  # noqa: E402

from titan_recur.storage.checkpoint import CheckpointManager, CheckpointWriteError  # noqa: E402

STEP = 4


def fill(partial: Path) -> None:
    partial.mkdir(parents=True)
    with open(partial / "__0_0.distcp", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * (1 << 20))


def main() -> None:
    folder, out = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    manager = CheckpointManager(folder, {}, interval=1, keep_latest_k=0)
    if rank == 0:
        fill(manager._partial(STEP))
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)  # rank 0 is in its failure path by now
    try:
        manager._write_failed(STEP, RuntimeError(f"unexpected pos {1000 + rank}"))
    except CheckpointWriteError as err:
        Path(f"{out}.{rank}").write_text(str(err))
    finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
