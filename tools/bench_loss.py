"""Benchmark: peak memory and time of the LM head + loss (forward and backward), chunked vs plain.

The plain loss materialises the (tokens x vocab) logits in fp32, and backward their gradient; the
chunked one (titan_recur.models.loss.chunked_cross_entropy_sum, training.loss_chunk_tokens) holds one
chunk at a time. Each point runs in a fresh subprocess so that its peak is its own (CUDA:
max_memory_allocated; CPU: peak RSS above the RSS before the step, with glibc's mmap threshold fixed
so freed tensors leave the RSS).

    python tools/bench_loss.py                                   # Llama-3 head: vocab 128,256, d 2,048, 2 x 1,024 tokens
    python tools/bench_loss.py --device cuda --tokens 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from process_memory import current_bytes, peak_bytes, run_child  # a sibling: tools/ is sys.path[0] for a script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (2 x 1,024 by default)")
    parser.add_argument("--chunks", default="0,1024,256", help="loss_chunk_tokens values; 0 = plain")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="hidden/head dtype")
    parser.add_argument("--point", type=int, help=argparse.SUPPRESS)  # internal: one chunk size, print JSON
    return parser.parse_args(argv)


def run_point(args: argparse.Namespace) -> dict:
    """Forward + backward of the head and loss at one chunk size; peak memory above the inputs, time."""
    import torch

    from titan_recur.models.loss import chunked_cross_entropy_sum, cross_entropy_sum

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, generator=gen).to(args.device, dtype).requires_grad_()
    weight = (0.02 * torch.randn(args.vocab, args.dim, generator=gen)).to(args.device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(args.device)
    # Gradient buffers exist in training anyway: allocate them before measuring.
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    base = current_bytes(args.device)
    start = time.perf_counter()
    if args.point:
        loss = chunked_cross_entropy_sum(hidden, weight, labels, args.point)
    else:
        loss = cross_entropy_sum(hidden @ weight.T, labels)
    loss.backward()
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = peak_bytes(args.device)
    return {
        "chunk": args.point,
        "loss": float(loss),
        "peak_bytes": peak - base,
        "seconds": seconds,
        "grad_norm": float(weight.grad.float().norm()),
    }


def measure(chunk: int) -> dict:
    return run_child(__file__, [*sys.argv[1:], "--point", str(chunk)])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.point is not None:
        print(json.dumps(run_point(args)))
        return
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(
        f"# head + loss, vocab {args.vocab:,}, d {args.dim:,}, {args.tokens:,} tokens, {args.dtype} on "
        f"{args.device}; fp32 logits alone: {logits_mib:,.0f} MiB"
    )
    print("| loss_chunk_tokens | peak above inputs + grads (MiB) | vs plain | time (s) | loss | |grad W| |")
    print("|---|---|---|---|---|---|")
    plain = None
    for chunk in [int(c) for c in args.chunks.split(",")]:
        point = measure(chunk)
        plain = plain or point["peak_bytes"]
        print(
            f"| {chunk or 'plain'} | {point['peak_bytes'] / 2**20:,.0f} | {point['peak_bytes'] / plain:.2f} | "
            f"{point['seconds']:.2f} | {point['loss']:.6f} | {point['grad_norm']:.6f} |"
        )


if __name__ == "__main__":
    main()
