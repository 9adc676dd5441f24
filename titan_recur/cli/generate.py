"""``python -m titan_recur.generate``: continue prompts at a chosen test-time depth (docs/generation.md).

Examples:
  python -m titan_recur.generate --checkpoint outputs/debug/final_model --prompt "The sum of 3 and 4 is" \\
      --num-steps 8
  python -m titan_recur.generate --checkpoint MODEL --prompts prompts.jsonl --num-steps 32 --kv-sharing latest \\
      --exit kl --exit-threshold 1e-3 --min-steps 4 --batch-size 8 --json
(outputs/debug/final_model: the debug run's model, made by `python -m titan_recur.train --config train_configs/debug_model.toml`.)

--prompts reads a JSON-lines file with a "prompt" string per line. --json prints one JSON object:
{"prompts": [{"prompt", "text", "tokens", "steps_per_token", "mean_steps"}, ...], "mean_steps",
"kv_cache_bytes" (the largest batch's cache), "tokens_per_sec", "settings"}, and with --draft-steps
"speculation": {"acceptance_rate", "core_iterations_per_token"} (draft and verify iterations spent per
accepted token). Errors are one line on
stderr, exit code 2, before any decoding.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from titan_recur.cli.kit import OneLineParser, add_checkpoint_arguments, run_command
from titan_recur.data.tokenizer import Tokenizer
from titan_recur.eval.loading import (
    checkpoint_model_args,
    checkpoint_tokenizer,
    load_checkpoint,
    resolve_device,
)
from titan_recur.inference import decode_program
from titan_recur.inference.engine import check_prompts, generate, left_pad
from titan_recur.inference.exit_criteria import describe_criteria, describe_default_thresholds
from titan_recur.inference.options import GenerationOptions, ResolvedOptions
from titan_recur.models.args import ModelArgs
from titan_recur.models.cache import core_slots_per_block
from titan_recur.storage.model_io import DTYPES
from titan_recur.training.cost_model import param_counts
from titan_recur.utils.limits import check_allocation, check_at_least, check_recurrences, kv_cache_bytes

PROG = "python -m titan_recur.generate"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt")
    prompts.add_argument("--prompts", type=Path, help='JSON-lines file, one {"prompt": TEXT} per line')
    parser.add_argument(
        "--num-steps", type=int, help="core iterations per token, r (default: the model's mean_recurrence)"
    )
    parser.add_argument(
        "--kv-sharing",
        default=GenerationOptions.kv_sharing,
        help=f"full (exact), latest, or compress-N (default {GenerationOptions.kv_sharing})",
    )
    parser.add_argument("--exit", dest="exit_criterion", help=f"adaptive exit: {describe_criteria()}")
    parser.add_argument(
        "--exit-threshold",
        type=float,
        help="exit below this value (argmax: stable for this many "
        f"checks); default Huginn's: {describe_default_thresholds()}",
    )
    parser.add_argument(
        "--min-steps",
        type=int,
        default=GenerationOptions.min_steps,
        help=f"iterations before a token may exit (default {GenerationOptions.min_steps})",
    )
    parser.add_argument(
        "--check-every",
        type=int,
        default=GenerationOptions.check_every,
        help="check the exit criterion every J iterations",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")
    parser.add_argument(
        "--state-init",
        help="zero, embed, normal, or previous (warm start from the previous "
        "token's final state); default: the deterministic eval init",
    )
    parser.add_argument(
        "--temperature", type=float, default=GenerationOptions.temperature, help="0 = greedy (default); > 0 samples"
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=GenerationOptions.top_k,
        help=f"sample among the k most likely tokens (default {GenerationOptions.top_k}: all)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=GenerationOptions.top_p,
        help=f"nucleus sampling mass (default {GenerationOptions.top_p:g})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", help="model dtype: float32 (default) or bfloat16")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=GenerationOptions.compile,
        help="the fast decode path: each token a compiled static-shape program, one CUDA graph per token on a "
        "GPU (default: on a GPU yes, on a CPU no; the first compile prints its time)",
    )
    parser.add_argument(
        "--iterations-per-call",
        type=int,
        default=GenerationOptions.iterations_per_call,
        help="with the fast path: core iterations per compiled piece (default 1 on a GPU, 8 on a CPU; "
        "fewer = shorter first compile)",
    )
    parser.add_argument(
        "--draft-steps",
        type=int,
        help="speculative decoding: draft at this many core iterations, "
        "verify at --num-steps in one forward (greedy output is that of --num-steps)",
    )
    parser.add_argument(
        "--lookahead",
        type=int,
        help=f"with --draft-steps: tokens per draft-and-verify round (default {GenerationOptions.lookahead})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (see above)")
    return parser


def check_utf8(text: str, where: str) -> None:
    """A command-line string whose bytes were not UTF-8 (Python keeps them as surrogates): one line, not a
    tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where} is not valid UTF-8 (an undecodable byte at character {err.start})") from None


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt texts; an empty one, a bad line or a missing file is an error naming where."""
    if args.prompt is not None:
        if not args.prompt.strip():
            raise ValueError("--prompt is empty")
        check_utf8(args.prompt, "--prompt")
        return [args.prompt]
    if not args.prompts.is_file():
        raise FileNotFoundError(f"{args.prompts}: no such file")
    try:
        content = args.prompts.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{args.prompts}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})"
        ) from None
    texts = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{args.prompts}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err})") from None
        text = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f'{where}: expected an object with a "prompt" string')
        if not text.strip():
            raise ValueError(f"{where}: empty prompt")
        texts.append(text)
    if not texts:
        raise ValueError(f"{args.prompts}: no prompts")
    return texts


def check_special_ids(tokenizer: Tokenizer, model_args: ModelArgs) -> None:
    """The tokenizer's BOS/EOS are the model's (a folder without the model's own tokenizer is not probed)."""
    for name in ("bos_id", "eos_id"):
        if getattr(model_args, name) is not None and getattr(tokenizer, name) not in (None, getattr(model_args, name)):
            raise ValueError(
                f"the tokenizer's {name} {getattr(tokenizer, name)} is not the model's "
                f"{getattr(model_args, name)}: a tokenizer of another vocabulary"
            )


def check_generation_memory(
    model_args: ModelArgs,
    options: ResolvedOptions,
    encoded: list[list[int]],
    batch_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The largest batch's KV cache (and its returned logits) with the weights fit the device's free memory."""
    rows = min(batch_size, len(encoded))
    prompt = max(len(row) for row in encoded)
    capacity = prompt + options.max_new_tokens
    if options.draft_steps is not None:  # room for each round's block and the rows' rejected drafts
        capacity = max(capacity + options.lookahead + 1, decode_program.speculative_columns(prompt, options, rows))
    core = core_slots_per_block(options.kv_sharing, options.num_steps) * model_args.n_core
    slots = model_args.n_prelude + model_args.n_coda + core
    cache = kv_cache_bytes(rows, capacity, slots, model_args.n_kv_heads, model_args.head_dim, dtype.itemsize)
    logits = rows * options.max_new_tokens * model_args.vocab_size * 4
    weights = param_counts(model_args).total * dtype.itemsize
    check_allocation(
        cache + logits + weights,
        device,
        f"the KV cache of {rows} prompt(s) x {capacity} tokens at {options.num_steps} core iterations "
        f"(kv_sharing {options.kv_sharing}: {slots} attention slots) with the model",
        hint="lower --num-steps, --batch-size, --max-new-tokens or --lookahead, or use --kv-sharing latest",
    )


def options_from_args(args: argparse.Namespace, eos_id: int) -> GenerationOptions:
    """The generation flags, taken whole (their names are GenerationOptions' fields)."""
    return GenerationOptions.from_values(vars(args), eos_id=eos_id)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check everything, then decode; returns the report."""
    check_at_least(args.batch_size, "--batch-size")
    check_at_least(args.max_new_tokens, "--max-new-tokens")
    if args.lookahead is not None and args.draft_steps is None:
        raise ValueError("--lookahead needs --draft-steps (speculative decoding); without it there is no draft")
    if args.num_steps is not None:
        check_recurrences([args.num_steps], "--num-steps")
    if args.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {args.dtype!r}; choose from {', '.join(DTYPES)}")
    texts = read_prompts(args)
    model_args = checkpoint_model_args(args.checkpoint, args.model_config)
    tokenizer = checkpoint_tokenizer(args.checkpoint, args.model_config, args.tokenizer, model_args.vocab_size)
    check_special_ids(tokenizer, model_args)
    options = options_from_args(args, tokenizer.eos_id).resolve(model_args)
    encoded = [tokenizer.encode(text, bos=tokenizer.add_bos, eos=False) for text in texts]
    for row in encoded:
        check_prompts(torch.ones(1, len(row)), options.max_new_tokens, model_args.max_seq_len)
    device = resolve_device(args.device)
    check_generation_memory(model_args, options, encoded, args.batch_size, DTYPES[args.dtype], device)
    model = load_checkpoint(
        args.checkpoint, args.model_config, device=device, dtype=args.dtype, unverified=args.unverified
    )

    results, cache_bytes, seconds, speculation = [], 0, 0.0, []
    for start in range(0, len(encoded), args.batch_size):
        input_ids, attention_mask = left_pad(encoded[start : start + args.batch_size], tokenizer.pad_id or 0)
        began = time.perf_counter()
        out = generate(model, input_ids.to(device), options, attention_mask=attention_mask.to(device))
        seconds += time.perf_counter() - began
        cache_bytes = max(cache_bytes, out.kv_cache_bytes)
        if out.speculation is not None:
            speculation.append(out.speculation)
        for tokens, steps, n in zip(out.tokens.tolist(), out.steps.tolist(), out.lengths.tolist(), strict=True):
            text = tokenizer.decode([t for t in tokens[:n] if t != tokenizer.eos_id])
            results.append(
                {"text": text, "tokens": tokens[:n], "steps_per_token": steps[:n], "mean_steps": sum(steps[:n]) / n}
            )
    for text, result in zip(texts, results, strict=True):
        result["prompt"] = text
    n_tokens = sum(len(r["tokens"]) for r in results)
    report = {
        "prompts": results,
        "mean_steps": sum(sum(r["steps_per_token"]) for r in results) / n_tokens,
        "kv_cache_bytes": cache_bytes,
        "tokens_per_sec": n_tokens / seconds,
        "settings": {k: v for k, v in options.settings().items() if k not in ("eos_id", "generator")},
    }
    if speculation:
        drafted = sum(int(s.drafted.sum()) for s in speculation)
        report["speculation"] = {
            "acceptance_rate": sum(int(s.accepted.sum()) for s in speculation) / drafted if drafted else 0.0,
            "core_iterations_per_token": sum(int(s.core_iterations.sum()) for s in speculation) / n_tokens,
        }
    return report


def print_report(report: dict[str, Any]) -> None:
    for i, result in enumerate(report["prompts"]):
        print(f"### prompt {i}: {len(result['tokens'])} tokens, {result['mean_steps']:.2f} core iterations per token")
        print(result["prompt"] + result["text"])
    print(
        f"### {report['tokens_per_sec']:.1f} tokens/s, mean {report['mean_steps']:.2f} iterations per token, "
        f"KV cache {report['kv_cache_bytes'] / 2**20:.2f} MiB"
    )


def announce_compiles() -> None:
    """The fast path's first compile of a batch bucket takes a while: say what it built and how long it took."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    log = logging.getLogger(decode_program.__name__)
    if not log.handlers:
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    announce_compiles()
    return run_command(PROG, lambda: show(run(args), args.json))


def show(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
    else:
        print_report(report)


if __name__ == "__main__":
    sys.exit(main())
