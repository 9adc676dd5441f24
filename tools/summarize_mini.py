"""Summarize tools/reproduce_mini.sh's comparison: accuracy per chain length over seeds, and the headline plots.

    python tools/summarize_mini.py OUT/compare/compare.json --task OUT/task/task.json --out OUT/summary [--long 7-12]
        [--train OUT/task/train.jsonl]

Reads compare.json (tools/compare.py; tasks named <prefix>_<length>, as tools/make_depth_task.py
writes them), the task's task.json (questions per length, the extrapolation lengths) and its
eval_<length>.jsonl beside it, and --train, the training file the models saw (default: train.jsonl beside
task.json): per length, how many evaluation questions occur in it (held out: none), counted here, since
another question set's task.json speaks of its own training file. Writes into --out:
  summary.json   per arm (the seeds of an arm together: recurrent_s0, recurrent_s1, ... form "recurrent",
                 static_x2_s0, ... form "static_x2") and point: accuracy per length, the means over the
                 long, short and extrapolation lengths, the answer-only held-out loss, training FLOPs;
                 every accuracy as the mean over the seeds, their min and max, and the 95% Wilson
                 interval of the pooled questions (questions x lengths x seeds)
  summary.csv    one line per arm, point, r and length group: what the tables show, for other tools
  summary.md     the tables of docs/results.md
  long_vs_r.png  long-chain accuracy vs test r: recurrent mean with its interval, static arms as lines
  long_vs_flops.png  long-chain accuracy vs training FLOPs (paper convention): every evaluated point
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from make_depth_task import format_lengths, parse_lengths  # a sibling: tools/ is sys.path[0] for a script

from titan_recur.cli.kit import OneLineParser
from titan_recur.eval.comparison import PREFERRED_METRICS
from titan_recur.utils.plots import pyplot, save_figure

_LENGTH = re.compile(r"_(\d+)$")


def task_lengths(report: dict[str, Any]) -> dict[str, int]:
    """{task name: chain length} from the names the report's tasks carry."""
    names = {
        task
        for run in report["runs"]
        for point in run["points"]
        for entry in point["results"].values()
        for task in entry.get("tasks", {})
    }
    lengths = {name: int(m.group(1)) for name in names if (m := _LENGTH.search(name))}
    if not lengths:
        raise ValueError("no task named <prefix>_<length> in the report (tools/make_depth_task.py's tasks)")
    return lengths


def accuracy(scores: dict[str, float]) -> float:
    return next(scores[m] for m in (*PREFERRED_METRICS, *scores) if m in scores)


def point_cells(entry: dict[str, Any], lengths: dict[str, int], groups: dict[str, set[int]]) -> dict[str, Any]:
    """One model at one r: accuracy per length, the mean of each length group, the loss."""
    per_length = {lengths[t]: accuracy(s) for t, s in entry.get("tasks", {}).items() if t in lengths}
    cells: dict[str, Any] = {"per_length": dict(sorted(per_length.items())), "loss": entry.get("loss")}
    for group, members in groups.items():
        values = [a for n, a in per_length.items() if n in members]
        cells[group] = (statistics.fmean(values), len(values)) if values else None
    return cells


_SEED = re.compile(r"_s\d+$")


def run_kind(run: dict[str, Any]) -> str:
    """Seeds of one arm share a kind: 'recurrent', or the static arm's label without its seed (static_x1, ...)."""
    return "recurrent" if run["recurrent"] else _SEED.sub("", run["label"])


def wilson(successes: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (sound near 0 and 1, where the normal one is not)."""
    p = successes / trials
    center = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, center - half), min(1.0, center + half)


def spread(values: list[float], questions: int | None = None) -> dict[str, Any]:
    """Mean, min and max over seeds; with ``questions`` (per seed), the Wilson interval of the pooled count."""
    cell: dict[str, Any] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}
    if questions:
        trials = questions * len(values)
        cell["questions"] = trials
        cell["low"], cell["high"] = wilson(round(cell["mean"] * trials), trials)
    return cell


def length_groups(lengths: dict[str, int], long: range, task: dict[str, Any]) -> dict[str, set[int]]:
    """The long, extrapolation and short lengths among those the report evaluated: long, the --long lengths
    within the training range; short, the lengths below them (a length above them is in no group)."""
    evaluated = set(lengths.values())
    extrapolation = set(task.get("extrapolation_lengths") or []) & evaluated
    in_range = evaluated - extrapolation
    long_set = set(long) & in_range
    if not long_set:
        raise ValueError(
            f"--long {format_lengths(list(long))} names no length the report evaluated within the training range "
            f"({format_lengths(sorted(in_range))}); lengths beyond training, {format_lengths(sorted(extrapolation))}, "
            "are reported on their own"
        )
    return {"long": long_set, "extrapolation": extrapolation, "short": {n for n in in_range if n < min(long_set)}}


def questions_in_training(task_folder: Path, lengths: set[int], train: Path) -> dict[int, int]:
    """Per evaluated length, how many of its evaluation questions (eval_<length>.jsonl beside task.json) occur in
    the training file: a set's own held-out claim is about its own training file, not the one the models saw."""
    seen = set(prompts(train))
    counts = {}
    for n in sorted(lengths):
        path = task_folder / f"eval_{n}.jsonl"
        if not path.is_file():
            raise ValueError(f"{path}: no such file (the evaluation questions of length {n}, beside task.json)")
        counts[n] = sum(prompt in seen for prompt in prompts(path))
    return counts


def prompts(path: Path) -> list[str]:
    """The "prompt" of each record of a jsonl file of tools/make_depth_task.py (a bad line: ValueError)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not all(isinstance(row, dict) and "prompt" in row for row in rows):
        raise ValueError(f"{path}: a record without a 'prompt' field (tools/make_depth_task.py writes one per record)")
    return [row["prompt"] for row in rows]


def summarize(
    report: dict[str, Any], long: range, task: dict[str, Any], in_training: dict[int, int], train_file: str
) -> dict[str, Any]:
    lengths = task_lengths(report)
    groups = length_groups(lengths, long, task)
    per_question = int(task["eval_examples"])
    kinds: dict[str, list[dict[str, Any]]] = {}
    for run in report["runs"]:
        kinds.setdefault(run_kind(run), []).append(run)
    out: dict[str, Any] = {
        "recurrences": report["recurrences"],
        "long_lengths": [min(groups["long"]), max(groups["long"])],
        "groups": {group: sorted(members) for group, members in groups.items()},
        "train_file": train_file,
        "in_training": {str(n): count for n, count in in_training.items()},
        "held_out_lengths": [n for n, count in in_training.items() if count == 0],
        "not_held_out_lengths": [n for n, count in in_training.items() if count],
        "questions_per_length": per_question,
        "chance": 1 / int(task.get("states") or task.get("modulus") or 1),
        "arms": {},
    }
    for kind, runs in kinds.items():
        points = []
        for index in range(min(len(run["points"]) for run in runs)):  # the same checkpoints in every seed
            per_seed = [run["points"][index] for run in runs]
            cells = {}
            for r in report["recurrences"] if runs[0]["recurrent"] else report["recurrences"][:1]:
                seeds = [point_cells(p["results"][str(r)], lengths, groups) for p in per_seed]
                cell: dict[str, Any] = {
                    group: spread([s[group][0] for s in seeds], per_question * seeds[0][group][1])
                    for group in groups
                    if all(s[group] is not None for s in seeds)
                }
                if all(s["loss"] is not None for s in seeds):
                    cell["loss"] = spread([s["loss"] for s in seeds])
                cell["per_length"] = {
                    n: spread([s["per_length"][n] for s in seeds], per_question) for n in seeds[0]["per_length"]
                }
                cells[str(r)] = cell
            points.append({"step": per_seed[0]["step"], "flops": per_seed[0]["flops"], "results": cells})
        out["arms"][kind] = {
            "recurrent": runs[0]["recurrent"],
            "seeds": len(runs),
            "runs": [run["label"] for run in runs],
            "points": points,
            "train_mean_recurrence": runs[0]["train_mean_recurrence"],
        }
    out["flops_to_reach"] = flops_to_reach(out)
    return out


TARGETS = (0.5, 0.7, 0.8, 0.9, 0.95)


def flops_to_reach(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per target long-chain accuracy: the fewest training FLOPs (paper convention) at which any evaluated point
    of the recurrent arms (at the smallest r that reaches it) and of the static arms (halfway checkpoints
    included) reaches it."""
    best: dict[str, dict[str, Any]] = {}
    for target in TARGETS:
        row: dict[str, Any] = {}
        for family in ("recurrent", "static"):
            reached = [
                (point["flops"]["paper"], kind, point["step"], int(r))
                for kind, arm in summary["arms"].items()
                if arm["recurrent"] == (family == "recurrent")
                for point in arm["points"]
                for r, cell in point["results"].items()
                if "long" in cell and cell["long"]["mean"] >= target
            ]
            first = min(reached, default=None)
            row[family] = None if first is None else dict(zip(("flops", "arm", "step", "r"), first, strict=True))
        best[f"{target:g}"] = row
    return best


def fmt(cell: dict[str, Any] | None) -> str:
    """An accuracy as mean [95% Wilson interval]; a loss as mean (min-max over seeds)."""
    if cell is None:
        return ""
    if "low" in cell:
        return f"{cell['mean']:.3f} [{cell['low']:.2f}, {cell['high']:.2f}]"
    if cell["n"] == 1 or cell["min"] == cell["max"]:
        return f"{cell['mean']:.2f}"
    return f"{cell['mean']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})"


def static_arms(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, a) for k, a in summary["arms"].items() if not a["recurrent"]]


GROUP_TITLES = {
    "long": "Accuracy on the long chains ({lengths} operators)",
    "extrapolation": "Accuracy beyond every training length ({lengths} operators)",
    "short": "Accuracy on the short chains ({lengths} operators)",
    "loss": "Answer-only held-out loss",
}


def lengths_phrase(lengths: list[int]) -> str:
    """'no length', 'length 7' or 'lengths 5-8, 10'."""
    if not lengths:
        return "no length"
    return f"{'length' if len(lengths) == 1 else 'lengths'} {format_lengths(lengths)}"


def held_out_line(summary: dict[str, Any]) -> str:
    """Which lengths' evaluation questions the training file holds none of, and how many it holds of the others."""
    per_question = summary["questions_per_length"]
    by_count: dict[int, list[int]] = {}
    for n, count in summary["in_training"].items():
        by_count.setdefault(count, []).append(int(n))
    line = (
        f"Evaluation questions checked against the training file {summary['train_file']}: held out (none in it) "
        f"at {lengths_phrase(by_count.pop(0, []))}"
    )
    if by_count:
        line += "; in it: " + "; ".join(
            f"{count} of {per_question} at {lengths_phrase(ns)}" for count, ns in sorted(by_count.items(), reverse=True)
        )
    return line + "."


def markdown(summary: dict[str, Any]) -> str:
    rec = summary["arms"].get("recurrent")
    lines = [
        "# The miniature reproduction",
        "",
        f"Accuracy cells: mean over seeds [95% Wilson interval of the pooled questions, {summary['questions_per_length']}"
        " per length per seed]; static arms do not loop, so their one value stands under r=1.",
        held_out_line(summary),
        "",
    ]
    for key in ("long", "extrapolation", "short", "loss"):
        members = summary["groups"].get(key)
        if key == "loss" or members:
            title = GROUP_TITLES[key].format(lengths=format_lengths(members) if members else "")
            lines += [f"## {title}", "", *group_table(summary, key), ""]
    if rec:
        lines += per_length_table(summary, rec) + training_table(summary) + flops_table(summary)
    return "\n".join(lines) + "\n"


def group_table(summary: dict[str, Any], key: str) -> list[str]:
    """One row per arm at its final point: the recurrent arm at every r, a static arm under r=1 (the README and
    docs/results.md quote these tables as written; a test compares them with the shipped summary.json)."""
    rs = summary["recurrences"]
    rows = ["| model | FLOPs (paper) | " + " | ".join(f"r={r}" for r in rs) + " |", "|---|---|" + "---|" * len(rs)]
    rec = summary["arms"].get("recurrent")
    if rec:
        final = rec["points"][-1]
        cells = [fmt(final["results"][str(r)].get(key)) for r in rs]
        rows.append(
            f"| recurrent, {rec['seeds']} seed(s) | {final['flops']['paper']:.3e} | " + " | ".join(cells) + " |"
        )
    for name, arm in static_arms(summary):
        final = arm["points"][-1]
        cells = [fmt(final["results"][str(rs[0])].get(key))] + [""] * (len(rs) - 1)
        label = f"{name} (static), {arm['seeds']} seed(s)"
        rows.append(f"| {label} | {final['flops']['paper']:.3e} | " + " | ".join(cells) + " |")
    return rows


def per_length_table(summary: dict[str, Any], rec: dict[str, Any]) -> list[str]:
    rs = summary["recurrences"]
    lengths = sorted(rec["points"][-1]["results"][str(rs[0])]["per_length"])
    lines = [
        "## Accuracy per chain length (final models, mean over seeds)",
        "",
        "| model | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]

    def row(label: str, cells: dict[Any, Any]) -> str:
        return f"| {label} | " + " | ".join(f"{cells[n]['mean']:.2f}" if n in cells else "" for n in lengths) + " |"

    for r in rs:
        lines.append(row(f"recurrent r={r}", rec["points"][-1]["results"][str(r)]["per_length"]))
    for name, arm in static_arms(summary):
        lines.append(row(name, arm["points"][-1]["results"][str(rs[0])]["per_length"]))
    return [*lines, ""]


def training_table(summary: dict[str, Any]) -> list[str]:
    rs = summary["recurrences"]
    lines = [
        "## Along training (long chains)",
        "",
        "| model | step | FLOPs (paper) | FLOPs (full) | " + " | ".join(f"r={r}" for r in rs) + " |",
        "|---|---|---|---|" + "---|" * len(rs),
    ]
    for name, arm in summary["arms"].items():
        for p in arm["points"]:
            cells = [fmt(p["results"][str(r)].get("long")) if str(r) in p["results"] else "" for r in rs]
            lines.append(
                f"| {name} | {p['step']} | {p['flops']['paper']:.3e} | {p['flops']['full']:.3e} | "
                + " | ".join(cells)
                + " |"
            )
    return [*lines, ""]


def flops_table(summary: dict[str, Any]) -> list[str]:
    lines = [
        "## Training FLOPs to reach a long-chain accuracy",
        "",
        "The first evaluated point (final or halfway checkpoint; the recurrent arm at any r) whose mean reaches it.",
        "",
        "| accuracy | recurrent: FLOPs (paper) | at | static: FLOPs (paper) | at | static / recurrent |",
        "|---|---|---|---|---|---|",
    ]
    for target, row in summary["flops_to_reach"].items():
        rec, static = row["recurrent"], row["static"]
        cells = []
        for hit in (rec, static):
            where = (
                "" if hit is None else f"{hit['arm']} step {hit['step']}" + (f", r={hit['r']}" if hit is rec else "")
            )
            cells += ["not reached" if hit is None else f"{hit['flops']:.3e}", where]
        ratio = f"{static['flops'] / rec['flops']:.1f}x" if rec and static else ""
        lines.append(f"| {target} | " + " | ".join(cells) + f" | {ratio} |")
    return [*lines, ""]


def csv_rows(summary: dict[str, Any]) -> str:
    """Every table cell as one line: arm, step, FLOPs, r, the length group (or one length), mean, min, max, interval."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    fields = ("mean", "min", "max", "low", "high", "questions")
    writer.writerow(["arm", "step", "flops_paper", "flops_full", "r", "group", *fields])
    for name, arm in summary["arms"].items():
        for point in arm["points"]:
            for r, cell in point["results"].items():
                entries = [(group, cell[group]) for group in (*summary["groups"], "loss") if group in cell]
                entries += [(f"length_{n}", c) for n, c in cell["per_length"].items()]
                for group, values in entries:
                    writer.writerow(
                        [name, point["step"], point["flops"]["paper"], point["flops"]["full"], r, group]
                        + [values.get(f, "") for f in fields]
                    )
    return out.getvalue()


def plot_vs_r(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rs, long = summary["recurrences"], summary["long_lengths"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    rec = summary["arms"].get("recurrent")
    if rec:
        final = rec["points"][-1]["results"]
        groups = [("long", format_lengths(summary["groups"]["long"]))]
        if summary["groups"].get("extrapolation"):
            groups.append(("extrapolation", f"{format_lengths(summary['groups']['extrapolation'])}, beyond training"))
        for group, lengths in groups:
            cells = [final[str(r)][group] for r in rs]
            ax.plot(
                rs,
                [c["mean"] for c in cells],
                marker="o",
                linestyle="-" if group == "long" else ":",
                label=f"recurrent, chains of {lengths} (train mean r {rec['train_mean_recurrence']}, {rec['seeds']} seed(s))",
            )
            ax.fill_between(rs, [c["low"] for c in cells], [c["high"] for c in cells], alpha=0.2)
    styles = iter(["--", "-.", ":", (0, (5, 1))])
    for name, arm in static_arms(summary):
        value = arm["points"][-1]["results"][str(rs[0])]["long"]["mean"]
        ax.axhline(value, color="black", linestyle=next(styles, "--"), label=f"static: {name}")
    ax.axhline(summary["chance"], color="grey", linewidth=0.8, label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rs, [str(r) for r in rs])
    save_accuracy_figure(fig, ax, "test recurrence r", long, path)


def plot_vs_flops(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rs, long = summary["recurrences"], summary["long_lengths"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    rec = summary["arms"].get("recurrent")
    if rec:
        colors = plt.get_cmap("viridis")([i / max(len(rs) - 1, 1) for i in range(len(rs))])
        for color, r in zip(colors, rs, strict=True):
            ax.plot(
                [p["flops"]["paper"] for p in rec["points"]],
                [p["results"][str(r)]["long"]["mean"] for p in rec["points"]],
                marker="o",
                color=color,
                label=f"recurrent r={r}",
            )
    for name, arm in static_arms(summary):
        ax.plot(
            [p["flops"]["paper"] for p in arm["points"]],
            [p["results"][str(rs[0])]["long"]["mean"] for p in arm["points"]],
            marker="x",
            markersize=9,
            color="black",
            linestyle="--",
            label=f"static: {name}",
        )
    ax.set_xscale("log")
    save_accuracy_figure(fig, ax, "training FLOPs (paper convention)", long, path)


def save_accuracy_figure(fig: Any, ax: Any, xlabel: str, long: list[int], path: Path) -> None:
    """The two headline plots' shared axes: long-chain exact match in [0, 1]."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"exact match, chains of {long[0]}-{long[1]}")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog="summarize_mini.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("report", type=Path, help="compare.json of tools/compare.py")
    p.add_argument("--task", type=Path, required=True, help="task.json of tools/make_depth_task.py")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument(
        "--long",
        type=parse_lengths,
        default=parse_lengths("7-12"),
        help="the long chain lengths, longer than the source's training (default 7-12)",
    )
    p.add_argument(
        "--train",
        type=Path,
        default=None,
        help="the training file the models saw, to count the evaluation questions in it (default: train.jsonl "
        "beside task.json)",
    )
    ns = p.parse_args(argv)
    train = ns.train or ns.task.parent / "train.jsonl"
    for path in (ns.report, ns.task, train):
        if not path.is_file():
            p.error(f"{path}: no such file")
    try:
        report = json.loads(ns.report.read_text())
        lengths = set(task_lengths(report).values())
        in_training = questions_in_training(ns.task.parent, lengths, train)
        summary = summarize(report, ns.long, json.loads(ns.task.read_text()), in_training, str(train))
    except ValueError as err:
        p.error(str(err))
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (ns.out / "summary.csv").write_text(csv_rows(summary))
    text = markdown(summary)
    (ns.out / "summary.md").write_text(text)
    plot_vs_r(summary, ns.out / "long_vs_r.png")
    plot_vs_flops(summary, ns.out / "long_vs_flops.png")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
