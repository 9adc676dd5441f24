"""lm-eval-harness sweep over test recurrences: one model load, one ``simple_evaluate`` per r, a task x r table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable

from titan_recur.eval.lm_eval_model import TitanRecurLM
from titan_recur.eval.loss import check_recurrences
from titan_recur.plots import figure_vs_r, save_figure

TABLE_JSON, TABLE_MD, ACCURACY_PNG = "table.json", "table.md", "accuracy_vs_r.png"


def check_tasks(tasks: Sequence[str], task_manager: TaskManager) -> list[str]:
    """The tasks, each a known task/group/tag name, glob of names, or YAML file; unknown names fail here."""
    unknown = [t for t in tasks if not (task_manager.match_tasks([t]) or Path(t).is_file())]
    if not tasks or unknown:
        raise ValueError(
            f"unknown task(s) {unknown or list(tasks)}: not in lm_eval's task index or the --include_path folders "
            "(list them with `lm_eval ls tasks`)"
        )
    return list(tasks)


def check_task_data(tasks: Sequence[str], task_manager: TaskManager) -> None:
    """Build each task, which loads its dataset, so that data that cannot be had fails before the model loads.

    Offline (HF_DATASETS_OFFLINE=1, or no network) a dataset that is not in the local cache raises
    here; docs/evaluation.md shows how to cache the tasks once. lm_eval caches what it loads, so the
    sweep's own loads are cheap.
    """
    failures = []
    for task in tasks:
        try:
            task_manager.load([task])
        except Exception as err:  # datasets/hub raise many types: name the task and the cause
            cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
            failures.append(f"{task} ({type(err).__name__}: {cause})")
    if failures:
        raise ValueError(
            f"cannot load the data of task(s) {'; '.join(failures)}; without network, cache the datasets first "
            "(docs/evaluation.md, 'Offline')"
        )


def harness_sweep(
    lm: TitanRecurLM,
    tasks: Sequence[str],
    recurrences: Sequence[int],
    task_manager: TaskManager,
    **evaluate_kwargs: Any,
) -> dict[int, dict[str, Any]]:
    """{r: lm_eval results} for each test recurrence, the same loaded model throughout.

    evaluate_kwargs go to ``lm_eval.simple_evaluate`` (num_fewshot, limit, log_samples, ...); its
    seeds are reset on every call, so each r sees the same few-shot examples.
    """
    recurrences = check_recurrences(recurrences)
    tasks = check_tasks(tasks, task_manager)
    results = {}
    for r in recurrences:
        lm.num_steps = r
        results[r] = simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager, **evaluate_kwargs)
    return results


def results_table(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows {task, metric, r: value, ...}: every "metric,filter" value (stderr left out) of every task and group."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r, result in results.items():
        for task, metrics in {**result["results"], **result.get("groups", {})}.items():
            for metric, value in metrics.items():
                if "," in metric and "_stderr" not in metric and isinstance(value, (int, float)):
                    rows.setdefault((task, metric), {"task": task, "metric": metric})[str(r)] = value
    return [rows[key] for key in sorted(rows)]


def markdown_table(rows: list[dict[str, Any]], recurrences: Sequence[int]) -> str:
    header = "| task | metric | " + " | ".join(f"r={r}" for r in recurrences) + " |"
    lines = [header, "|" + "---|" * (len(recurrences) + 2)]
    for row in rows:
        values = [f"{row[str(r)]:.4f}" if str(r) in row else "" for r in recurrences]
        lines.append(f"| {row['task']} | {row['metric']} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def plot_accuracy(rows: list[dict[str, Any]], recurrences: Sequence[int], out: str | Path) -> Path:
    """accuracy_vs_r.png: every (task, metric) whose values are fractions in [0, 1], vs r."""
    series = {
        f"{row['task']} {row['metric']}": {r: row[str(r)] for r in recurrences if str(r) in row}
        for row in rows
        if all(0 <= row[str(r)] <= 1 for r in recurrences if str(r) in row)
    }
    title = "lm-eval-harness accuracy vs test recurrence"
    return save_figure(figure_vs_r(series, "accuracy", title), Path(out) / ACCURACY_PNG)


def write_results(results: dict[int, dict[str, Any]], out: str | Path) -> tuple[Path, Path]:
    """results_r{r}.json (samples, if logged, in samples_r{r}.json), table.json and table.md into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for r, result in results.items():
        result = dict(result)
        samples = result.pop("samples", None)
        _dump(result, out / f"results_r{r}.json")
        if samples is not None:
            _dump(samples, out / f"samples_r{r}.json")
    rows = results_table(results)
    _dump(rows, out / TABLE_JSON)
    (out / TABLE_MD).write_text(markdown_table(rows, list(results)))
    return out / TABLE_JSON, out / TABLE_MD


def _dump(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, default=handle_non_serializable) + "\n")
