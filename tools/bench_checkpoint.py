"""What the checkpoint checksums cost: hash throughput, save/load of a DCP checkpoint with and without them, and
``from_pretrained`` of an HF export with and without its manifest check.

    python tools/bench_checkpoint.py [--megabytes 200] [--repeats 3] [--folder outputs/bench_checkpoint]

Prints one line per figure (docs/checkpointing.md quotes them). The checkpoint is one process's
model-like state (fp32 matrices) written by titan_recur.storage.checkpoint.CheckpointManager, whose save
checksums the shards and writes manifest.json, against a bare ``dcp.save``; loading is
``choose_resume`` (verification) + ``load`` against the load alone. The files were just written, so
they are read from the page cache: with a cold cache the checksum pass reads them from disk once and
the load that follows reads them from the cache. The export is a random (1, 1, 1) recurrent model of
about --megabytes of fp32 weights (d chosen for the size, FFN 4d), loaded with
``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` alternately with the check and
with ``verify_checksums=False``.
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


def export_model(folder: Path, megabytes: int) -> Path:
    """An HF export of a random recurrent model with about ``megabytes`` of fp32 weights."""
    from titan_recur import ModelArgs, RecurrentLM
    from titan_recur.hf.export import export_hf

    # Three blocks of 16 d^2 parameters (attention 4 d^2, FFN 4d: 12 d^2) at 4 bytes: 192 d^2 bytes.
    dim = max(64, round((megabytes * 1e6 / 192) ** 0.5 / 64) * 64)
    args = ModelArgs(
        vocab_size=512,
        dim=dim,
        n_heads=dim // 64,
        n_kv_heads=dim // 64,
        head_dim=64,
        ffn_dim=4 * dim,
        n_prelude=1,
        n_core=1,
        n_coda=1,
        adapter_init="random",
    )
    model = RecurrentLM(args)
    model.init_weights()
    tokenizer = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
    return export_hf(model, folder / "export", tokenizer_folder=tokenizer)


def bench_export_verify(folder: Path, megabytes: int, repeats: int) -> dict[str, float]:
    """Median seconds of from_pretrained with the manifest check ("verified") and without ("unverified")."""
    from transformers import AutoModelForCausalLM

    export = export_model(folder, megabytes)
    times: dict[str, list[float]] = {"verified": [], "unverified": []}
    for _ in range(repeats + 1):  # the first round warms the page cache and the import of the modeling code
        for name, verify in (("verified", True), ("unverified", False)):
            times[name].append(
                timed(
                    lambda verify=verify: AutoModelForCausalLM.from_pretrained(
                        export, trust_remote_code=True, verify_checksums=verify
                    )
                )
            )
    size = sum(p.stat().st_size for p in export.iterdir()) / 1e6
    return {"size_mb": size, **{k: statistics.median(v[1:]) for k, v in times.items()}}


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
    args.folder.mkdir(parents=True)
    try:
        e = bench_export_verify(args.folder, args.megabytes, args.repeats)
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    check = e["verified"] - e["unverified"]
    print(
        f"HF export of {e['size_mb']:,.0f} MB, from_pretrained, median of {args.repeats}: {e['verified']:.2f} s with "
        f"the manifest check, {e['unverified']:.2f} s with verify_checksums=False (the check: {check:+.2f} s, "
        f"{e['size_mb'] / 1e3 / max(check, 1e-6):,.1f} GB/s)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
