"""Summarize tools/reproduce_mini.sh's comparison: accuracy per chain length over seeds, and the headline plots.

    python tools/summarize_mini.py OUT/compare/compare.json --out OUT/summary [--long 7-12]

Reads compare.json (tools/compare.py; tasks named <prefix>_<length>, as tools/make_depth_task.py
writes them) and writes into --out:
  summary.json   per run kind (the recurrent seeds together; each static arm) and point: accuracy per
                 length, the mean over the long lengths and over the short ones, the answer-only
                 held-out loss, training FLOPs; recurrent cells as mean, min and max over the seeds
  summary.md     the tables of docs/results.md
  long_vs_r.png  long-chain accuracy vs test r: recurrent mean with its min-max band, static arms as lines
  long_vs_flops.png  long-chain accuracy vs training FLOPs (paper convention): every evaluated point
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from make_depth_task import parse_lengths  # a sibling: tools/ is sys.path[0] for a script

from titan_recur.eval.comparison import PREFERRED_METRICS
from titan_recur.utils.plots import pyplot, save_figure

_LENGTH = re.compile(r"_(\d+)$")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


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


def point_cells(entry: dict[str, Any], lengths: dict[str, int], long: range) -> dict[str, Any]:
    """One model at one r: accuracy per length, the long and short means, the loss."""
    per_length = {lengths[t]: accuracy(s) for t, s in entry.get("tasks", {}).items() if t in lengths}
    long_acc = [a for n, a in per_length.items() if n in long]
    short_acc = [a for n, a in per_length.items() if n not in long]
    return {
        "per_length": dict(sorted(per_length.items())),
        "long": statistics.fmean(long_acc) if long_acc else None,
        "short": statistics.fmean(short_acc) if short_acc else None,
        "loss": entry.get("loss"),
    }


def run_kind(run: dict[str, Any]) -> str:
    """Seeds of one arm share a kind: 'recurrent', or the static run's label (static_x1, ...)."""
    return "recurrent" if run["recurrent"] else run["label"]


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(report: dict[str, Any], long: range) -> dict[str, Any]:
    lengths = task_lengths(report)
    kinds: dict[str, list[dict[str, Any]]] = {}
    for run in report["runs"]:
        kinds.setdefault(run_kind(run), []).append(run)
    out: dict[str, Any] = {"recurrences": report["recurrences"], "long_lengths": [long[0], long[-1]], "arms": {}}
    for kind, runs in kinds.items():
        points = []
        for index in range(min(len(run["points"]) for run in runs)):  # the same checkpoints in every seed
            per_seed = [run["points"][index] for run in runs]
            cells = {}
            for r in report["recurrences"] if runs[0]["recurrent"] else report["recurrences"][:1]:
                seeds = [point_cells(p["results"][str(r)], lengths, long) for p in per_seed]
                cells[str(r)] = {
                    key: spread([s[key] for s in seeds])
                    for key in ("long", "short", "loss")
                    if all(s[key] is not None for s in seeds)
                } | {"per_length": {n: spread([s["per_length"][n] for s in seeds]) for n in seeds[0]["per_length"]}}
            points.append({"step": per_seed[0]["step"], "flops": per_seed[0]["flops"], "results": cells})
        out["arms"][kind] = {
            "recurrent": runs[0]["recurrent"],
            "seeds": len(runs),
            "points": points,
            "train_mean_recurrence": runs[0]["train_mean_recurrence"],
        }
    return out


def fmt(cell: dict[str, float] | None) -> str:
    if cell is None:
        return ""
    if cell["n"] == 1 or cell["min"] == cell["max"]:
        return f"{cell['mean']:.2f}"
    return f"{cell['mean']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})"


def static_arms(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, a) for k, a in summary["arms"].items() if not a["recurrent"]]


def markdown(summary: dict[str, Any]) -> str:
    rs, long = summary["recurrences"], summary["long_lengths"]
    rec = summary["arms"].get("recurrent")
    lines = ["# The miniature reproduction", ""]
    head = "| model | FLOPs (paper) | " + " | ".join(f"r={r}" for r in rs) + " |"
    rule = "|---|---|" + "---|" * len(rs)
    for key, title in (
        ("long", f"Accuracy on the long chains ({long[0]}-{long[1]} operators)"),
        ("short", "Accuracy on the short chains (the other lengths)"),
        ("loss", "Answer-only held-out loss"),
    ):
        rows = []
        if rec:
            final = rec["points"][-1]
            rows.append(
                f"| recurrent, {rec['seeds']} seed(s), mean (min-max) | {final['flops']['paper']:.3e} | "
                + " | ".join(fmt(final["results"][str(r)].get(key)) for r in rs)
                + " |"
            )
        for name, arm in static_arms(summary):
            final = arm["points"][-1]
            value = fmt(final["results"][str(rs[0])].get(key))
            rows.append(f"| {name} (static) | {final['flops']['paper']:.3e} | " + " | ".join([value] * len(rs)) + " |")
        if any(cell for row in rows for cell in row.split("|")[3:-1] if cell.strip()):
            lines += [f"## {title}", "", head, rule, *rows, ""]
    if rec:
        lengths = sorted(rec["points"][-1]["results"][str(rs[0])]["per_length"])
        lines += [
            "## Accuracy per chain length (final models)",
            "",
            "| model | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        for r in rs:
            cells = rec["points"][-1]["results"][str(r)]["per_length"]
            lines.append(f"| recurrent r={r} | " + " | ".join(fmt(cells.get(n)) for n in lengths) + " |")
        for name, arm in static_arms(summary):
            cells = arm["points"][-1]["results"][str(rs[0])]["per_length"]
            lines.append(f"| {name} | " + " | ".join(fmt(cells.get(n)) for n in lengths) + " |")
        lines += [
            "",
            "## Along training (long chains)",
            "",
            "| model | step | FLOPs (paper) | FLOPs (full) | " + " | ".join(f"r={r}" for r in rs) + " |",
            "|---|---|---|---|" + "---|" * len(rs),
        ]
        for name, arm in summary["arms"].items():
            for p in arm["points"]:
                cells = [fmt(p["results"].get(str(r), p["results"][str(rs[0])]).get("long")) for r in rs]
                lines.append(
                    f"| {name} | {p['step']} | {p['flops']['paper']:.3e} | {p['flops']['full']:.3e} | "
                    + " | ".join(cells)
                    + " |"
                )
    return "\n".join(lines) + "\n"


def plot_vs_r(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rs, long = summary["recurrences"], summary["long_lengths"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    rec = summary["arms"].get("recurrent")
    if rec:
        cells = [rec["points"][-1]["results"][str(r)]["long"] for r in rs]
        ax.plot(
            rs,
            [c["mean"] for c in cells],
            marker="o",
            label=f"recurrent (train mean r {rec['train_mean_recurrence']}), mean of {rec['seeds']} seed(s)",
        )
        ax.fill_between(rs, [c["min"] for c in cells], [c["max"] for c in cells], alpha=0.25)
    styles = iter(["--", "-.", ":", (0, (5, 1))])
    for name, arm in static_arms(summary):
        value = arm["points"][-1]["results"][str(rs[0])]["long"]["mean"]
        ax.axhline(value, color="black", linestyle=next(styles, "--"), label=f"static: {name}")
    ax.axhline(1 / 8, color="grey", linewidth=0.8, label="chance")
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
    p = Parser(prog="summarize_mini.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path, help="compare.json of tools/compare.py")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument(
        "--long",
        type=parse_lengths,
        default=parse_lengths("7-12"),
        help="the long chain lengths, longer than the source's training (default 7-12)",
    )
    ns = p.parse_args(argv)
    if not ns.report.is_file():
        p.error(f"{ns.report}: no such file")
    try:
        summary = summarize(json.loads(ns.report.read_text()), ns.long)
    except ValueError as err:
        p.error(str(err))
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (ns.out / "summary.md").write_text(text)
    plot_vs_r(summary, ns.out / "long_vs_r.png")
    plot_vs_flops(summary, ns.out / "long_vs_flops.png")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
