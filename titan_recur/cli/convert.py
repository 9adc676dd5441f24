"""Convert a pretrained HF Llama / OLMo-2 checkpoint into a depth-recurrent titan_recur model folder.

Examples:
  python tools/convert_hf.py TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T out/tinyllama_4_8_4 --shape 4,8,4
  python tools/convert_hf.py meta-llama/Llama-3.2-1B out/llama_2_4_2 --shape 2,4,2
  python tools/convert_hf.py assets/tiny_llama out/tiny --prelude 0-1 --core 4,5,6 --coda 7
  python tools/convert_hf.py assets/tiny_llama out/tiny_static --static          # plain stack, all layers
  python tools/convert_hf.py assets/tiny_llama out/tiny --shape 2,4,2 --dry-run  # print the plan only

Layers (pick one way):
  --shape P,R,C       prelude = first P layers, coda = last C, core = the R layers just before the
                      coda; the layers between prelude and core are dropped (TinyLlama 4,8,4: prelude
                      0-3, core 10-17, coda 18-21, dropped 4-9).
  --prelude/--core/--coda LIST
                      explicit source indices, e.g. 0-3 or 0,2,5-7, run in the order given; each layer
                      at most once; prelude and coda may be omitted (empty), the core may not.
  --static            a static (non-recurrent) model: the kept layers (all layers when no selection is
                      given, else those of --shape or the lists, in order) as one plain stack, stored
                      as the prelude with no core and no adapter. The baseline for the same trainer.

With --adapter-init identity (A = [0 | I]) and r = 1 the output computes exactly the source model
restricted to the kept layers. OUTPUT gets config.json, model.safetensors, the source's tokenizer
files and conversion.json (provenance). Errors are one line, exit code 2 (bad input) or 1 (the output
cannot be written: a full disk), and nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_recur.cli.kit import OneLineParser, run_command
from titan_recur.convert.surgery import (
    DTYPES,
    ConvertOptions,
    check_output,
    convert,
    format_summary,
    parse_layers,
    parse_shape,
    plan_layers,
    read_source,
    resolve_source,
)
from titan_recur.models.args import ADAPTER_INITS, STATE_INITS

PROG = "titan-recur-convert"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="local HF folder (config.json + safetensors) or a hub id (owner/name)")
    parser.add_argument("output", type=Path, help="output folder (must not exist or be empty, unless --force)")
    layers = parser.add_argument_group("layer selection")
    layers.add_argument("--shape", metavar="P,R,C", help="prelude, core, coda layer counts, e.g. 4,8,4")
    layers.add_argument("--prelude", metavar="LIST", help="source layers of the prelude, e.g. 0-3")
    layers.add_argument("--core", metavar="LIST", help="source layers of the recurrent core, e.g. 10-17")
    layers.add_argument("--coda", metavar="LIST", help="source layers of the coda, e.g. 18-21")
    layers.add_argument("--static", action="store_true", help="no recurrence: the kept layers as a plain stack")
    model = parser.add_argument_group("model options")
    model.add_argument(
        "--adapter-init",
        choices=ADAPTER_INITS,
        default="identity",
        help="identity: A = [0 | I], exact at r=1 (default); random: nn.Linear default init, seeded by --seed",
    )
    model.add_argument("--seed", type=int, default=0, help="seed of the random adapter init (default 0)")
    model.add_argument(
        "--state-init",
        choices=STATE_INITS,
        default="normal",
        help="initial recurrent state: truncated normal (default), zeros, or the prelude output",
    )
    model.add_argument(
        "--state-std",
        type=float,
        default=None,
        help="std of the normal state init; default sqrt(2/(5*dim)) (the reference used sqrt(2/(5*5280)) "
        "= 0.0087 for every model, an accident inherited from Huginn)",
    )
    tie = model.add_mutually_exclusive_group()
    tie.add_argument(
        "--tie-embeddings",
        dest="tie_embeddings",
        action="store_true",
        default=False,
        help="one matrix for embedding and LM head (an untied source must have equal matrices)",
    )
    tie.add_argument(
        "--untie-embeddings",
        dest="tie_embeddings",
        action="store_false",
        help="separate matrices (default; a tied source's matrix is copied into both, as the reference does)",
    )
    model.add_argument(
        "--mean-recurrence",
        type=int,
        default=ConvertOptions.mean_recurrence,
        help="eval depth written to the config, used when no depth is given "
        f"(default {ConvertOptions.mean_recurrence})",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights dtype of the output (default float32; source keeps the stored dtypes)",
    )
    parser.add_argument("--revision", help="hub revision (branch, tag or commit) when SOURCE is a hub id")
    parser.add_argument(
        "--force", action="store_true", help="overwrite an existing converted model folder (never any other folder)"
    )
    parser.add_argument("--dry-run", action="store_true", help="check everything and print the plan; write nothing")
    return parser


def run(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    prelude, core, coda = (
        None if value is None else parse_layers(value) for value in (args.prelude, args.core, args.coda)
    )
    shape = None if args.shape is None else parse_shape(args.shape)
    check_output(args.output, args.force)  # before any download
    folder = resolve_source(args.source, args.revision)
    source = read_source(folder)
    plan = plan_layers(source.n_layers, shape, prelude, core, coda, static=args.static)
    options = ConvertOptions(
        adapter_init=args.adapter_init,
        state_init=args.state_init,
        state_std=args.state_std,
        tie_embeddings=args.tie_embeddings,
        mean_recurrence=args.mean_recurrence,
        dtype=args.dtype,
        seed=args.seed,
    )
    model_args = convert(
        folder, args.output, plan, options, force=args.force, dry_run=args.dry_run, source_name=args.source
    )
    print(format_summary(source, model_args, args.source))
    print(f"dry run: nothing written to {args.output}" if args.dry_run else f"wrote {args.output}")


def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
