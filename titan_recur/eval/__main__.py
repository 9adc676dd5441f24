"""``python -m titan_recur.eval {loss,harness,lm_eval} ...``: validation loss vs r, lm-eval-harness tasks vs r.

Examples:
  python -m titan_recur.eval loss --checkpoint outputs/debug/final_model --data assets/corpus/math.jsonl \\
      --recurrences 1,2,4,8 --batches 4 --batch-size 4 --seq-len 128 --out outputs/eval/loss
  python -m titan_recur.eval loss --checkpoint outputs/debug/checkpoints/step-40 \\
      --model-config assets/tiny_llama_recurrent --config TRAIN.toml --out outputs/eval/loss  # its validation split
  python -m titan_recur.eval harness --model_args pretrained=PATH,batch_size=16 \\
      --tasks gsm8k_cot_recur --recurrences 1,4,32 --out outputs/eval/gsm8k
  python -m titan_recur.eval lm_eval run --model titan_recur --model_args pretrained=PATH,num_steps=32 \\
      --tasks gsm8k_cot_recur --include_path tasks       # lm_eval's own CLI, the model registered

Errors are one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_recur.checkpoint import CheckpointError
from titan_recur.models.args import STATE_INITS
from titan_recur.resources import project_folder

DEFAULT_RECURRENCES = "1,2,4,8,16,32"
# The project's task configs (tasks/ of the checkout, or shipped in the wheel), always on the harness's include path.
PROJECT_TASKS = project_folder("tasks")


def parse_ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m titan_recur.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    loss = commands.add_parser("loss", help="held-out loss at each test recurrence: JSON + PNG plot")
    loss.add_argument("--checkpoint", required=True,
                      help="model folder (config.json + model.safetensors) or DCP step folder")
    loss.add_argument("--model-config", help="model folder giving the architecture of a DCP step folder")
    loss.add_argument("--tokenizer", help="folder with the tokenizer files (default: the model folder)")
    data = loss.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="held-out file or glob: .jsonl/.json, .parquet, else plain text")
    data.add_argument("--config", help="train config TOML: use its validation split (data.validation_fraction > 0)")
    loss.add_argument("--text-field", default="text", help="jsonl/parquet field holding the text (default: text)")
    loss.add_argument("--recurrences", type=parse_ints, default=parse_ints(DEFAULT_RECURRENCES),
                      help=f"test recurrences (default {DEFAULT_RECURRENCES})")
    loss.add_argument("--batches", type=int, default=10, help="number of batches (default 10)")
    loss.add_argument("--batch-size", type=int, default=8, help="rows per batch (default 8)")
    loss.add_argument("--seq-len", type=int, help="tokens per row (default: the config's training.seq_len, else 1024)")
    loss.add_argument("--out", required=True, type=Path, help="output folder for validation_loss.{json,png}")
    _add_model_options(loss)

    harness = commands.add_parser("harness", help="lm-eval-harness tasks at each test recurrence, one model load")
    harness.add_argument("--model-args", "--model_args", required=True,
                         help="titan_recur model args, e.g. pretrained=PATH,batch_size=16,max_gen_toks=256")
    harness.add_argument("--tasks", required=True, help="comma-separated task names, globs or YAML files")
    harness.add_argument("--recurrences", type=parse_ints, help="test recurrences (default: num_steps of model_args, "
                         "else the model's mean_recurrence)")
    harness.add_argument("--include-path", "--include_path", action="append", default=[],
                         help=f"extra task folder (repeatable); {PROJECT_TASKS} is always included")
    harness.add_argument("--num-fewshot", "--num_fewshot", type=int, help="override the tasks' number of few-shot examples")
    harness.add_argument("--limit", type=float, help="examples per task (a fraction if < 1); for testing only")
    harness.add_argument("--log-samples", "--log_samples", action="store_true", help="also write per-sample outputs")
    harness.add_argument("--out", required=True, type=Path,
                         help="output folder for results_r*.json and table.{json,md}")

    commands.add_parser("lm_eval", add_help=False,
                        help="lm_eval's own command line (all its options), with --model titan_recur registered")
    return parser


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model dtype (default float32)")
    parser.add_argument("--state-init", choices=STATE_INITS,
                        help="initial recurrent state (default: deterministic, zero; 'embed' models keep embed)")


def run_loss(args: argparse.Namespace) -> None:
    from titan_recur.config import load_config
    from titan_recur.eval.loading import default_tokenizer_folder, load_checkpoint, resolve_device
    from titan_recur.eval.loss import check_recurrences
    from titan_recur.eval.sweep import heldout_batches, loss_sweep, write_report
    from titan_recur.tokenizer import check_vocab, load_tokenizer

    recurrences = check_recurrences(args.recurrences)
    seq_len = args.seq_len or (load_config(args.config).training.seq_len if args.config else 1024)
    device = resolve_device(args.device)
    model = load_checkpoint(args.checkpoint, args.model_config, device=device, dtype=args.dtype)
    tokenizer = load_tokenizer(args.tokenizer or default_tokenizer_folder(args.checkpoint, args.model_config))
    check_vocab(tokenizer, model.args.vocab_size)
    batches = heldout_batches(
        tokenizer, seq_len=seq_len, batch_size=args.batch_size, num_batches=args.batches,
        data=args.data, text_field=args.text_field, config=args.config,
    )
    report = loss_sweep(model, batches, recurrences, device, args.state_init, num_batches=args.batches)
    report.update(checkpoint=str(args.checkpoint), data=args.data or f"{args.config} (validation split)",
                  seq_len=seq_len, batch_size=args.batch_size, batches=args.batches, dtype=args.dtype)
    json_path, plot_path = write_report(report, args.out, title=str(args.checkpoint))
    for r in recurrences:
        print(f"r={r:<4d} loss {report['loss'][str(r)]:.4f}")
    print(f"wrote {json_path} and {plot_path}")


def run_harness(args: argparse.Namespace) -> None:
    try:
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import simple_parse_args_string
    except ImportError:
        raise ImportError("the harness needs lm-eval-harness: pip install -e '.[eval]'") from None
    from titan_recur.eval.harness import check_tasks, harness_sweep, markdown_table, results_table, write_results
    from titan_recur.eval.lm_eval_model import TitanRecurLM

    task_manager = TaskManager(include_path=[str(p) for p in (PROJECT_TASKS, *args.include_path)])
    tasks = check_tasks([t for t in args.tasks.split(",") if t], task_manager)  # before the (slow) model load
    try:
        lm = TitanRecurLM(**simple_parse_args_string(args.model_args))
    except TypeError as err:  # an unknown key in --model_args
        raise ValueError(f"bad --model_args {args.model_args!r}: {err}") from None
    results = harness_sweep(
        lm, tasks, args.recurrences or [lm.num_steps], task_manager,
        num_fewshot=args.num_fewshot, limit=args.limit, log_samples=args.log_samples,
    )
    table_json, table_md = write_results(results, args.out)
    print(markdown_table(results_table(results), list(results)), end="")
    print(f"wrote {table_json} and {table_md}")


def run_lm_eval(argv: list[str]) -> None:
    """lm_eval 0.4.13 discovers no plugins: register the model, then hand the arguments to lm_eval's CLI."""
    import titan_recur.eval.lm_eval_model  # noqa: F401  (registers "titan_recur")
    from lm_eval.__main__ import cli_evaluate

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
    try:
        (run_loss if args.command == "loss" else run_harness)(args)
    except (ValueError, FileNotFoundError, ImportError, CheckpointError) as err:
        print(f"python -m titan_recur.eval {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
