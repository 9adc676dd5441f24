"""Summarize tools/reproduce_smollm2.sh: held-out loss and exact match by test recurrence, before and after healing.

    python tools/summarize_smollm2.py OUT --out OUT/summary

Reads the script's outputs under OUT (analysis/layer_analysis.json, eval/{source,converted}_loss,
eval/source_exact, compare/compare.json, flops_match.json, data/math_task/task.json, runs/*/metrics.jsonl,
eval/chat_check.json, timings.tsv) and writes into --out:
  summary.json   the source, the chosen surgery and its ranking, held-out loss of the source, of the
                 converted model before healing and of every healed arm by r (seeds as mean, min, max),
                 exact match by r with the 95% Wilson interval of the pooled questions, training FLOPs
                 in both conventions, the healing curves' last losses, the export's chat check
  summary.csv    one line per arm, r and quantity
  summary.md     the tables of docs/results.md's SmolLM2 section
  loss_vs_r.png  held-out loss vs test r: source, converted (before healing), healed recurrent, static
  exact_vs_r.png exact match on the held-out questions vs test r, with intervals
  healing.png    training loss vs tokens of every healing run
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

from summarize_mini import accuracy, spread, wilson  # a sibling: tools/ is sys.path[0] for a script

from titan_recur.cli.kit import OneLineParser
from titan_recur.utils.plots import pyplot, save_figure

_SEED = re.compile(r"_s\d+$")
TASK = "math_heldout"


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def surgery(analysis: dict[str, Any]) -> dict[str, Any]:
    """The measured candidates (as the script ranks them: lowest loss at the healing start first) and the source's layers."""
    measured = [c for c in analysis["candidates"]["ranked"] if "loss_identity_r1" in c]
    measured.sort(key=lambda c: c["loss_identity_r1"])
    keys = (
        "prelude",
        "core",
        "coda",
        "dropped",
        "angular_score",
        "angular_rank",
        "paper_placement",
        "loss_identity_r1",
    )
    return {
        "source_loss": analysis["source_loss"],
        "chosen": {k: measured[0][k] for k in keys},
        "measured": [{k: c[k] for k in keys} for c in measured],
        "candidates": analysis["candidates"]["total"],
        "most_redundant_spans": analysis["most_redundant_spans"][:10],
        "layer_drop_loss": [
            {"layer": layer["layer"], "drop_loss": layer.get("drop_loss")} for layer in analysis.get("layers", [])
        ],
    }


def arms(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by arm: recurrent_s0, recurrent_s1 -> recurrent; static_s0 -> static."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for run in report["runs"]:
        grouped.setdefault(_SEED.sub("", run["label"]), []).append(run)
    return grouped


def arm_cells(runs: list[dict[str, Any]], recurrences: list[int], questions: int) -> dict[str, Any]:
    """Loss and exact match of an arm's final models by r (a static arm: once)."""
    finals = [run["points"][-1] for run in runs]
    cells: dict[str, Any] = {}
    for r in recurrences if runs[0]["recurrent"] else recurrences[:1]:
        entries = [point["results"][str(r)] for point in finals]
        cells[str(r)] = {
            "loss": spread([e["loss"] for e in entries]),
            "exact": spread([accuracy(e["tasks"][TASK]) for e in entries], questions),
        }
    return {
        "seeds": len(runs),
        "recurrent": runs[0]["recurrent"],
        "steps": runs[0]["steps"],
        "tokens": runs[0]["steps"] * runs[0]["tokens_per_step"],
        "flops": runs[0]["flops"],
        "by_r": cells,
    }


def healing_curves(out: Path) -> dict[str, list[tuple[int, float]]]:
    curves = {}
    for metrics in sorted(out.glob("runs/*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        curves[metrics.parent.name] = [(row["tokens_seen"], row["loss"]) for row in rows if "loss" in row]
    return curves


def summarize(out: Path) -> dict[str, Any]:
    report = read_json(out / "compare" / "compare.json")
    task = read_json(out / "data" / "math_task" / "task.json")
    questions = int(task["questions"])
    source_exact = next(
        row for row in read_json(out / "eval" / "source_exact" / "table.json") if row["metric"] != "mean_iterations"
    )
    source_hits = round(source_exact["1"] * questions)
    flops = read_json(out / "flops_match.json")
    chat = out / "eval" / "chat_check.json"
    return {
        "source": {
            **read_json(out / "models" / "source" / "conversion.json").get("fetched", {}),
            "params": flops["params"]["total"],
        },
        "surgery": surgery(read_json(out / "analysis" / "layer_analysis.json")),
        "recurrences": report["recurrences"],
        "questions": task,
        "source_model": {
            "loss": read_json(out / "eval" / "source_loss" / "validation_loss.json")["loss"]["1"],
            "exact": {
                "mean": source_exact["1"],
                "questions": questions,
                **dict(zip(("low", "high"), wilson(source_hits, questions), strict=True)),
            },
        },
        "converted": {"loss": read_json(out / "eval" / "converted_loss" / "validation_loss.json")["loss"]},
        "matched_static_steps": flops["matched_steps"],
        "arms": {name: arm_cells(runs, report["recurrences"], questions) for name, runs in arms(report).items()},
        "healing_last_loss": {name: curve[-1][1] for name, curve in healing_curves(out).items() if curve},
        "chat_check": read_json(chat) if chat.is_file() else None,
        "timings_s": dict(line.split("\t") for line in (out / "timings.tsv").read_text().splitlines()[1:]),
    }


def _fmt(cell: dict[str, Any] | None, digits: int = 3) -> str:
    if not cell:
        return ""
    text = f"{cell['mean']:.{digits}f}"
    if "low" in cell:
        text += f" [{cell['low']:.2f}, {cell['high']:.2f}]"
    elif cell.get("n", 1) > 1:
        text += f" ({cell['min']:.{digits}f}-{cell['max']:.{digits}f})"
    return text


def markdown(summary: dict[str, Any]) -> str:
    rs = summary["recurrences"]
    header = "| model | tokens | FLOPs (paper) | FLOPs (full) | " + " | ".join(f"r={r}" for r in rs) + " |"
    rule = "|---" * (4 + len(rs)) + "|"
    src, conv = summary["source_model"], summary["converted"]["loss"]
    loss_rows = [
        f"| source (30 layers) | | | | {src['loss']:.3f} |" + " |" * (len(rs) - 1),
        "| converted, before healing | 0 | | | " + " | ".join(f"{conv[str(r)]:.3f}" for r in rs) + " |",
    ]
    exact_rows = [f"| source (30 layers) | | | | {_fmt(src['exact'])} |" + " |" * (len(rs) - 1)]
    for name, arm in summary["arms"].items():
        label = f"{name}, {arm['seeds']} seed(s), healed"
        lead = f"| {label} | {arm['tokens']:,} | {arm['flops']['paper']:.3e} | {arm['flops']['full']:.3e} | "
        loss_rows.append(lead + " | ".join(_fmt(arm["by_r"].get(str(r), {}).get("loss")) for r in rs) + " |")
        exact_rows.append(lead + " | ".join(_fmt(arm["by_r"].get(str(r), {}).get("exact")) for r in rs) + " |")
    chosen = summary["surgery"]["chosen"]
    lines = [
        "## Surgery",
        "",
        f"Kept: prelude {_span(chosen['prelude'])}, core {_span(chosen['core'])}, coda {_span(chosen['coda'])}; "
        f"dropped {_span(chosen['dropped'])}. Held-out loss at the healing start (identity adapter, r = 1): "
        f"{chosen['loss_identity_r1']:.3f} (source {summary['surgery']['source_loss']:.3f}).",
        "",
        "## Held-out loss (mean over seeds, (min-max))",
        "",
        header,
        rule,
        *loss_rows,
        "",
        f"## Exact match on {summary['questions']['questions']} held-out questions [95% Wilson interval]",
        "",
        header,
        rule,
        *exact_rows,
        "",
    ]
    return "\n".join(lines)


def _span(layers: list[int]) -> str:
    """0,1,2,5,6 -> 0-2, 5-6."""
    parts: list[str] = []
    for layer in layers:
        if parts and int(parts[-1].split("-")[-1]) == layer - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{layer}"
        else:
            parts.append(str(layer))
    return ", ".join(parts) or "none"


def rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out = [{"arm": "source", "r": 1, "quantity": "loss", "mean": summary["source_model"]["loss"]}]
    out.append({"arm": "source", "r": 1, "quantity": "exact", **summary["source_model"]["exact"]})
    out += [
        {"arm": "converted", "r": int(r), "quantity": "loss", "mean": v}
        for r, v in summary["converted"]["loss"].items()
    ]
    for name, arm in summary["arms"].items():
        for r, cell in arm["by_r"].items():
            out += [{"arm": name, "r": int(r), "quantity": q, **cell[q]} for q in ("loss", "exact")]
    return out


def write_csv(summary: dict[str, Any], path: Path) -> None:
    fields = ["arm", "r", "quantity", "mean", "min", "max", "n", "questions", "low", "high"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows(summary))
    path.write_text(buffer.getvalue())


def plot_vs_r(summary: dict[str, Any], quantity: str, path: Path, ylabel: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    rs = summary["recurrences"]
    source = summary["source_model"]["loss"] if quantity == "loss" else summary["source_model"]["exact"]["mean"]
    ax.axhline(source, color="black", linestyle=":", label="source (30 layers)")
    if quantity == "loss":
        ax.plot(
            rs,
            [summary["converted"]["loss"][str(r)] for r in rs],
            marker="s",
            color="gray",
            label="converted, before healing",
        )
    for name, arm in summary["arms"].items():
        if arm["recurrent"]:
            cells = [arm["by_r"][str(r)][quantity] for r in rs]
            ax.plot(rs, [c["mean"] for c in cells], marker="o", label=f"{name}, healed ({arm['seeds']} seeds)")
            low = [c.get("low", c["min"]) for c in cells]
            high = [c.get("high", c["max"]) for c in cells]
            ax.fill_between(rs, low, high, alpha=0.2)
        else:
            ax.axhline(
                arm["by_r"][str(rs[0])][quantity]["mean"], color="tab:red", linestyle="--", label=f"{name}, healed"
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(rs, [str(r) for r in rs])
    ax.set_xlabel("test recurrence r")
    ax.set_ylabel(ylabel)
    ax.set_title("SmolLM2-135M-Instruct retrofitted, healed on CPU", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_healing(out: Path, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    for name, curve in healing_curves(out).items():
        ax.plot([t for t, _ in curve], [loss for _, loss in curve], marker=".", label=name)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("training loss")
    ax.set_title("healing", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="summarize_smollm2.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path, help="the --out folder of tools/reproduce_smollm2.sh")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    args = parser.parse_args(argv)
    if not (args.run / "compare" / "compare.json").is_file():
        parser.error(f"{args.run}: no compare/compare.json (not a finished tools/reproduce_smollm2.sh output)")
    summary = summarize(args.run)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_csv(summary, args.out / "summary.csv")
    (args.out / "summary.md").write_text(markdown(summary))
    plot_vs_r(summary, "loss", args.out / "loss_vs_r.png", "held-out loss")
    plot_vs_r(summary, "exact", args.out / "exact_vs_r.png", "exact match, held-out questions")
    plot_healing(args.run, args.out / "healing.png")
    print(markdown(summary))
    print(f"wrote {args.out}/summary.json, summary.csv, summary.md, loss_vs_r.png, exact_vs_r.png, healing.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
