"""Export a titan_recur checkpoint as a Hugging Face model folder.

Examples:
  python tools/export_hf.py outputs/debug/final_model out/debug_hf
  python tools/export_hf.py outputs/run/checkpoints/step-50000 out/run_hf --model-config out/tinyllama_4_8_4
  python tools/export_hf.py out/tinyllama_static out/tinyllama_static_hf      # static: a plain LlamaForCausalLM
(outputs/debug/final_model: the debug run's model, made by `python -m titan_recur.train --config train_configs/debug_model.toml`.)

A recurrent model loads with
  model = AutoModelForCausalLM.from_pretrained(OUTPUT, trust_remote_code=True)
  model(ids, num_steps=32); model.generate(ids, num_steps=32)
and works with the `lm_eval --model hf ...` command the tool prints (docs/hf.md). The folder
ships its own modeling code (titan_recur's, inlined): titan_recur need not be installed to use it.
A static baseline (no recurrent core) is exported as the source family's plain HF model. The model card
(README.md) describes the model, its source and layer map, the training run it comes from (when the
checkpoint is in a run's folder), the --eval-table results, limits and the citation.
Errors are one line, exit code 2, and nothing is written; a full disk is one line, exit code 1, and nothing is
written; a failed upload (login, network) is one line, exit code 1, and keeps the export.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titan_recur.cli.kit import IO_FAILURE, OneLineParser, run_command
from titan_recur.eval.loading import (
    DTYPES,
    checkpoint_model_args,
    checkpoint_tokenizer,
    default_tokenizer_folder,
    load_checkpoint,
)
from titan_recur.hf.export import (
    GENERATION_CONFIG_FILE,
    HubUploadError,
    check_repo_id,
    export_hf,
    lm_eval_command,
    push_to_hub,
    training_run,
)
from titan_recur.models.args import STATE_INITS

PROG = "titan-recur-export"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "checkpoint", help="titan_recur model folder (config.json + model.safetensors) or DCP step folder"
    )
    parser.add_argument("output", type=Path, help="output folder (must not exist or be empty, unless --force)")
    parser.add_argument("--model-config", help="model folder giving the architecture of a DCP step folder")
    parser.add_argument("--tokenizer", help="folder with the tokenizer files (default: the model folder)")
    parser.add_argument(
        "--mean-recurrence",
        type=int,
        help="default iterations of the export when no num_steps is given (default: the model's)",
    )
    parser.add_argument(
        "--state-init",
        choices=STATE_INITS,
        help="default initial state of the export (default: deterministic, zero; 'embed' models keep embed)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weights dtype (default float32)")
    parser.add_argument("--force", action="store_true", help="overwrite a previous export in OUTPUT")
    parser.add_argument(
        "--unverified",
        action="store_true",
        help="export a model folder or DCP step folder that has no manifest.json, its files unchecked (the export "
        "is sealed anew)",
    )
    parser.add_argument(
        "--eval-table",
        type=Path,
        help="a markdown results table for the model card (the table.md of python -m titan_recur.eval harness)",
    )
    parser.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help="then upload OUTPUT to the Hub repo OWNER/NAME (created if missing; needs a login)",
    )
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    return parser


def run(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.push_to_hub is not None:
        check_repo_id(args.push_to_hub)  # before anything is written
    eval_table = read_eval_table(args.eval_table) if args.eval_table is not None else None
    tokenizer_folder = args.tokenizer or default_tokenizer_folder(args.checkpoint, args.model_config)
    model_args = checkpoint_model_args(args.checkpoint, args.model_config)
    checkpoint_tokenizer(args.checkpoint, args.model_config, args.tokenizer, model_args.vocab_size)  # before weights
    model = load_checkpoint(args.checkpoint, args.model_config, unverified=args.unverified)
    export_hf(
        model,
        args.output,
        tokenizer_folder=tokenizer_folder,
        mean_recurrence=args.mean_recurrence,
        state_init=args.state_init,
        dtype=args.dtype,
        force=args.force,
        source=args.model_config or args.checkpoint,
        repo_id=args.push_to_hub,
        run=training_run(args.checkpoint),
        eval_table=eval_table,
    )
    kind = "recurrent (trust_remote_code)" if model.args.is_recurrent else "static"
    print(f"wrote {kind} HF model to {args.output}")
    eos_id = json.loads((args.output / GENERATION_CONFIG_FILE).read_text())["eos_token_id"]
    print(f"evaluate it as the project's harness does:\n  {lm_eval_command(args.output, eos_id)}")
    if args.push_to_hub is not None:
        print(f"uploaded to {push_to_hub(args.output, args.push_to_hub, private=args.private)}")


def read_eval_table(path: Path) -> str:
    """The --eval-table file's text: a markdown table (its first line starts with '|')."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--eval-table {path}: cannot read it ({type(err).__name__})") from None
    if not text.lstrip().startswith("|"):
        raise ValueError(f"--eval-table {path} is not a markdown table (eval harness writes one: table.md)")
    return text


def main(argv: list[str] | None = None) -> int:
    """A failed upload is an I/O failure (exit 1): the export stays written."""
    return run_command(PROG, lambda: run(argv), io_failure=(*IO_FAILURE, HubUploadError))


if __name__ == "__main__":
    sys.exit(main())
