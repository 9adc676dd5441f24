"""Benchmark the generation engine (docs/generation.md): decoding speed, and the quality of cheaper depth.

speed: for each batch size and recurrence r, greedy decoding of --new-tokens after a --prompt-len
prompt on a random model (default (P,R,C) = (1,2,1), d 256, 4 heads (2 KV), FFN 768, vocab 512,
fp32), by
- ``cat``: the decoder before the engine (kept here only, for comparison): K/V per (block, iteration)
  grown with ``torch.cat`` at every token, the attention mask grown the same way;
- ``full``, ``latest``: the engine with its preallocated cache, eager; ``--compile`` adds ``full+compile``
  and ``latest+compile``: the fast decode path (inference/decode_program.py; one CUDA graph per token
  on a GPU);
- ``hf source`` (with ``--hf-source FOLDER``): transformers' own ``generate`` of a plain HF model (the
  source a retrofit came from, e.g. tools/fetch_smollm2.sh's), greedy, on the same prompts: the speed a
  user had before the retrofit. Timed once per batch size (it has no r), in the first r's rounds.
tokens/s counts new tokens of the whole batch (prompt included in the time) per second of wall time
and per CPU second of this process (on a GPU use wall). Each configuration is warmed up on the same
shapes (stopping after 4 tokens; its seconds are the "warm-up s" column: compiling, for the fast
path), then timed in --rounds interleaved rounds (medians; see run_speed). "bound tokens/s" is what
the memory bandwidth allows: the weights and K/V one step must read (``decode_bytes``, at the mean
context) over the measured copy bandwidth; "% of bound" is the engine's share of it.

check: the fast path's logits against eager decoding's in --dtype (teacher-forced with eager's greedy
tokens): the largest difference and the argmax agreement; on a GPU also the token steps under
``torch.cuda.set_sync_debug_mode("error")``.

memory: the KV-cache bytes the engine allocates (KVCache.planned_bytes, no model built) for a source
preset's retrofit, per kv_sharing mode and r.

quality: teacher-forced decoding of held-out rows through the cache (prompt --prompt-len tokens, then
--new-tokens given tokens fed back one at a time): loss, agreement of each position's greedy token
with "full" at r, and mean core iterations per decoded token, for full at lower r, "latest",
"compress-2" and adaptive exit at each --thresholds.

    OMP_NUM_THREADS=1 python tools/bench_generate.py speed
    python tools/bench_generate.py speed --device cuda --dtype bfloat16 --dim 2048 --heads 32 --kv-heads 8 \\
        --ffn 8192 --vocab 128256 --shape 4,6,4 --batch-sizes 1,8,64 --recurrences 32 --prompt-len 32 \\
        --new-tokens 128 --engines full --compile
    python tools/bench_generate.py check --device cuda --dim 2048 --heads 32 --kv-heads 8 --ffn 8192 \\
        --vocab 128256 --shape 4,6,4
    python tools/bench_generate.py memory --preset llama3.2-1b --shape 4,6,4 --tokens 2048
    OMP_NUM_THREADS=1 python tools/bench_generate.py quality --checkpoint outputs/demo/run/final_model \\
        --config train_configs/debug_model.toml --num-steps 16 --lower-steps 1,2,4,8

task: accuracy of each test-time setting on a task of tools/make_depth_task.py, on a model that uses depth
(tools/reproduce_mini.sh's). Each question is decoded token by token through the cache from BOS
(teacher-forced: every question token runs the decode path with the setting's KV sharing, exit
criterion and state init), and the answer is the greedy token after the last one. Reports exact match
per length, mean core iterations per decoded token and the KV cache bytes, for full at each
--recurrences, each --kv-sharing-modes and warm start at --num-steps, and every exit criterion at
each of its thresholds (max_steps --num-steps).

    OMP_NUM_THREADS=1 python tools/bench_generate.py task --checkpoint outputs/mini/runs/recurrent_s0/final_model \\
        --task-dir outputs/mini/task --lengths 7-12

speculative: depth-speculative decoding (GenerationOptions.draft_steps / lookahead) against plain greedy
decoding at each --recurrences, on a model that uses depth and its task (as for ``task``). From each
question (BOS + prompt) --new-tokens are generated freely, EOS ignored: the first is the answer (exact
match), the rest the model's own continuation (further questions and answers). Per batch size and r,
every setting (plain, and each draft depth x lookahead) is warmed up, then timed in --rounds
alternated rounds over the same questions; tokens/s is the median over rounds, "vs plain" the median
of the per-round ratios to plain (a shared machine's drift cancels out). Also: whether every token
equals plain decoding's, the acceptance rate, the core iterations spent per token (drafts and
verifications) and the KV cache.

    OMP_NUM_THREADS=1 python tools/bench_generate.py speculative \\
        --checkpoint outputs/mini/runs/recurrent_s0/final_model --task-dir outputs/mini/task
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from bench_models import add_shape_arguments, random_model, shape_model_args  # a sibling: tools/ is sys.path[0]
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from titan_recur import RecurrentLM
from titan_recur.inference.decode_program import DecodeProgram
from titan_recur.inference.engine import generate
from titan_recur.inference.options import GenerationOptions
from titan_recur.models.model import Decoding
from titan_recur.storage.checkpoint import CheckpointError


class ConcatKVCache:
    """The cache before the engine: one tensor pair per (block, iteration), grown by torch.cat per token."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0

    def begin(self, seqlen: int) -> int:
        return self.length + seqlen

    def advance(self, seqlen: int) -> None:
        self.length += seqlen

    def iteration_view(self, iteration: int) -> SimpleNamespace:
        return SimpleNamespace(update=lambda slot, k, v: self.update(slot, k, v, iteration))

    def update(self, slot, k, v, iteration=0):
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
    """The decoder before the engine (model.forward with a growing cache and mask); returns the cache bytes."""
    attention_mask = torch.ones_like(input_ids)
    cache = ConcatKVCache()
    step_input = input_ids
    for _ in range(new_tokens):
        logits = model(
            step_input, num_steps, attention_mask=attention_mask, state_init="zero", decoding=Decoding(cache=cache)
        )
        step_input = logits[:, -1].argmax(dim=-1)[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(step_input)], dim=1)
    return cache.nbytes()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_speed_command(commands)
    _add_check_command(commands)
    _add_memory_command(commands)
    _add_quality_command(commands)
    _add_task_command(commands)
    _add_speculative_command(commands)
    return parser.parse_args(argv)


def _add_speed_command(commands: Any) -> None:
    speed = commands.add_parser("speed", help="tokens/s of the engine vs the concatenating cache")
    speed.add_argument("--device", default="cpu")
    speed.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_shape_arguments(speed)
    speed.add_argument("--batch-sizes", default="1,8")
    speed.add_argument("--recurrences", default="1,4,32")
    speed.add_argument("--prompt-len", type=int, default=32)
    speed.add_argument("--new-tokens", type=int, default=256)
    speed.add_argument("--engines", default="cat,full,latest", help="subset of cat,full,latest")
    speed.add_argument("--compile", action="store_true", help="also time the engine with compiled core iterations")
    speed.add_argument("--rounds", type=int, default=3, help="timed runs of each engine, interleaved")
    speed.add_argument(
        "--iterations-per-call",
        type=int,
        default=GenerationOptions.iterations_per_call,
        help="core iterations per compiled call (GenerationOptions.iterations_per_call)",
    )
    speed.add_argument("--hf-source", help="also time transformers' generate of this plain HF model folder")
    speed.add_argument("--jsonl", type=Path, help="also append each row as one JSON line to this file")


def _add_check_command(commands: Any) -> None:
    check = commands.add_parser("check", help="logits of the fast decode path vs eager (and host syncs on a GPU)")
    check.add_argument("--device", default="cpu")
    check.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    add_shape_arguments(check)
    check.add_argument("--batch-size", type=int, default=2)
    check.add_argument("--recurrences", default="4,32")
    check.add_argument("--prompt-len", type=int, default=32)
    check.add_argument("--new-tokens", type=int, default=32)
    check.add_argument("--jsonl", type=Path, help="also append each r's figures as one JSON line to this file")


def _add_memory_command(commands: Any) -> None:
    memory = commands.add_parser("memory", help="KV-cache bytes of a source preset's retrofit per mode and r")
    memory.add_argument("--preset", default="llama3.2-1b", help="source preset (titan_recur.models.args.PRESETS)")
    memory.add_argument("--shape", default="4,6,4", help="P,R,C")
    memory.add_argument("--recurrences", default="1,4,32")
    memory.add_argument("--tokens", type=int, default=2048, help="cached tokens per sequence")
    memory.add_argument("--kv-sharing-modes", default="full,compress-4,latest")


def _add_quality_command(commands: Any) -> None:
    quality = commands.add_parser("quality", help="loss and token agreement of cheaper depth vs full")
    quality.add_argument("--checkpoint", required=True, help="model folder")
    source = quality.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="train config TOML: its validation split")
    source.add_argument("--data", help="held-out file (.jsonl/.parquet/text)")
    quality.add_argument("--num-steps", type=int, default=8, help="r of the reference and max_steps of exits")
    quality.add_argument("--lower-steps", default="1,2,4", help="full at these r too (the fixed-depth baseline)")
    quality.add_argument("--criterion", default="kl")
    quality.add_argument("--thresholds", default="1e-2,1e-3,1e-4")
    quality.add_argument("--min-steps", type=int, default=1)
    quality.add_argument("--kv-sharing-modes", default="latest,compress-2")
    quality.add_argument("--prompt-len", type=int, default=32)
    quality.add_argument("--new-tokens", type=int, default=96)
    quality.add_argument("--batches", type=int, default=4)
    quality.add_argument("--batch-size", type=int, default=8)


def _add_task_command(commands: Any) -> None:
    task = commands.add_parser("task", help="task accuracy vs iterations of each depth setting (teacher-forced)")
    task.add_argument("--checkpoint", required=True, help="recurrent model folder")
    task.add_argument("--task-dir", type=Path, required=True, help="tools/make_depth_task.py output (eval_<n>.jsonl)")
    task.add_argument("--lengths", default="7-12", help="evaluation lengths A-B (default 7-12)")
    task.add_argument("--num-steps", type=int, default=32, help="r of the reference and max_steps of exits")
    task.add_argument("--recurrences", default="1,2,4,8,16", help="full at these r too (the fixed-depth baseline)")
    task.add_argument("--kv-sharing-modes", default="latest,compress-2,compress-4")
    task.add_argument(
        "--thresholds",
        default="kl:1e-2,1e-3,1e-4;latent-diff:0.1,0.03,0.01;entropy-diff:1e-2,1e-3,1e-4;argmax:2,5",
        help="criterion:thresholds;... (default Huginn's ranges around its defaults)",
    )
    task.add_argument("--limit", type=int, help="questions per length (default all)")


def _add_speculative_command(commands: Any) -> None:
    spec = commands.add_parser("speculative", help="tokens/s and accuracy of speculative vs plain decoding")
    spec.add_argument("--checkpoint", required=True, help="recurrent model folder")
    spec.add_argument("--task-dir", type=Path, required=True, help="tools/make_depth_task.py output (eval_<n>.jsonl)")
    spec.add_argument("--lengths", default="7-12", help="evaluation lengths A-B (default 7-12)")
    spec.add_argument("--limit", type=int, default=4, help="questions per length (default 4)")
    spec.add_argument("--new-tokens", type=int, default=48, help="tokens generated per question (default 48)")
    spec.add_argument("--recurrences", default="16,32", help="target depths r (default 16,32)")
    spec.add_argument("--draft-steps", default="1,2,4", help="draft depths (default 1,2,4)")
    spec.add_argument("--lookaheads", default="2,4,8", help="drafted tokens per round (default 2,4,8)")
    spec.add_argument("--batch-sizes", default="1,4", help="questions decoded together (default 1,4)")
    spec.add_argument("--rounds", type=int, default=3, help="timed rounds, settings alternated (default 3)")


# --- speed --------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> RecurrentLM:
    model = random_model(shape_model_args(args, max_seq_len=args.prompt_len + args.new_tokens))
    return model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_run(
    model: RecurrentLM, input_ids: torch.Tensor, r: int, kv_sharing: str, compile: bool, iterations_per_call: int
):
    def run(new_tokens: int, stop_after: int) -> int:
        options = GenerationOptions(
            max_new_tokens=new_tokens,
            num_steps=r,
            kv_sharing=kv_sharing,
            compile=compile,
            iterations_per_call=iterations_per_call,
        )

        def stop(tokens: torch.Tensor) -> torch.Tensor:
            return torch.full((tokens.shape[0],), tokens.shape[1] >= stop_after, device=tokens.device)

        return generate(model, input_ids, options, stop=stop).kv_cache_bytes

    return run


def time_run(run, new_tokens: int, device: str) -> tuple[float, float, int]:
    """(wall s, CPU s, cache bytes) of one run of ``new_tokens``."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    nbytes = run(new_tokens, new_tokens)
    synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu, nbytes


class ChosenAttention(TorchFunctionMode):
    """The kernel each ``scaled_dot_product_attention`` call dispatches to (flash, memory-efficient, cuDNN or
    math), asked of torch's own chooser with that call's arguments: on a GPU the difference between a
    fused kernel and math, which copies K/V per call, is the decode step's speed."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.chosen.append(SDPBackend(torch._fused_sdp_choice(*args, **kwargs)).name.lower())
        return func(*args, **kwargs)


def attention_backends(run) -> dict[str, str]:
    """{"prefill": ..., "decode": ...}: the kernels of a one-token run (the prompt's forward), then those a
    two-token run adds (a decode step; the same for the compiled step, whose graph holds the op the same
    chooser picked). Uncompiled runs only: a mode does not reach inside a compiled graph."""
    with ChosenAttention() as prefill:
        run(1, 1)
    with ChosenAttention() as both:
        run(2, 2)
    decode = both.chosen[len(prefill.chosen) :]
    return {"prefill": "+".join(sorted(set(prefill.chosen))), "decode": "+".join(sorted(set(decode)))}


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 5: the memory bandwidth the
    decode bound divides by."""
    source = torch.empty(2**26 if device.startswith("cuda") else 2**24, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = math.inf
    for _ in range(5):
        synchronize(device)
        began = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 2 * source.numel() * source.element_size() / best


def decode_bytes(model: RecurrentLM, r: int, batch: int, context: int) -> int:
    """Bytes one decode step must read at least: every weight a token runs through (the once-run blocks,
    the norm and head once, the core blocks and adapter r times; rows share them), plus each row's K/V
    of every attention it runs over ``context`` cached tokens."""
    a = model.args
    element = model.embed_tokens.weight.element_size()
    once = [*model.once_blocks(), model.norm]
    per_iteration = [] if model.core is None else [*model.core.blocks, model.core.adapter]
    weights = sum(p.numel() for m in once for p in m.parameters()) + model.head_weight().numel()
    weights += r * sum(p.numel() for m in per_iteration for p in m.parameters())
    attentions = a.n_prelude + a.n_coda + (r * a.n_core if model.core is not None else 0)
    kv = attentions * 2 * a.n_kv_heads * a.head_dim * context
    return (weights + batch * kv) * element


def hf_run(model: Any, input_ids: torch.Tensor):
    """transformers' greedy generate of exactly ``stop_after`` new tokens (EOS ignored): the source's speed."""

    def run(new_tokens: int, stop_after: int) -> int:
        with torch.no_grad():
            model.generate(
                input_ids, max_new_tokens=stop_after, min_new_tokens=stop_after, do_sample=False, pad_token_id=0
            )
        return 0

    return run


def load_hf_source(folder: str | None, device: str, dtype: str) -> Any:
    if folder is None:
        return None
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()


def run_speed(args: argparse.Namespace) -> None:
    """Every engine warmed up (a run stopping at 4 tokens, timed: the compile of a compiled engine), then
    --rounds rounds timing each engine once in turn; per engine the median over rounds of tokens/s and of
    its ratio to ``cat`` in the same round, so a slow drift of a shared machine's speed cancels out of the
    ratios. The bound: batch tokens per (``decode_bytes`` at the mean context / copy bandwidth)."""
    model = build_model(args)
    hf_source = load_hf_source(args.hf_source, args.device, args.dtype)
    engines = args.engines.split(",")
    bandwidth = copy_bandwidth(args.device)
    print(
        f"# {args.shape} d={args.dim} heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab={args.vocab} "
        f"{args.dtype} {args.device}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"threads={torch.get_num_threads()}, median of {args.rounds} rounds, copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s" + (", +compile: the fast decode path" if args.compile else "")
    )
    print(
        "| batch | r | engine | tokens/s (wall) | tokens/s (CPU s) | vs cat (wall) | vs cat (CPU s) | KV cache MiB "
        "| bound tokens/s | % of bound | warm-up s | decode-only tokens/s | prefill s | attention (prefill / decode) |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for bsz in (int(v) for v in args.batch_sizes.split(",")):
        gen = torch.Generator().manual_seed(bsz)
        input_ids = torch.randint(0, args.vocab, (bsz, args.prompt_len), generator=gen).to(args.device)
        for index, r in enumerate(int(v) for v in args.recurrences.split(",")):
            runs = {}
            if hf_source is not None and index == 0:
                runs["hf source"] = hf_run(hf_source, input_ids % hf_source.config.vocab_size)
            if "cat" in engines:
                runs["cat"] = lambda new_tokens, stop_after, r=r, input_ids=input_ids: concat_generate(
                    model, input_ids, stop_after, r
                )
            for mode in ("full", "latest"):
                if mode in engines:
                    runs[mode] = engine_run(model, input_ids, r, mode, False, args.iterations_per_call)
                    if args.compile:
                        runs[f"{mode}+compile"] = engine_run(model, input_ids, r, mode, True, args.iterations_per_call)
            # a compiled engine's kernels are its uncompiled twin's (the same chooser, the same arguments)
            backends = {name: attention_backends(run) for name, run in runs.items() if not name.endswith("+compile")}
            warmup = {}
            for name, run in runs.items():
                synchronize(args.device)
                began = time.perf_counter()
                run(args.new_tokens, 4)
                synchronize(args.device)
                warmup[name] = time.perf_counter() - began
            timings: dict[str, list[tuple[float, float, int]]] = {name: [] for name in runs}
            prefills: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    timings[name].append(time_run(run, args.new_tokens, args.device))
                    prefills[name].append(time_run(run, 1, args.device)[0])  # the prompt and its first token
            bound = bsz * bandwidth / decode_bytes(model, r, bsz, args.prompt_len + args.new_tokens // 2)
            for name, rows in timings.items():
                prefill = statistics.median(prefills[name])
                attention = backends[name.removesuffix("+compile")]
                report_speed(args, name, rows, timings.get("cat"), bsz, r, bound, warmup[name], prefill, attention)


def report_speed(
    args: argparse.Namespace,
    name: str,
    rows: list[tuple[float, float, int]],
    cat: list[tuple[float, float, int]] | None,
    bsz: int,
    r: int,
    bound: float,
    warmup_s: float,
    prefill_s: float,
    attention: dict[str, str],
) -> None:
    """One engine's row of the speed table, and with --jsonl its JSON line. ``rows``: (wall s, CPU s, cache bytes)
    per round; ``cat``: the concatenating decoder's, of the same rounds, for the ratios; ``prefill_s``: a run of
    one new token (the prompt's forward and the first choice), so that the decode-only rate is the other
    new tokens over the time beyond it; ``attention``: the SDPA kernels of prefill and decode."""
    tokens = bsz * args.new_tokens
    median_wall = statistics.median(row[0] for row in rows)
    wall = tokens / median_wall
    decode_only = bsz * (args.new_tokens - 1) / (median_wall - prefill_s) if median_wall > prefill_s else math.nan
    cpu = tokens / statistics.median(row[1] for row in rows)
    ratios = ["-", "-"]
    if cat is not None:
        ratios = [f"{statistics.median(b[i] / t[i] for b, t in zip(cat, rows, strict=True)):.2f}" for i in (0, 1)]
    ours = name != "hf source"  # the bound and cache are this model's, at this r
    cache_mib = rows[0][2] / 2**20
    print(
        f"| {bsz} | {r if ours else '-'} | {name} | {wall:.1f} | {cpu:.1f} | {ratios[0]} | {ratios[1]} | "
        + (f"{cache_mib:.2f} | {bound:.1f} | {100 * wall / bound:.1f}" if ours else "- | - | -")
        + f" | {warmup_s:.1f} | {decode_only:.1f} | {prefill_s:.3f} | {attention['prefill']} / {attention['decode']} |",
        flush=True,
    )
    append_jsonl(
        args.jsonl,
        {
            **bench_settings(args, "decode_speed"),
            "batch": bsz,
            "r": r if ours else None,
            "engine": name,
            "rounds": args.rounds,
            "tokens_per_sec": wall,
            "tokens_per_sec_cpu": cpu,
            "kv_cache_mib": cache_mib if ours else None,
            "bound_tokens_per_sec": bound if ours else None,
            "share_of_bound": wall / bound if ours else None,
            "warmup_seconds": warmup_s,
            "decode_tokens_per_sec": decode_only,
            "prefill_seconds": prefill_s,
            "attention_backends": attention,
        },
    )


def bench_settings(args: argparse.Namespace, bench: str) -> dict:
    """What a JSON line's figures were measured on: the command, device, dtype, model shape, prompt and tokens."""
    names = ("device", "dtype", "shape", "dim", "heads", "kv_heads", "ffn", "vocab", "prompt_len", "new_tokens")
    return {"bench": bench, **{name: getattr(args, name) for name in names}}


def append_jsonl(path: Path | None, record: dict) -> None:
    """Append one JSON line (tools/bench_gpu.sh collects them); nothing without --jsonl."""
    if path is not None:
        with path.open("a") as out:
            out.write(json.dumps(record) + "\n")


# --- check --------------------------------------------------------------------------------------


def run_check(args: argparse.Namespace) -> None:
    """The fast path against eager decoding in the model's dtype: the fast path teacher-forced with eager's
    greedy tokens (so both see the same inputs at every position), the largest logit difference against
    the logits' spread, and how often the argmax agrees; on a GPU, the captured token steps under
    ``torch.cuda.set_sync_debug_mode("error")`` (a host sync inside them raises)."""
    model = build_model(args)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch_size, args.prompt_len), generator=gen).to(args.device)
    for r in (int(v) for v in args.recurrences.split(",")):
        options = GenerationOptions(max_new_tokens=args.new_tokens, num_steps=r)
        eager = generate(model, input_ids, dataclasses.replace(options, compile=False), return_logits=True)
        forced = eager.tokens
        fast = generate(
            model, input_ids, dataclasses.replace(options, compile=True), forced_tokens=forced, return_logits=True
        )
        assert eager.logits is not None and fast.logits is not None  # asked for
        difference = float((fast.logits - eager.logits).abs().max())
        agree = float((fast.logits.argmax(-1) == eager.logits.argmax(-1)).float().mean())
        std = float(eager.logits.std())
        print(
            f"r={r} batch {args.batch_size} {args.dtype} {args.device}: fast vs eager over {args.new_tokens} "
            f"teacher-forced tokens: max |logit difference| {difference:.4f} (logit std "
            f"{std:.3f}), argmax agreement {100 * agree:.1f}%",
            flush=True,
        )
        sync_checked_steps = args.device.startswith("cuda")
        if sync_checked_steps:
            with mock.patch.object(DecodeProgram, "step", sync_checked(DecodeProgram.step)):
                generate(model, input_ids, dataclasses.replace(options, compile=True))
            print(f"r={r}: every token step under set_sync_debug_mode('error'): no host sync", flush=True)
        append_jsonl(
            args.jsonl,
            {
                **bench_settings(args, "decode_check"),
                "batch": args.batch_size,
                "r": r,
                "max_logit_difference": difference,
                "logit_std": std,
                "argmax_agreement": agree,
                "host_sync_checked": sync_checked_steps,  # the token steps ran under set_sync_debug_mode("error")
            },
        )


def sync_checked(step: Callable[[DecodeProgram], None]) -> Callable[[DecodeProgram], None]:
    """``DecodeProgram.step`` raising on any host sync (a GPU's ``set_sync_debug_mode("error")``)."""

    def checked(program: DecodeProgram) -> None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(program)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return checked


# --- memory -------------------------------------------------------------------------------------


def run_memory(args: argparse.Namespace) -> None:
    """Planned bf16 cache bytes of one sequence (KVCache.planned_bytes, what the engine allocates)."""
    from titan_recur.models.args import PRESETS
    from titan_recur.models.cache import KVCache, core_slots_per_block

    preset = PRESETS[args.preset]
    model_args = preset.model_args(*(int(v) for v in args.shape.split(",")))
    static = KVCache.planned_bytes(model_args, 1, args.tokens, 1, "latest", 2)
    print(
        f'# {args.preset} as ({args.shape}), one sequence of {args.tokens} tokens, bf16; "latest" = a static '
        f"model of P+R+C layers"
    )
    print("| r | kv_sharing | layer slots | KV cache MiB | vs latest |")
    print("|---:|---|---:|---:|---:|")
    for r in (int(v) for v in args.recurrences.split(",")):
        for mode in args.kv_sharing_modes.split(","):
            nbytes = KVCache.planned_bytes(model_args, 1, args.tokens, r, mode, 2)
            slots = model_args.n_prelude + model_args.n_coda + model_args.n_core * core_slots_per_block(mode, r)
            print(f"| {r} | {mode} | {slots} | {nbytes / 2**20:.1f} | {nbytes / static:.2f} |")


# --- quality ------------------------------------------------------------------------------------


def heldout_rows(args: argparse.Namespace, tokenizer) -> list[torch.Tensor]:
    """Batches of held-out rows, each prompt + new tokens long; a padded row (the end of the data) is left out."""
    from titan_recur.eval.sweep import heldout_batches
    from titan_recur.models.loss import IGNORE_INDEX

    batches = heldout_batches(
        tokenizer,
        seq_len=args.prompt_len + args.new_tokens,
        batch_size=args.batch_size,
        num_batches=args.batches,
        data=args.data,
        config=args.config,
    )
    rows = [batch["input_ids"][(batch["labels"] != IGNORE_INDEX).all(-1)] for batch in batches]
    return [ids for ids in rows if len(ids)]


def run_quality(args: argparse.Namespace) -> None:
    from titan_recur.data.tokenizer import load_tokenizer
    from titan_recur.eval.loading import load_checkpoint

    model = load_checkpoint(args.checkpoint)
    rows = heldout_rows(args, load_tokenizer(args.checkpoint))
    r, p = args.num_steps, args.prompt_len
    settings = {f"full r={r}": dict(num_steps=r)}
    settings.update({f"full r={k}": dict(num_steps=k) for k in map(int, args.lower_steps.split(",")) if k != r})
    settings.update({f"{mode} r={r}": dict(num_steps=r, kv_sharing=mode) for mode in args.kv_sharing_modes.split(",")})
    for threshold in map(float, args.thresholds.split(",")):
        settings[f"full r={r}, exit {args.criterion} < {threshold:g}"] = dict(
            num_steps=r, exit_criterion=args.criterion, exit_threshold=threshold, min_steps=args.min_steps
        )
    print(
        f"# {args.checkpoint}: {sum(len(b) for b in rows)} held-out rows, prompt {p} tokens, "
        f"{args.new_tokens} teacher-forced tokens each"
    )
    print("| setting | loss | greedy agreement with full | mean iterations / token | of r | coda+head calls / token |")
    print("|---|---:|---:|---:|---:|---:|")
    reference = None
    for name, knobs in settings.items():
        losses, argmaxes, steps, calls = [], [], [], []
        for ids in rows:
            options = GenerationOptions(max_new_tokens=args.new_tokens, **knobs)
            out = generate(model, ids[:, :p], options, forced_tokens=ids[:, p:], return_logits=True)
            losses.append(F.cross_entropy(out.logits.flatten(0, 1), ids[:, p:].flatten(), reduction="none"))
            argmaxes.append(out.logits.argmax(-1))
            steps.append(out.steps[:, 1:].float())  # decoded tokens (the first comes from the prompt's r)
            calls.append(out.head_calls[:, 1:].float())
        argmax = torch.cat(argmaxes)
        reference = argmax if reference is None else reference
        mean_steps = float(torch.cat(steps).mean())
        print(
            f"| {name} | {float(torch.cat(losses).mean()):.4f} | {float((argmax == reference).float().mean()):.4f} | "
            f"{mean_steps:.2f} | {mean_steps / r:.0%} | {float(torch.cat(calls).mean()):.2f} |",
            flush=True,
        )


# --- task ---------------------------------------------------------------------------------------


def task_settings(args: argparse.Namespace) -> dict[str, dict]:
    """The depth settings of `task`, by name: fixed r, KV sharing, warm start, and each exit criterion."""
    r = args.num_steps
    settings = {f"full r={k}": dict(num_steps=k) for k in sorted({*map(int, args.recurrences.split(",")), r})}
    settings.update({f"{mode} r={r}": dict(num_steps=r, kv_sharing=mode) for mode in args.kv_sharing_modes.split(",")})
    settings[f"full r={r}, warm start"] = dict(num_steps=r, state_init="previous")
    for spec in args.thresholds.split(";"):
        criterion, _, values = spec.partition(":")
        for threshold in map(float, values.split(",")):
            rule = f"stable for {threshold:g} checks" if criterion == "argmax" else f"< {threshold:g}"
            settings[f"exit {criterion} {rule} (max {r})"] = dict(
                num_steps=r, exit_criterion=criterion, exit_threshold=threshold
            )
    return settings


def run_task(args: argparse.Namespace) -> None:
    from titan_recur.data.tokenizer import load_tokenizer
    from titan_recur.eval.loading import load_checkpoint

    model, tokenizer = load_checkpoint(args.checkpoint), load_tokenizer(args.checkpoint)
    lengths = task_lengths(args.lengths)
    questions = task_questions(args, tokenizer)  # one batch per length: its questions have the same token count
    print(
        f"# {args.checkpoint}: {sum(len(a) for _, a in questions.values())} questions of lengths "
        f"{lengths[0]}-{lengths[-1]}, each decoded token by token from BOS"
    )
    print(
        "| setting | exact match | "
        + " | ".join(f"len {n}" for n in lengths)
        + " | mean iterations / token | KV cache (bytes / question) |"
    )
    print("|---|---:|" + "---:|" * len(lengths) + "---:|---:|")
    for name, knobs in task_settings(args).items():
        hits, per_length, steps, cache = 0, [], [], 0
        for ids, answers in questions.values():
            options = GenerationOptions(max_new_tokens=ids.shape[1], **knobs)
            out = generate(model, ids[:, :1], options, forced_tokens=ids[:, 1:], return_logits=True)
            correct = out.logits[:, -1].argmax(-1) == answers
            hits += int(correct.sum())
            per_length.append(float(correct.float().mean()))
            steps.append(out.steps[:, 1:].float().flatten())  # the decoded question tokens
            cache = max(cache, out.kv_cache_bytes // len(answers))
        total = sum(len(a) for _, a in questions.values())
        print(
            f"| {name} | {hits / total:.3f} | "
            + " | ".join(f"{a:.2f}" for a in per_length)
            + f" | {float(torch.cat(steps).mean()):.2f} | {cache:,} |",
            flush=True,
        )


# --- speculative --------------------------------------------------------------------------------


def task_lengths(text: str) -> range:
    """--lengths 'A-B' (or 'A'): the evaluation lengths."""
    low, _, high = text.partition("-")
    try:
        lengths = range(int(low), int(high or low) + 1)
    except ValueError:
        raise ValueError(f"--lengths expects a length or a range A-B, got {text!r}") from None
    if not lengths or lengths[0] < 1:
        raise ValueError(f"--lengths expects 1 <= A <= B, got {text!r}")
    return lengths


def task_questions(args: argparse.Namespace, tokenizer) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per evaluation length: (BOS + prompt ids (N, T), answer token ids (N,)); a length's prompts share T."""
    import json

    questions = {}
    for n in task_lengths(args.lengths):
        rows = [json.loads(line) for line in (args.task_dir / f"eval_{n}.jsonl").open()][: args.limit]
        ids = torch.tensor([tokenizer.encode(row["prompt"], bos=True, eos=False) for row in rows])
        answers = torch.tensor([tokenizer.encode(row["completion"], bos=False, eos=False)[0] for row in rows])
        questions[n] = (ids, answers)
    return questions


def speculative_settings(args: argparse.Namespace, r: int) -> dict[str, dict]:
    """plain, then each draft depth below r x lookahead, by name."""
    settings: dict[str, dict] = {"plain": {}}
    for draft in (int(v) for v in args.draft_steps.split(",")):
        if draft < r:
            for lookahead in (int(v) for v in args.lookaheads.split(",")):
                settings[f"draft {draft}, lookahead {lookahead}"] = dict(draft_steps=draft, lookahead=lookahead)
    return settings


def decode_questions(model: RecurrentLM, batches: list[tuple[torch.Tensor, torch.Tensor]], options: GenerationOptions):
    """Every batch decoded with ``options``: (wall s, tokens, correct answers, drafted, accepted, iterations, cache)."""
    start = time.perf_counter()
    outs = [generate(model, ids, options) for ids, _ in batches]
    wall = time.perf_counter() - start
    spec = [out.speculation for out in outs if out.speculation is not None]
    return SimpleNamespace(
        wall=wall,
        tokens=[out.tokens for out in outs],
        correct=sum(int((out.tokens[:, 0] == answers).sum()) for out, (_, answers) in zip(outs, batches, strict=True)),
        drafted=sum(int(s.drafted.sum()) for s in spec),
        accepted=sum(int(s.accepted.sum()) for s in spec),
        iterations=sum(int(s.core_iterations.sum()) for s in spec) if spec else None,
        cache=max(out.kv_cache_bytes for out in outs),
    )


def run_speculative(args: argparse.Namespace) -> None:
    from titan_recur.data.tokenizer import load_tokenizer
    from titan_recur.eval.loading import load_checkpoint

    model, tokenizer = load_checkpoint(args.checkpoint), load_tokenizer(args.checkpoint)
    questions = task_questions(args, tokenizer)
    total = sum(len(answers) for _, answers in questions.values())
    print(
        f"# {args.checkpoint}: {total} questions of lengths {args.lengths}, {args.new_tokens} new tokens each "
        f"(EOS ignored), threads={torch.get_num_threads()}, median of {args.rounds} alternated rounds"
    )
    print(
        "| batch | r | setting | tokens/s | vs plain | same tokens as plain | acceptance | iterations / token "
        "| exact match | KV cache MiB |"
    )
    print("|---:|---:|---|---:|---:|---|---:|---:|---:|---:|")
    for bsz in (int(v) for v in args.batch_sizes.split(",")):
        batches = [
            (ids[i : i + bsz], answers[i : i + bsz])
            for ids, answers in questions.values()
            for i in range(0, len(answers), bsz)
        ]
        tokens = sum(len(answers) for _, answers in batches) * args.new_tokens
        for r in (int(v) for v in args.recurrences.split(",")):
            options = {
                name: GenerationOptions(max_new_tokens=args.new_tokens, num_steps=r, **knobs)
                for name, knobs in speculative_settings(args, r).items()
            }
            for option in options.values():  # warm-up: the first call of each shape
                generate(model, batches[0][0], dataclasses.replace(option, max_new_tokens=4))
            rounds = [
                {name: decode_questions(model, batches, option) for name, option in options.items()}
                for _ in range(args.rounds)
            ]
            plain = rounds[0]["plain"]
            for name in options:
                runs = [timing[name] for timing in rounds]
                ratio = statistics.median(timing["plain"].wall / timing[name].wall for timing in rounds)
                first = runs[0]
                same = all(torch.equal(a, b) for a, b in zip(first.tokens, plain.tokens, strict=True))
                acceptance = f"{first.accepted / first.drafted:.2f}" if first.drafted else "-"
                iterations = first.iterations / tokens if first.iterations is not None else r
                print(
                    f"| {bsz} | {r} | {name} | {tokens / statistics.median(run.wall for run in runs):.1f} | "
                    f"{ratio:.2f} | {'yes' if same else 'NO'} | {acceptance} | {iterations:.2f} | "
                    f"{first.correct / total:.3f} | {first.cache / 2**20:.2f} |",
                    flush=True,
                )


def check_inputs(args: argparse.Namespace) -> None:
    """The model folder and the task's files exist, read before any model is loaded."""
    from titan_recur.eval.loading import checkpoint_model_args

    if getattr(args, "checkpoint", None) is not None:
        checkpoint_model_args(args.checkpoint)
    if getattr(args, "task_dir", None) is not None:
        missing = [
            f"eval_{n}.jsonl" for n in task_lengths(args.lengths) if not (args.task_dir / f"eval_{n}.jsonl").is_file()
        ]
        if missing:
            raise FileNotFoundError(
                f"--task-dir {args.task_dir} has no {', '.join(missing)} (tools/make_depth_task.py --out writes them)"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_inputs(args)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"bench_generate.py: error: {err}", file=sys.stderr)
        return 2
    commands = {"speed": run_speed, "check": run_check, "memory": run_memory, "quality": run_quality, "task": run_task}
    commands["speculative"] = run_speculative
    commands[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
