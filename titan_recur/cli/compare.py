"""Compare training runs (recurrent and static) at equal training compute: the paper's Fig 5-7 layout.

For each RUN_DIR (a trainer dump folder: config.json, metrics.jsonl, checkpoints/, final_model/) it
counts the training FLOPs from the run's config and progress (paper and full convention, as
tools/flops.py does), evaluates the final model (and with --checkpoints every checkpoint) at each
test recurrence r (held-out loss on --data, task scores through lm-eval-harness for --task), and
writes compare.json, compare.md and per quantity two PNGs: <name>_vs_r.png (score vs test r per
run, static runs as horizontal lines) and <name>_vs_flops.png (score vs training FLOPs, static runs
as crosses). A static run (no recurrent core) is evaluated once: r changes nothing for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from titan_recur.cli.kit import OneLineParser, int_list, run_command
from titan_recur.config import DATA_FORMATS
from titan_recur.utils.limits import check_at_least, check_recurrences, check_seq_len

if TYPE_CHECKING:
    from titan_recur.eval.comparison import EvalSettings, Run

PROG = "titan-recur-compare"
EPILOG = """\
examples:
  # a retrofitted run and its compute-matched static baseline, exact match on a task + held-out loss
  python tools/compare.py outputs/recurrent outputs/static --task gsm8k_cot_recur --data held_out.jsonl \\
      --recurrences 1,2,4,8,16,32 --out outputs/compare

  # every checkpoint too (accuracy along training), a local task file, 200 examples per task
  python tools/compare.py outputs/rec outputs/static --task outputs/task/perm_12.yaml --checkpoints \\
      --limit 200 --max-gen-toks 8 --out outputs/compare

  # every length of tools/make_depth_task.py --out outputs/task: its group file (tasks from its folder)
  python tools/compare.py outputs/rec outputs/static --task outputs/task/perm.yaml --max-gen-toks 2 \\
      --out outputs/compare

Errors are one line on stderr, exit code 2, before any model is loaded. An earlier result in --out is
replaced only with --force.
"""


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog=PROG,
        description=__doc__,
        epilog=EPILOG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="trainer dump folders (recurrent or static)")
    p.add_argument("--labels", help="comma-separated run names for tables and plots (default: folder names)")
    p.add_argument("--out", type=Path, default=Path("outputs/compare"), help="output folder (default outputs/compare)")
    p.add_argument(
        "--force", action="store_true", help="replace an earlier result in --out (never a file of another kind)"
    )
    p.add_argument(
        "--recurrences",
        type=int_list,
        default=int_list("1,2,4,8,16,32"),
        help="test recurrences (default 1,2,4,8,16,32)",
    )
    p.add_argument("--checkpoints", action="store_true", help="also evaluate every complete checkpoint")
    p.add_argument(
        "--world-size",
        type=int,
        help="data-parallel ranks of the runs (default: read from their "
        "checkpoints, else 1); sets the micro-steps per step of the full FLOP convention",
    )
    what = p.add_argument_group("what to measure (at least one)")
    what.add_argument(
        "--task", help="comma-separated lm-eval task names, globs or YAML files (a group file runs its tasks)"
    )
    what.add_argument(
        "--data",
        help="held-out file for the loss: .jsonl/.json, .parquet, else plain text; packed into rows as each run "
        "trained (its training.attention_mask)",
    )
    harness = p.add_argument_group("harness")
    harness.add_argument(
        "--metric",
        help="headline metric of the tasks, e.g. exact_match,flexible-extract "
        "(default: exact_match,flexible-extract, else acc,none, else the first)",
    )
    harness.add_argument("--limit", type=float, help="examples per task (a fraction if < 1)")
    harness.add_argument("--num-fewshot", type=int, help="override the tasks' number of few-shot examples")
    harness.add_argument("--batch-size", type=int, default=16, help="harness batch size (default 16)")
    harness.add_argument("--max-gen-toks", type=int, default=256, help="generation budget (default 256)")
    harness.add_argument("--include-path", action="append", default=[], help="extra task folder (repeatable)")
    loss = p.add_argument_group("loss")
    loss.add_argument("--text-field", default="text", help="jsonl/parquet field holding the text (default text)")
    loss.add_argument(
        "--format",
        dest="data_format",
        choices=DATA_FORMATS,
        default="text",
        help="--data records: 'text' (loss on every token) or 'prompt_completion' (fields prompt and "
        "completion: the loss on the completions only, e.g. a task's answers) (default text)",
    )
    loss.add_argument("--loss-batches", type=int, default=8, help="held-out batches (default 8)")
    loss.add_argument("--loss-batch-size", type=int, default=8, help="rows per batch (default 8)")
    loss.add_argument("--seq-len", type=int, help="tokens per row (default: each run's training.seq_len)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, ...")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="evaluate the models in this many processes, each with its share of the threads: the same "
        "report in about 1/N of the time on N cores (default 1)",
    )
    return p


def check_run_folder(folder: Path) -> None:
    """A model folder (or an HF export) given for a run: say what this command wants instead of a config parse error."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # read_run names the problem
    if isinstance(config, dict) and ("architectures" in config or "titan_recur" in config):
        raise ValueError(
            f"{folder} is a model folder (its config.json describes a model), not a training run: {PROG} wants "
            "run folders (a trainer's job.dump_folder: config.json of the run, metrics.jsonl, checkpoints/, "
            "final_model/); to evaluate a model folder use python -m titan_recur.eval loss/harness"
        )


def check_seq_len_fits(runs: Sequence[Run], seq_len: int) -> None:
    """--seq-len rows fit the positions of every run's model."""
    for run in runs:
        try:
            check_seq_len(seq_len, run.flops.args.max_seq_len)
        except ValueError as err:
            raise ValueError(f"{run.folder}: {err}") from None


def progress_bar(total: int):
    """A tqdm bar over models x r on a terminal; silent otherwise."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="models x r", unit="eval", disable=not sys.stderr.isatty())
    return lambda: bar.update()


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return run_command(PROG, lambda: run(ns))


def run(ns: argparse.Namespace) -> None:
    """Check every input before any model is loaded, evaluate the runs, write and print the report."""
    from titan_recur.eval.comparison import compare, read_run, task_manager, write_report

    labels = ns.labels.split(",") if ns.labels else [None] * len(ns.runs)
    check_arguments(ns, labels)
    runs = [
        read_run(folder, world_size=ns.world_size, label=label, checkpoints=ns.checkpoints)
        for folder, label in zip(ns.runs, labels, strict=True)
    ]
    if ns.seq_len is not None:
        check_seq_len_fits(runs, ns.seq_len)
    settings = eval_settings(ns)
    tasks_index = None
    if settings.tasks:
        from titan_recur.eval.harness import check_tasks

        tasks_index = task_manager(settings)
        check_tasks(settings.tasks, tasks_index)
    report = compare(runs, settings, progress=progress_bar, tasks_index=tasks_index, workers=ns.workers)
    written = write_report(report, ns.out, ns.metric)
    print((ns.out / "compare.md").read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in written))


def check_arguments(ns: argparse.Namespace, labels: list) -> None:
    """The flags and run folders, before any run is read."""
    from titan_recur.eval.comparison import check_out

    check_out(ns.out, ns.force)
    if len(labels) != len(ns.runs):
        raise ValueError(f"--labels names {len(labels)} runs, {len(ns.runs)} given")
    if ns.data and not Path(ns.data).is_file():
        raise ValueError(f"--data {ns.data}: no such file")
    if min(ns.batch_size, ns.max_gen_toks, ns.loss_batches, ns.loss_batch_size) < 1:
        raise ValueError("--batch-size, --max-gen-toks, --loss-batches, --loss-batch-size must be >= 1")
    check_at_least(ns.seq_len, "--seq-len")
    check_recurrences(ns.recurrences)
    check_at_least(ns.workers, "--workers")
    if ns.world_size is not None and ns.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {ns.world_size}")
    for folder in ns.runs:
        check_run_folder(Path(folder))


def eval_settings(ns: argparse.Namespace) -> EvalSettings:
    """What to measure on every model; something to measure, and task files that exist."""
    from titan_recur.eval.comparison import EvalSettings

    settings = EvalSettings(
        recurrences=ns.recurrences,
        tasks=[t for t in (ns.task or "").split(",") if t],
        data=ns.data,
        text_field=ns.text_field,
        data_format=ns.data_format,
        loss_batches=ns.loss_batches,
        loss_batch_size=ns.loss_batch_size,
        seq_len=ns.seq_len,
        batch_size=ns.batch_size,
        max_gen_toks=ns.max_gen_toks,
        limit=ns.limit,
        num_fewshot=ns.num_fewshot,
        include_path=ns.include_path,
        device=ns.device,
    )
    if not settings.tasks and settings.data is None:
        raise ValueError("nothing to measure: give --task and/or --data")
    missing = [t for t in settings.tasks if t.endswith((".yaml", ".yml")) and not Path(t).is_file()]
    if missing:
        raise ValueError(f"--task {','.join(missing)}: no such task file")
    return settings


if __name__ == "__main__":
    sys.exit(main())
