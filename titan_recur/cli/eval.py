"""``python -m titan_recur.eval {loss,heldout,harness,lm_eval} ...``: validation loss vs r, lm-eval-harness tasks vs r.

Examples:
  python -m titan_recur.eval loss --checkpoint outputs/debug/final_model --data assets/corpus/math.jsonl \\
      --recurrences 1,2,4,8 --batches 4 --batch-size 4 --seq-len 128 --out outputs/eval/loss
  python -m titan_recur.eval loss --checkpoint outputs/debug/checkpoints/step-40 \\
      --model-config assets/tiny_llama_recurrent --config TRAIN.toml --out outputs/eval/loss  # its validation split
  python -m titan_recur.eval heldout --config TRAIN.toml --documents 1000 --out held_out.jsonl
  python -m titan_recur.eval harness --model_args pretrained=PATH,batch_size=16 \\
      --tasks gsm8k_cot_recur --recurrences 1,4,32 --out outputs/eval/gsm8k
  python -m titan_recur.eval harness --model_args pretrained=PATH,kv_sharing=latest,exit_criterion=kl \\
      --tasks gsm8k_cot_recur --recurrences 32 --exit-thresholds 1e-2,1e-3,1e-4 --out outputs/eval/gsm8k_exit
  python -m titan_recur.eval lm_eval run --model titan_recur --model_args pretrained=PATH,num_steps=32 \\
      --tasks gsm8k_cot_recur --include_path tasks       # lm_eval's own CLI, the model registered
(outputs/debug: the debug run, made by `python -m titan_recur.train --config train_configs/debug_model.toml`.)

Errors are one line on stderr: exit code 2 for bad input, 1 when the results cannot be written (a full
disk; nothing of them is left).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_recur.cli.kit import (
    OneLineParser,
    add_checkpoint_arguments,
    add_force,
    add_record_arguments,
    float_list,
    int_list,
    run_command,
)
from titan_recur.config import ATTENTION_MASKS, TEXT_SOURCE_KINDS
from titan_recur.inference.exit_criteria import describe_criteria
from titan_recur.models.args import STATE_INITS
from titan_recur.storage.model_io import check_output_files
from titan_recur.utils.limits import (
    check_allocation,
    check_at_least,
    check_recurrences,
    check_seq_len,
    forward_bytes,
)

PROG = "python -m titan_recur.eval"
DEFAULT_RECURRENCES = "1,2,4,8,16,32"
DATA_BATCH_SIZE, DATA_SEQ_LEN = 8, 1024
# --data-ranks reads the data once per rank (each rank's loader keeps every N-th document): 4096 is far past the
# paper runs' 64 ranks, and a typo (1000000000) is refused instead of reading until killed.
MAX_DATA_RANKS = 4096


def check_out(out: Path, files: list[str], force: bool, is_own, kind: str) -> None:
    """Before any work: --out must be a folder (or not exist), and its ``files`` not exist (with --force: be
    this command's own earlier output)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    check_output_files([out / name for name in files], force, is_own, kind)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    add_loss_parser(commands)
    add_heldout_parser(commands)
    add_harness_parser(commands)
    commands.add_parser(
        "lm_eval",
        add_help=False,
        help="lm_eval's own command line (all its options), with --model titan_recur registered",
    )
    return parser


def add_loss_parser(commands: argparse._SubParsersAction) -> None:
    loss = commands.add_parser("loss", help="held-out loss at each test recurrence: JSON + PNG plot")
    add_checkpoint_arguments(loss)
    data = loss.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="held-out file or glob: .jsonl/.json, .parquet, else plain text; read once")
    data.add_argument(
        "--config",
        help="train config TOML (or a run's config.json): its validation split, with "
        "the in-loop validation's geometry as defaults",
    )
    add_record_arguments(loss)
    loss.add_argument(
        "--recurrences",
        type=int_list,
        default=int_list(DEFAULT_RECURRENCES),
        help=f"test recurrences (default {DEFAULT_RECURRENCES})",
    )
    loss.add_argument(
        "--batches",
        type=int,
        help="batches per rank (default: --config's validation.steps; with --data every document, once)",
    )
    loss.add_argument(
        "--batch-size",
        type=int,
        help=f"rows per batch (default: --config's training.local_batch_size, else {DATA_BATCH_SIZE})",
    )
    loss.add_argument(
        "--seq-len", type=int, help=f"tokens per row (default: --config's training.seq_len, else {DATA_SEQ_LEN})"
    )
    loss.add_argument(
        "--data-ranks",
        type=int,
        default=1,
        help="read the rows the in-loop validation reads on this many data-parallel ranks (default 1)",
    )
    loss.add_argument(
        "--attention-mask",
        choices=ATTENTION_MASKS,
        help="'document': each packed document attends only to itself (default: --config's "
        "training.attention_mask, else causal)",
    )
    loss.add_argument("--out", required=True, type=Path, help="output folder for validation_loss.{json,png}")
    add_force(loss, "validation_loss.{json,png}")
    _add_model_options(loss)


def add_heldout_parser(commands: argparse._SubParsersAction) -> None:
    heldout = commands.add_parser("heldout", help="write held-out documents as jsonl (for eval loss --data)")
    source = heldout.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="train config TOML (or a run's config.json): its validation split")
    source.add_argument("--data", help="any source, read whole: a file/glob, or a hub dataset id with --kind hf")
    heldout.add_argument(
        "--kind",
        default=None,
        choices=TEXT_SOURCE_KINDS,
        help="format of --data (default: from the file suffix)",
    )
    heldout.add_argument("--hf-config", help="hub dataset config of --data")
    heldout.add_argument("--split", default="train", help="split of --data (default train)")
    add_record_arguments(heldout, "records of --data, written in the same format")
    heldout.add_argument("--documents", type=int, required=True, help="number of documents to write")
    heldout.add_argument("--out", required=True, type=Path, help='jsonl file to write ({"text": ...} per line)')
    add_force(heldout, "the jsonl file")


def add_harness_parser(commands: argparse._SubParsersAction) -> None:
    harness = commands.add_parser("harness", help="lm-eval-harness tasks at each test recurrence, one model load")
    harness.add_argument(
        "--model-args",
        "--model_args",
        required=True,
        help="titan_recur model args, e.g. pretrained=PATH,batch_size=16,max_gen_toks=256; "
        f"generation depth: kv_sharing=full|latest|compress-N, exit_criterion={describe_criteria('|')}, "
        "exit_threshold, min_steps, check_every (docs/generation.md)",
    )
    harness.add_argument("--tasks", required=True, help="comma-separated task names, globs or YAML files")
    harness.add_argument(
        "--recurrences",
        type=int_list,
        help="test recurrences (default: num_steps of model_args, else the model's mean_recurrence)",
    )
    harness.add_argument(
        "--exit-thresholds",
        type=float_list,
        help="also sweep these adaptive-exit thresholds (needs exit_criterion in --model-args)",
    )
    harness.add_argument(
        "--include-path",
        "--include_path",
        action="append",
        default=[],
        help="extra task folder (repeatable); the project's tasks/ is always included",
    )
    harness.add_argument(
        "--num-fewshot", "--num_fewshot", type=int, help="override the tasks' number of few-shot examples"
    )
    harness.add_argument("--limit", type=float, help="examples per task (a fraction if < 1); for testing only")
    harness.add_argument("--log-samples", "--log_samples", action="store_true", help="also write per-sample outputs")
    harness.add_argument(
        "--out",
        required=True,
        type=Path,
        help="output folder for results_r*.json, table.{json,md}, compute_curve.png and "
        "accuracy_vs_r.png (without --exit-thresholds)",
    )
    add_force(harness, "the results and tables")


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype (default float32)"
    )
    parser.add_argument(
        "--state-init",
        choices=STATE_INITS,
        help="initial recurrent state (default: deterministic, zero; 'embed' models keep embed)",
    )


def run_loss(args: argparse.Namespace) -> None:
    from titan_recur.eval.loading import (
        checkpoint_model_args,
        checkpoint_tokenizer,
        load_checkpoint,
        resolve_device,
    )
    from titan_recur.eval.sweep import (
        JSON_NAME,
        PLOT_NAME,
        heldout_batches,
        is_loss_report,
        loss_sweep,
        rows_settings,
        write_report,
    )

    recurrences = check_recurrences(args.recurrences)
    check_out(args.out, [JSON_NAME, PLOT_NAME], args.force, is_loss_report, "an eval loss report")
    for name in ("seq_len", "batches", "batch_size", "data_ranks"):
        check_at_least(getattr(args, name), f"--{name.replace('_', '-')}")
    if args.data_ranks > MAX_DATA_RANKS:
        raise ValueError(
            f"--data-ranks {args.data_ranks} is above {MAX_DATA_RANKS} (the data-parallel ranks a run has)"
        )
    settings, in_loop = rows_settings(
        args.config,
        args.batches,
        args.batch_size,
        args.seq_len,
        args.data_ranks,
        DATA_BATCH_SIZE,
        DATA_SEQ_LEN,
        args.attention_mask,
    )
    device = resolve_device(args.device)
    model_args = checkpoint_model_args(args.checkpoint, args.model_config)
    check_rows(settings, model_args, args.dtype, device)
    tokenizer = checkpoint_tokenizer(args.checkpoint, args.model_config, args.tokenizer, model_args.vocab_size)
    model = load_checkpoint(
        args.checkpoint, args.model_config, device=device, dtype=args.dtype, unverified=args.unverified
    )
    batches = heldout_batches(
        tokenizer,
        seq_len=settings["seq_len"],
        batch_size=settings["batch_size"],
        num_batches=settings["batches"],
        data=args.data,
        text_field=args.text_field,
        config=args.config,
        ranks=settings["data_ranks"],
        data_format=args.data_format,
        attention_mask=settings["attention_mask"],
    )
    most = None if settings["batches"] is None else settings["batches"] * settings["data_ranks"]
    report = loss_sweep(model, batches, recurrences, device, args.state_init, num_batches=most)
    report.update(
        checkpoint=str(args.checkpoint),
        data=args.data or f"{args.config} (validation split)",
        dtype=args.dtype,
        **settings,
        in_loop_validation=in_loop,
    )
    json_path, plot_path = write_report(report, args.out, title=str(args.checkpoint))
    print_loss_summary(report, recurrences, in_loop, args.config, most)
    print(f"wrote {json_path} and {plot_path}")


def print_loss_summary(
    report: dict, recurrences: list[int], in_loop: dict | None, config: str | None, asked: int | None
) -> None:
    """The loss at each r, the rows scored, the in-loop validation they match, and a warning when the data gave
    fewer than the ``asked`` batches."""
    for r in recurrences:
        print(f"r={r:<4d} loss {report['loss'][str(r)]:.4f}")
    print(describe_rows(report))
    if in_loop is not None:
        print(
            f"in-loop validation of {config}: {in_loop['batches']} batches x {in_loop['batch_size']} rows x "
            f"{in_loop['seq_len']} tokens on each rank, r in {in_loop['recurrences']}, every "
            f"{in_loop['interval']} steps ({'on' if in_loop['enable'] else 'off'}); the same rows with "
            f"--data-ranks <the run's ranks>"
        )
    if asked is not None and report["batches_read"] < asked:
        print(
            f"python -m titan_recur.eval loss: warning: the data gave {report['batches_read']} batches of the "
            f"{asked} asked (every document read once)",
            file=sys.stderr,
        )


def check_rows(settings: dict, model_args, dtype: str, device) -> None:
    """The rows fit the model's positions, and a batch's forward (with the weights) the device's free memory."""
    from titan_recur.storage.model_io import DTYPES

    check_seq_len(settings["seq_len"], model_args.max_seq_len)
    element = DTYPES[dtype].itemsize
    weights = model_args.vocab_size * model_args.dim * 2 + (
        model_args.n_prelude + model_args.n_core + model_args.n_coda
    ) * (4 * model_args.dim * model_args.n_heads * model_args.head_dim + 3 * model_args.dim * model_args.ffn_dim)
    batch = forward_bytes(settings["batch_size"], settings["seq_len"], model_args.dim, model_args.ffn_dim, element)
    check_allocation(
        weights * element + batch,
        device,
        f"a batch of {settings['batch_size']} x {settings['seq_len']} tokens with the model",
        hint="lower --batch-size or --seq-len",
    )


def describe_rows(report: dict) -> str:
    """What was evaluated: the real counts, and the geometry asked for."""
    asked = "all" if report["batches"] is None else report["batches"]
    return (
        f"evaluated {report['tokens']:,} labelled tokens: {report['batches_read']} batches, {report['rows_read']} "
        f"rows (asked: {asked} batches x {report['batch_size']} rows x {report['seq_len']} tokens per rank, "
        f"{report['data_ranks']} rank(s), {report['attention_mask']} attention)"
    )


def run_heldout(args: argparse.Namespace) -> None:
    from titan_recur.config import Data, DataSource, load_config
    from titan_recur.data.loader import heldout_documents
    from titan_recur.eval.sweep import data_source, is_documents_file, write_documents

    check_at_least(args.documents, "--documents")
    check_output_files([args.out], args.force, is_documents_file, "a held-out jsonl file")
    if args.config:
        data, what = load_config(args.config).data, f"the validation split of {args.config}"
    else:
        kind = args.kind or data_source(args.data).sources[0].kind
        source = DataSource(
            name=args.data,
            path=args.data,
            kind=kind,
            text_field=args.text_field,
            hf_config=args.hf_config,
            split=args.split,
            format=args.data_format,
        )
        data, what = Data(validation_sources=[source]), args.data
    written = write_documents(heldout_documents(data), args.out, args.documents)
    if written < args.documents:
        print(
            f"python -m titan_recur.eval heldout: warning: {what} has {written} documents, {args.documents} asked",
            file=sys.stderr,
        )
    print(f"wrote {written} documents of {what} to {args.out}")


def run_harness(args: argparse.Namespace) -> None:
    try:
        from lm_eval.utils import simple_parse_args_string
    except ImportError:
        raise ImportError("the harness needs lm-eval-harness: pip install -e '.[eval]'") from None
    from titan_recur.eval.harness import (
        CURVE_PNG,
        TABLE_JSON,
        TABLE_MD,
        check_task_data,
        check_tasks,
        harness_sweep,
        is_harness_output,
        markdown_table,
        plot_accuracy,
        results_table,
        task_manager,
        write_results,
    )
    from titan_recur.eval.lm_eval_model import TitanRecurLM

    check_out(args.out, [TABLE_JSON, TABLE_MD, CURVE_PNG], args.force, is_harness_output, "an eval harness result")
    model_args = simple_parse_args_string(args.model_args)
    check_harness_model(model_args)  # the model first: a typo in its path is one line, not a dataset search
    if args.recurrences:  # else the model's num_steps
        check_recurrences(args.recurrences)
    tasks = [t for t in args.tasks.split(",") if t]
    index = task_manager(tasks, args.include_path)
    tasks = check_tasks(tasks, index)  # before the (slow) model load
    check_task_data(tasks, index)  # each task's dataset, before the model load too
    try:
        lm = TitanRecurLM(**model_args)
    except TypeError as err:  # an unknown key in --model_args
        raise ValueError(f"bad --model_args {args.model_args!r}: {err}") from None
    results = harness_sweep(
        lm,
        tasks,
        args.recurrences or [lm.num_steps],
        index,
        exit_thresholds=args.exit_thresholds,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        log_samples=args.log_samples,
    )
    table_json, table_md = write_results(results, args.out)
    figures = [args.out / CURVE_PNG]
    if not args.exit_thresholds:  # settings are plain recurrences
        figures.append(plot_accuracy(results_table(results), [int(s) for s in results], args.out))
    print(markdown_table(results_table(results), list(results)), end="")
    print(f"wrote {table_json}, {table_md}, " + " and ".join(map(str, figures)))


def check_harness_model(model_args: dict) -> None:
    """pretrained= names a loadable checkpoint (and num_steps= a bounded depth, tokenizer= a tokenizer of its
    vocabulary), read without the weights."""
    from titan_recur.eval.loading import checkpoint_model_args, checkpoint_tokenizer

    if "pretrained" not in model_args:
        raise ValueError("--model-args needs pretrained=PATH (a model folder or a DCP step folder)")
    architecture = checkpoint_model_args(model_args["pretrained"], model_args.get("model_config"))
    if "tokenizer" in model_args:
        checkpoint_tokenizer(
            model_args["pretrained"],
            model_args.get("model_config"),
            model_args["tokenizer"],
            architecture.vocab_size,
            "tokenizer=",
        )
    if "num_steps" in model_args:
        check_recurrences([int(model_args["num_steps"])], "num_steps")


def run_lm_eval(argv: list[str]) -> None:
    """lm_eval 0.4.13 discovers no plugins: register the model, then hand the arguments to lm_eval's CLI."""
    from lm_eval.__main__ import cli_evaluate

    import titan_recur.eval.lm_eval_model  # noqa: F401  (registers "titan_recur")

    saved, sys.argv = sys.argv, ["lm_eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm_eval"]:
        run_lm_eval(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    run = {"loss": run_loss, "heldout": run_heldout, "harness": run_harness}[args.command]
    return run_command(f"{PROG} {args.command}", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
