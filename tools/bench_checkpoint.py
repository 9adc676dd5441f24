"""What the checkpoint checksums cost: hash throughput, and save/load of a DCP checkpoint with and without them.

    python tools/bench_checkpoint.py [--megabytes 200] [--repeats 3] [--folder outputs/bench_checkpoint]

Prints one line per figure (docs/checkpointing.md quotes them). The checkpoint is one process's
model-like state (fp32 matrices) written by titan_recur.storage.checkpoint.CheckpointManager, whose save
checksums the shards and writes manifest.json, against a bare ``dcp.save``; loading is
``choose_resume`` (verification) + ``load`` against the load alone. The files were just written, so
they are read from the page cache: with a cold cache the checksum pass reads them from disk once and
the load that follows reads them from the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash

from titan_recur.storage.checkpoint import CheckpointManager, ModelState

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def hash_throughput(megabytes: int) -> dict[str, float]:
    """MB/s of each hash over ``megabytes`` of random bytes in memory (one core)."""
    data = torch.randint(0, 256, (megabytes << 20,), dtype=torch.uint8).numpy().tobytes()
    rates = {}
    for name, digest in (("xxh3_128", xxhash.xxh3_128), ("sha256", hashlib.sha256)):
        start = time.perf_counter()
        digest(data).hexdigest()
        rates[name] = megabytes / (time.perf_counter() - start)
    return rates


def model_state(megabytes: int) -> torch.nn.Module:
    """Linear layers of 1024 x 1024 fp32 (4 MiB each) adding up to ``megabytes``."""
    layers = max(1, megabytes // 4)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def bench_checkpoint(folder: Path, megabytes: int, repeats: int) -> dict[str, float]:
    model = model_state(megabytes)
    states = {"model": ModelState(model)}
    manager = CheckpointManager(folder / "managed", states, interval=1, keep_latest_k=1)
    times: dict[str, list[float]] = {k: [] for k in ("bare_save", "save", "load", "verify")}
    for step in range(1, repeats + 1):
        bare = folder / f"bare-{step}"
        times["bare_save"].append(timed(lambda bare=bare: dcp.save(states, checkpoint_id=str(bare))))
        shutil.rmtree(bare)
        times["save"].append(timed(lambda step=step: manager.save(step)))
        times["verify"].append(timed(lambda: manager.choose_resume(-1, verify=True, fallback_on_corruption=False)))
        times["load"].append(timed(lambda step=step: manager.load(step)))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=200, help="checkpoint size (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads to take the median of (default 3)")
    parser.add_argument("--folder", type=Path, default=Path("outputs/bench_checkpoint"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rates = hash_throughput(args.megabytes)
    print(
        f"hash throughput ({args.megabytes} MiB in memory, one core): xxh3_128 {rates['xxh3_128']:,.0f} MB/s, "
        f"sha256 {rates['sha256']:,.0f} MB/s"
    )
    shutil.rmtree(args.folder, ignore_errors=True)
    args.folder.mkdir(parents=True)
    try:
        t = bench_checkpoint(args.folder, args.megabytes, args.repeats)
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    print(f"DCP checkpoint of {args.megabytes} MB, one process, median of {args.repeats}:")
    print(
        f"  save: bare dcp.save {t['bare_save']:.2f} s; with checksums + manifest {t['save']:.2f} s "
        f"({100 * (t['save'] / t['bare_save'] - 1):+.0f}%)"
    )
    print(
        f"  load {t['load']:.2f} s; verification before it {t['verify']:.2f} s "
        f"(+{100 * t['verify'] / t['load']:.0f}% of the load, {args.megabytes / t['verify']:,.0f} MB/s)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
