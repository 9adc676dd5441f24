"""Benchmark: peak memory and step time of a training step as the recurrence grows.

Memory: with per-iteration activation checkpointing, no-grad iterations store nothing, so peak
memory must stay flat in n (the issue's bound: peak(n=32) / peak(n=0) <= 1.10 at k=4).
Time: step time vs r, printed next to the analytic FLOP ratio of titan_recur.training.cost_model.

Each (n, k) point runs in a fresh subprocess so that peak memory is that point's own
(CUDA: max_memory_allocated; CPU: peak RSS minus the RSS before the first step, with glibc's
mmap threshold fixed at 64 KiB so freed tensors leave the RSS).

    python tools/bench_recurrence.py                      # CPU, default tiny-ish shape
    python tools/bench_recurrence.py --device cuda --dim 2048 --seq-len 1024 --batch 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench_models import add_shape_arguments, random_model, shape_model_args  # siblings: tools/ is sys.path[0]
from process_memory import current_bytes, peak_bytes, run_child


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_shape_arguments(parser)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ac-mode", default="per_iteration", choices=["none", "full", "per_iteration"])
    parser.add_argument("--memory-points", default="0,8,32", help="n values measured at k=--k")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--time-points", default="1,2,4,8,16", help="r values timed as (r-1, 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point (after a warm-up)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--point", help=argparse.SUPPRESS)  # internal: run one "n,k" point and print JSON
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace):
    import torch

    from titan_recur.training.parallelize import parallelize_model

    model_args = shape_model_args(args)
    model = random_model(model_args).to(device=args.device, dtype=getattr(torch, args.dtype))
    parallelize_model(model, None, ac_mode=args.ac_mode, compile_blocks=args.compile, mp_policy=None)
    return model, model_args


def run_point(args: argparse.Namespace) -> dict:
    """Train steps at one (n, k) in this process; report peak memory and mean step time."""
    import torch

    n, k = (int(v) for v in args.point.split(","))
    model, _ = build_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), device=args.device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        logits = model(inputs, (n, k))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()

    base = current_bytes(args.device)
    step()  # warm-up (and compile)
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    seconds = (time.perf_counter() - start) / args.repeats
    peak = peak_bytes(args.device)
    return {"n": n, "k": k, "step_bytes": peak - base, "step_seconds": seconds}


def measure(args: argparse.Namespace, n: int, k: int) -> dict:
    return run_child(__file__, [*sys.argv[1:], "--point", f"{n},{k}"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.point:
        print(json.dumps(run_point(args)))
        return
    from titan_recur.training import cost_model

    _, model_args = build_model(argparse.Namespace(**{**vars(args), "device": "cpu", "compile": False}))
    print(
        f"# shape {args.shape} d={args.dim} batch {args.batch} x seq {args.seq_len}, device {args.device}, "
        f"ac {args.ac_mode}, dtype {args.dtype}, compile {args.compile}"
    )
    print(f"\n## Peak memory vs no-grad iterations n (k = {args.k})")
    print("| n | k | step peak above model+optimizer (MiB) | ratio to n=0 |")
    print("|---|---|---|---|")
    memory_points = [int(v) for v in args.memory_points.split(",")]
    first = None
    for n in memory_points:
        point = measure(args, n, args.k)
        first = first or point["step_bytes"]
        print(f"| {n} | {args.k} | {point['step_bytes'] / 2**20:.1f} | {point['step_bytes'] / first:.3f} |")
    print("\n## Step time vs r, as (n, k) = (r - 1, 1)")
    print("| r | step (s) | time / time(r=1) | FLOPs / FLOPs(r=1) |")
    print("|---|---|---|---|")
    base_time = base_flops = None
    for r in [int(v) for v in args.time_points.split(",")]:
        point = measure(args, r - 1, 1)
        per_token = cost_model.training_flops_per_token(model_args, (r - 1, 1), args.seq_len).total
        base_time, base_flops = base_time or point["step_seconds"], base_flops or per_token
        print(
            f"| {r} | {point['step_seconds']:.3f} | {point['step_seconds'] / base_time:.2f} | "
            f"{per_token / base_flops:.2f} |"
        )


if __name__ == "__main__":
    main()
