"""Benchmark: the memory estimate of `python -m titan_recur.train --check` against the measured peak.

Builds one process's training step as the trainer does (meta-device model, the parallelize recipe's
activation checkpointing, the converted weights, the config's optimizers, a batch from the real
data loader, the chunked loss) and runs it at (n, k) = (mean - k, k) with k the backprop depth, the
most grad iterations a step samples. Two measurements, each in a fresh subprocess:

- tensors: the peak of live tensor bytes over a step (torch.profiler's memory timeline; CPU or CUDA),
  weights, grads and optimizer states included; compared with the estimate's total.
- rss (CPU) / allocated (CUDA): peak RSS minus the RSS before the first step (weights already
  allocated), with glibc's mmap threshold fixed at 64 KiB so freed tensors leave the RSS; on CUDA
  torch.cuda.max_memory_allocated minus memory_allocated before the step. Compared with the
  estimate less the weights.

    python tools/bench_memory.py --config train_configs/debug_model.toml --training.device cpu
    python tools/bench_memory.py --config train_configs/debug_model.toml --training.device cpu \\
        --training.local_batch_size 32 --training.seq_len 256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from process_memory import current_bytes, peak_bytes, run_child  # a sibling: tools/ is sys.path[0] for a script

GiB, MiB = 2**30, 2**20


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="train config TOML; --section.key VALUE overrides follow")
    parser.add_argument("--measure", choices=["tensors", "rss"], help=argparse.SUPPRESS)  # internal: one child
    return parser.parse_known_args(argv)


def build_step(cfg):
    """The trainer's model, optimizers and a batch for one process; returns (step function, device)."""
    import torch

    from titan_recur.data.loader import LoaderGeometry, build_dataloader
    from titan_recur.data.tokenizer import load_tokenizer
    from titan_recur.storage.model_io import resolve_model_args
    from titan_recur.training.build import build_model
    from titan_recur.training.optim import build_optimizers
    from titan_recur.training.parallelize import forward_autocast
    from titan_recur.training.preflight import tokenizer_folder

    t, r = cfg.training, cfg.recurrence
    device = torch.device("cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu")
    model = build_model(cfg, resolve_model_args(cfg.model), device)
    optimizers = build_optimizers(model, cfg.optimizer, cfg.lr_scheduler, t.steps)
    tokenizer = load_tokenizer(tokenizer_folder(cfg))
    loader = build_dataloader(cfg.data, tokenizer, LoaderGeometry.of_run(cfg, dp_rank=0, dp_world=1))
    batch = next(iter(loader))
    input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    k = min(r.backprop_depth, r.mean_recurrence)
    num_steps = (r.mean_recurrence - k, k)
    del loader, batch

    def step() -> None:
        with forward_autocast(device.type, t.mixed_precision_param, t.mixed_precision_mode):
            loss = model(input_ids, num_steps, labels=labels, loss_chunk_tokens=t.loss_chunk_tokens)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step, device


def measure_tensors(cfg) -> int:
    """Peak live tensor bytes over a step, after a warm-up step (optimizer states exist)."""
    import json as _json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    step, device = build_step(cfg)
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cuda:0" if device.type == "cuda" else "cpu")
        _, sizes = _json.loads(path.read_text())
    return max(sum(row) for row in sizes)


def measure_rss(cfg) -> int:
    """Peak memory of two steps above what the process held before them (weights included there)."""
    import torch

    step, device = build_step(cfg)
    base = current_bytes(device.type)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()
    step()
    return peak_bytes(device.type) - base


def child(kind: str, argv: list[str]) -> int:
    return int(run_child(__file__, [*argv, "--measure", kind]))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ns, overrides = parse_args(argv)
    from titan_recur.config import load_config

    cfg = load_config(ns.config, overrides)
    if ns.measure:
        print(measure_tensors(cfg) if ns.measure == "tensors" else measure_rss(cfg))
        return
    import torch

    from titan_recur.storage.model_io import resolve_model_args
    from titan_recur.training.cost_model import memory_estimate

    device = (
        "cuda"
        if cfg.training.device == "cuda" or (cfg.training.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    estimate = memory_estimate(cfg, resolve_model_args(cfg.model), 1, device)
    t = cfg.training
    tensors, rss = child("tensors", argv), child("rss", argv)
    print(
        f"# {ns.config} {' '.join(overrides)}: {t.local_batch_size} x {t.seq_len} tokens, ac_mode {t.ac_mode}, "
        f"device {device}, one process"
    )
    print(f"estimate: {estimate.describe()}")
    print("| measured | MiB | estimate (MiB) | estimate / measured |")
    print("|---|---:|---:|---:|")
    print(
        f"| peak live tensors (weights, grads, optimizer, activations) | {tensors / MiB:.1f} | "
        f"{estimate.total / MiB:.1f} | {estimate.total / tensors:.2f} |"
    )
    above = estimate.total - estimate.weights
    label = "peak RSS above the pre-step RSS" if device == "cpu" else "max_memory_allocated above the pre-step"
    print(f"| {label} (all but weights) | {rss / MiB:.1f} | {above / MiB:.1f} | {above / rss:.2f} |")
    print(json.dumps({"tensors": tensors, "rss": rss, "estimate": estimate.total, "weights": estimate.weights}))


if __name__ == "__main__":
    main()
