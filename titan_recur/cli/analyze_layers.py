"""Which layers of an HF Llama / OLMo-2 model to drop and which to loop: measured before any training.

Examples:
  python tools/analyze_layers.py assets/tiny_llama --data assets/corpus/general.jsonl --seq-len 128 --tokens 8192 \\
      --recommend 1,2,1
  python tools/analyze_layers.py assets/tiny_olmo2 --config train_configs/debug_model.toml --tokens 8192 --budget 4
  python tools/analyze_layers.py TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T --data held_out.jsonl \\
      --tokens 65536 --recommend 4,8,4 --device cuda
  python tools/analyze_layers.py hf/Llama-3.2-1B --data held_out.jsonl --budget 14 --device cuda

Per source layer it reports the block influence 1 - cos(h_in, h_out), the angular distance between
layer l's input and layer l+n's for every span n (Gromov et al. 2024: a small distance means layers
l .. l+n-1 are redundant), the loss when the layer alone is dropped and the hidden-state norms.

Candidate surgeries (pick one way):
  --recommend P,R,C   prelude = first P layers, coda = last C, core = any R consecutive layers between
                      them; the rest is dropped.
  --budget K          every P,R,C >= 1 with P + R + C = K, each with every core placement.
Candidates are ranked by the summed angular distance of their dropped spans; the --measure most
redundant ones are converted in memory (as tools/convert_hf.py does) and their held-out loss measured:
identity adapter at r = 1 (the healing start, the same at every r) and random adapter at r = 1, 2, 4.
The top ones are printed with the tools/convert_hf.py command that makes each.

Calibration: --tokens N tokens (rounded up to whole rows of --seq-len tokens) from --data or a train
config's validation split, packed as `python -m titan_recur.eval loss` packs them; the losses equal
that command's on the same rows. Output: tables on stdout, OUT/layer_analysis.json,
OUT/influence.png, OUT/angular_distance.png. Errors are one line, exit code 2, before any work.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from titan_recur.cli.kit import BAD_INPUT, OneLineParser, add_record_arguments, int_list, run_command
from titan_recur.convert.layer_analysis import (
    ANGULAR_PLOT,
    INFLUENCE_PLOT,
    JSON_NAME,
    RANDOM_RECURRENCES,
    analyze,
    candidate_plans,
    format_report,
    plot_report,
    require_matplotlib,
    shapes_for_budget,
)
from titan_recur.convert.surgery import parse_shape, read_source, resolve_source
from titan_recur.storage.model_io import check_output_files, raise_naming, write_files_atomically
from titan_recur.utils.limits import check_allocation, check_recurrences, check_seq_len, forward_bytes

PROG = "titan-recur-analyze-layers"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# torchdata's StatefulDataLoader calls a deprecated torch API on construction; it would precede every line we print.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="local HF folder (config.json + safetensors) or a hub id (owner/name)")
    parser.add_argument("--revision", help="hub revision (branch, tag or commit) when SOURCE is a hub id")
    data = parser.add_argument_group("calibration data").add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="held-out file or glob: .jsonl/.json, .parquet, else plain text")
    data.add_argument("--config", help="train config TOML: use its validation split (data.validation_fraction > 0)")
    add_record_arguments(parser)
    parser.add_argument("--tokens", type=int, default=65536, help="calibration tokens (default 65536)")
    parser.add_argument(
        "--seq-len", type=int, help="tokens per row (default: the config's training.seq_len, else 1024)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward (default 8)")
    surgery = parser.add_argument_group("candidate surgeries").add_mutually_exclusive_group()
    surgery.add_argument("--recommend", metavar="P,R,C", help="rank every core placement of this shape")
    surgery.add_argument("--budget", type=int, metavar="K", help="rank every P,R,C >= 1 with P + R + C = K")
    parser.add_argument(
        "--measure",
        type=int,
        default=32,
        help="convert and measure the loss of this many candidates, those with the smallest angular score (default 32)",
    )
    parser.add_argument(
        "--recurrences",
        type=int_list,
        default=list(RANDOM_RECURRENCES),
        help="test recurrences of the random-adapter losses (default 1,2,4)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random adapter, as convert_hf.py --seed")
    parser.add_argument("--top", type=int, default=5, help="candidates printed (default 5)")
    parser.add_argument("--out", type=Path, help="output folder (default outputs/layer_analysis/<source name>)")
    parser.add_argument("--force", action="store_true", help="replace the results of an earlier analysis in --out")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="model dtype (default float32)")
    return parser


def check_counts(args: argparse.Namespace) -> None:
    for name in ("tokens", "batch_size", "top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.measure < 0:
        raise ValueError(f"--measure must be >= 0, got {args.measure}")
    check_recurrences(args.recurrences)


def output_folder(args: argparse.Namespace) -> Path:
    """--out (or its default), checked: a folder, holding no earlier results unless --force (then only ours)."""
    out = args.out or Path("outputs") / "layer_analysis" / Path(args.source).name
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    check_output_files(
        [out / name for name in (JSON_NAME, INFLUENCE_PLOT, ANGULAR_PLOT)],
        args.force,
        is_analysis_output,
        "a layer analysis result",
    )
    return out


def is_analysis_output(path: Path) -> bool:
    """layer_analysis.json (a report with per-layer rows and the source loss) or one of its PNG plots."""
    try:
        if path.suffix == ".png":
            return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return {"layers", "source_loss"} <= set(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return False


def check_rows(seq_len: int, batch_size: int, config: dict, dtype: torch.dtype, device: torch.device) -> None:
    """Rows fit the source's positions; a batch's forward with the source's weights fits free memory."""
    check_seq_len(seq_len, int(config.get("max_position_embeddings", seq_len)))
    dim, ffn, layers = int(config["hidden_size"]), int(config["intermediate_size"]), int(config["num_hidden_layers"])
    weights = (2 * int(config["vocab_size"]) * dim + layers * (4 * dim * dim + 3 * dim * ffn)) * dtype.itemsize
    # Every layer's hidden states are kept for the distances: one residual stream per layer on top of a forward.
    batch = forward_bytes(batch_size, seq_len, dim, ffn, dtype.itemsize) + layers * batch_size * seq_len * dim * 4
    check_allocation(
        weights + batch,
        device,
        f"a batch of {batch_size} x {seq_len} tokens with the source model",
        hint="lower --batch-size or --seq-len",
    )


def run(argv: list[str] | None = None) -> None:
    from titan_recur.config import load_config
    from titan_recur.data.tokenizer import check_vocab, load_tokenizer
    from titan_recur.eval.loading import resolve_device
    from titan_recur.eval.sweep import heldout_batches

    args = build_parser().parse_args(argv)
    shape = None if args.recommend is None else parse_shape(args.recommend, "--recommend")
    check_counts(args)
    require_matplotlib()
    device = resolve_device(args.device)
    folder = resolve_source(args.source, args.revision)
    source = read_source(folder)
    if args.budget is not None:
        shapes = shapes_for_budget(source.n_layers, args.budget)
    else:
        shapes = [] if shape is None else [shape]
    plans = candidate_plans(source.n_layers, shapes)
    tokenizer = load_tokenizer(folder)
    check_vocab(tokenizer, int(source.config["vocab_size"]))
    seq_len = args.seq_len or (load_config(args.config).training.seq_len if args.config else 1024)
    rows = math.ceil(args.tokens / seq_len)
    batch_size = min(args.batch_size, rows)
    num_batches = math.ceil(rows / batch_size)
    check_rows(seq_len, batch_size, source.config, DTYPES[args.dtype], device)
    out = output_folder(args)
    batches = list(
        heldout_batches(
            tokenizer,
            seq_len=seq_len,
            batch_size=batch_size,
            num_batches=num_batches,
            data=args.data,
            text_field=args.text_field,
            config=args.config,
            data_format=args.data_format,
        )
    )
    data = args.data or f"{args.config} (validation split)"
    out.mkdir(parents=True, exist_ok=True)  # before the work: an unwritable folder fails now
    print(
        f"{args.source}: {source.architecture}, {source.n_layers} layers; calibration {data}: "
        f"{num_batches} batches x {batch_size} rows x {seq_len} tokens "
        f"(the rows of python -m titan_recur.eval loss --batches {num_batches} --batch-size {batch_size} "
        f"--seq-len {seq_len})"
    )
    report = analyze(
        source,
        args.source,
        batches,
        device=device,
        dtype=DTYPES[args.dtype],
        plans=plans,
        measure=args.measure,
        recurrences=args.recurrences,
        seed=args.seed,
        progress=sys.stderr.isatty(),
    )
    report.update(data=data, seq_len=seq_len, batch_size=batch_size, batches=num_batches, dtype=args.dtype)
    plots = write_results(report, out)
    print(format_report(report, args.top))
    print(f"wrote {out / JSON_NAME}, {plots[0]} and {plots[1]}")


def write_results(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """layer_analysis.json and the two plots, all or none (write_files_atomically): a full disk left an empty
    layer_analysis.json, which the rerun refused without --force. The plots are drawn in a temporary folder."""
    plots = (out / INFLUENCE_PLOT, out / ANGULAR_PLOT)
    with tempfile.TemporaryDirectory(prefix=".plots.", dir=out) as tmp:
        try:
            drawn = plot_report(report, Path(tmp))
        except OSError as err:
            raise_naming(err, out)
        write_files_atomically(
            {
                out / JSON_NAME: lambda path: path.write_text(json.dumps(report, indent=2) + "\n"),
                **{plot: drawing.replace for plot, drawing in zip(plots, drawn, strict=True)},  # moved in
            }
        )
    return plots


def main(argv: list[str] | None = None) -> int:
    """Any OSError (missing files, an unwritable or full --out) is bad input here: nothing is left written."""
    return run_command(PROG, lambda: run(argv), bad_input=(*BAD_INPUT, OSError))


if __name__ == "__main__":
    sys.exit(main())
