"""Benchmark: decoding speed and KV-cache size of the generation engine vs the old concatenating cache.

For each batch size and recurrence r, 256 new tokens after a 32-token prompt, greedy, on a random
model (default: (P,R,C) = (1,2,1), d 256, 4 heads (2 KV), FFN 768, vocab 512, fp32):

- ``cat``: the pre-engine decoder (kept here only, for comparison): a dict of K/V per (block,
  iteration) grown with ``torch.cat`` at every token, the attention mask grown the same way;
- ``full``, ``latest``: the engine (titan_recur.models.generate) with its preallocated cache;
  ``--compile`` adds ``full+compile`` / ``latest+compile`` (the core iteration compiled, static shapes).

tokens/s counts new tokens of the whole batch per second of wall time and per CPU second of this
process (the figure to trust on a loaded machine; CPU time includes every thread's). Each
configuration runs once untimed (warm-up) and is then timed ``--repeats`` times (best kept).

    OMP_NUM_THREADS=1 python tools/bench_generate.py
    python tools/bench_generate.py --device cuda --dtype bfloat16 --dim 2048 --heads 32 --kv-heads 8 \\
        --ffn 8192 --vocab 128256 --shape 4,6,4 --batch-sizes 1,8,32 --compile
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titan_recur import ModelArgs, RecurrentLM  # noqa: E402
from titan_recur.models.generate import GenerationOptions, generate  # noqa: E402


class ConcatKVCache:
    """The cache before the engine: one tensor pair per (block, iteration), grown by torch.cat per token."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0

    def begin(self, seqlen: int) -> int:
        return self.length + seqlen

    def update(self, slot, iteration, k, v):
        key = (*slot, iteration if slot[0] == "core" else 0)
        if key in self.slots:
            past_k, past_v = self.slots[key]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        self.slots[key] = (k, v)
        return k, v

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for pair in self.slots.values() for t in pair)


@torch.no_grad()
def concat_generate(model: RecurrentLM, input_ids: torch.Tensor, new_tokens: int, num_steps: int) -> int:
    """The pre-engine greedy loop (model.forward with a growing cache and mask); returns the cache bytes."""
    attention_mask = torch.ones_like(input_ids)
    cache = ConcatKVCache()
    step_input = input_ids
    for _ in range(new_tokens):
        logits = model(step_input, num_steps, attention_mask=attention_mask, cache=cache, state_init="zero")
        step_input = logits[:, -1].argmax(dim=-1)[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(step_input)], dim=1)
    return cache.nbytes()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--shape", default="1,2,1", help="P,R,C")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--recurrences", default="1,4,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--engines", default="cat,full,latest", help="subset of cat,full,latest")
    parser.add_argument("--compile", action="store_true", help="also time the engine with a compiled core iteration")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> RecurrentLM:
    prelude, core, coda = (int(v) for v in args.shape.split(","))
    model_args = ModelArgs(
        vocab_size=args.vocab, dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
        head_dim=args.dim // args.heads, ffn_dim=args.ffn, n_prelude=prelude, n_core=core, n_coda=coda,
        adapter_init="random", state_init="zero", max_seq_len=args.prompt_len + args.new_tokens,
    )
    torch.manual_seed(0)
    model = RecurrentLM(model_args)
    model.init_weights()
    return model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_run(run, new_tokens: int, device: str, repeats: int) -> tuple[float, float, int]:
    """(best wall s, best CPU s, cache bytes) over ``repeats`` timed runs after a warm-up that stops at 4
    tokens (sized for ``new_tokens``, so a compiled step compiles for the timed shapes)."""
    run(new_tokens, 4)
    best_wall = best_cpu = float("inf")
    nbytes = 0
    for _ in range(repeats):
        synchronize(device)
        wall, cpu = time.perf_counter(), time.process_time()
        nbytes = run(new_tokens, new_tokens)
        synchronize(device)
        best_wall, best_cpu = min(best_wall, time.perf_counter() - wall), min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu, nbytes


def engine_run(model, input_ids, r: int, kv_sharing: str, compile: bool):
    def run(new_tokens: int, stop_after: int) -> int:
        options = GenerationOptions(max_new_tokens=new_tokens, num_steps=r, kv_sharing=kv_sharing, compile=compile)
        stop = lambda tokens: torch.full((tokens.shape[0],), tokens.shape[1] >= stop_after)  # noqa: E731
        return generate(model, input_ids, options, stop=stop).kv_cache_bytes

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = build_model(args)
    engines = args.engines.split(",")
    print(f"# {args.shape} d={args.dim} heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab={args.vocab} "
          f"{args.dtype} {args.device}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"threads={torch.get_num_threads()}")
    print("| batch | r | engine | tokens/s (wall) | tokens/s (CPU s) | speed-up vs cat (CPU s) | KV cache MiB |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for bsz in (int(v) for v in args.batch_sizes.split(",")):
        gen = torch.Generator().manual_seed(bsz)
        input_ids = torch.randint(0, args.vocab, (bsz, args.prompt_len), generator=gen).to(args.device)
        for r in (int(v) for v in args.recurrences.split(",")):
            runs = {}
            if "cat" in engines:
                runs["cat"] = lambda new_tokens, stop_after: concat_generate(model, input_ids, stop_after, r)
            for mode in ("full", "latest"):
                if mode in engines:
                    runs[mode] = engine_run(model, input_ids, r, mode, compile=False)
                    if args.compile:
                        runs[f"{mode}+compile"] = engine_run(model, input_ids, r, mode, compile=True)
            baseline = None
            for name, run in runs.items():
                wall, cpu, nbytes = time_run(run, args.new_tokens, args.device, args.repeats)
                tokens = bsz * args.new_tokens
                baseline = baseline or (cpu if name == "cat" else None)
                speedup = f"{baseline / cpu:.2f}" if baseline else "-"
                print(f"| {bsz} | {r} | {name} | {tokens / wall:.1f} | {tokens / cpu:.1f} | {speedup} | "
                      f"{nbytes / 2**20:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
