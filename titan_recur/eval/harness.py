"""lm-eval-harness sweep over test-time depth: one model load, one ``simple_evaluate`` per setting (a test
recurrence r, and optionally an adaptive-exit threshold), a task x setting table with the mean core
iterations per generated token, and the test-time compute curve (accuracy vs mean iterations)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable

from titan_recur.eval.lm_eval_model import TitanRecurLM
from titan_recur.utils.limits import check_recurrences
from titan_recur.utils.plots import figure_vs_r, pyplot, save_figure
from titan_recur.utils.resources import project_folder

TABLE_JSON, TABLE_MD = "table.json", "table.md"
ACCURACY_PNG, CURVE_PNG = "accuracy_vs_r.png", "compute_curve.png"
# The table's metric name of the mean core iterations per generated token (r for tasks that only score).
# The project's task configs (tasks/ of the checkout, or shipped in the wheel), always on the include path.
PROJECT_TASKS = project_folder("tasks")
ITERATIONS = "mean_iterations"


def is_harness_output(path: Path) -> bool:
    """A file ``eval harness`` writes: its table.json (a list of rows), table.md (a markdown table) or a PNG."""
    try:
        if path.suffix == ".png":
            return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        text = path.read_text()
        return isinstance(json.loads(text), list) if path.suffix == ".json" else text.startswith("|")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


class _TaskFileLoader(yaml.SafeLoader):
    """Reads any file lm_eval reads: !function and other tags become None."""


_TaskFileLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def is_task_file(task: str) -> bool:
    return task.endswith((".yaml", ".yml")) and Path(task).is_file()


def task_manager(tasks: Sequence[str], include_path: Sequence[str], include_defaults: bool = True) -> TaskManager:
    """The harness task index of every command: the project's tasks/, the folders of the YAML-file tasks and the
    extra include paths (with lm_eval's own tasks unless ``include_defaults`` is False)."""
    folders = [str(PROJECT_TASKS), *task_folders(tasks), *map(str, include_path)]
    return TaskManager(include_path=folders, include_defaults=include_defaults)


def task_folders(tasks: Sequence[str]) -> list[str]:
    """The folders of the YAML-file tasks: a task manager indexes them, so a group file's member tasks resolve."""
    return sorted({str(Path(t).resolve().parent) for t in tasks if is_task_file(t)})


def group_name(task: str) -> str | None:
    """The ``group:`` a YAML file declares, else None.

    lm_eval loads a group file given as a path under its task list instead of its name (a crash in
    TaskManager.load), so a group file is run by its name from its folder's index (task_folders).
    """
    if not is_task_file(task):
        return None
    try:
        config = yaml.load(Path(task).read_text(), Loader=_TaskFileLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"task file {task}: {str(err).splitlines()[0]}") from None
    name = config.get("group") if isinstance(config, dict) and "class" not in config else None
    return name if isinstance(name, str) else None


def check_tasks(tasks: Sequence[str], task_manager: TaskManager) -> list[str]:
    """The tasks to run, each a known task/group/tag name, glob of names, or YAML file (a group file by its
    name, its folder indexed: task_folders); unknown names fail here."""
    resolved = [group_name(t) or t for t in tasks]
    unknown = [
        task
        for task, name in zip(tasks, resolved, strict=True)
        if not (task_manager.match_tasks([name]) or (name == task and is_task_file(task)))
    ]
    if not tasks or unknown:
        raise ValueError(
            f"unknown task(s) {unknown or list(tasks)}: not in lm_eval's task index or the --include_path folders "
            "(list them with `lm_eval ls tasks`)"
        )
    return resolved


def setting_label(r: int, exit_threshold: float | None) -> str:
    """A setting's key in the results and the table: "r", or "r@threshold" in a threshold sweep."""
    return str(r) if exit_threshold is None else f"{r}@{exit_threshold:g}"


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
    exit_thresholds: Sequence[float] | None = None,
    **evaluate_kwargs: Any,
) -> dict[str, dict[str, Any]]:
    """{setting label: lm_eval results} for each test recurrence (x each exit threshold), one loaded model.

    Each result also holds, under "titan_recur", the setting and the mean core iterations per generated
    token of every task. Every setting is checked before the first runs. evaluate_kwargs go to
    ``lm_eval.simple_evaluate`` (num_fewshot, limit, log_samples, ...); its seeds are reset on every
    call, so each setting sees the same few-shot examples.
    """
    recurrences = check_recurrences(recurrences)
    tasks = check_tasks(tasks, task_manager)
    if exit_thresholds and lm.generation.exit_criterion is None:
        raise ValueError("exit thresholds to sweep need exit_criterion in the model args")
    thresholds: Sequence[float | None] = exit_thresholds or [None]
    settings = [(r, t) for r in recurrences for t in thresholds]
    for r, t in settings:
        _apply(lm, r, t)
    results = {}
    for r, t in settings:
        _apply(lm, r, t)
        lm.reset_depth_stats()
        result = simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager, **evaluate_kwargs)
        result["titan_recur"] = {
            "num_steps": r,
            "kv_sharing": lm.generation.kv_sharing,
            "exit_criterion": lm.generation.exit_criterion,
            "exit_threshold": lm.exit_threshold,
            ITERATIONS: {task: lm.mean_iterations(task) for task in result["results"]},
        }
        results[setting_label(r, t)] = result
    return results


def _apply(lm: TitanRecurLM, r: int, exit_threshold: float | None) -> None:
    lm.num_steps = r
    if exit_threshold is not None:
        lm.exit_threshold = exit_threshold


def results_table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows {task, metric, setting: value, ...}: every "metric,filter" value (stderr left out) of every task
    and group, and per task the mean core iterations per generated token (metric ITERATIONS)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for setting, result in results.items():
        for task, metrics in {**result["results"], **result.get("groups", {})}.items():
            for metric, value in metrics.items():
                if "," in metric and "_stderr" not in metric and isinstance(value, (int, float)):
                    rows.setdefault((task, metric), {"task": task, "metric": metric})[str(setting)] = value
        for task, iterations in result.get("titan_recur", {}).get(ITERATIONS, {}).items():
            rows.setdefault((task, ITERATIONS), {"task": task, "metric": ITERATIONS})[str(setting)] = iterations
    return [rows[key] for key in sorted(rows)]


def markdown_table(rows: list[dict[str, Any]], settings: Sequence[str | int]) -> str:
    header = "| task | metric | " + " | ".join(f"r={s}" for s in settings) + " |"
    lines = [header, "|" + "---|" * (len(settings) + 2)]
    for row in rows:
        values = [f"{row[str(s)]:.4f}" if str(s) in row else "" for s in settings]
        lines.append(f"| {row['task']} | {row['metric']} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def plot_compute_curve(rows: list[dict[str, Any]], settings: Sequence[str], out: str | Path) -> Path:
    """compute_curve.png, the test-time compute curve: each task metric vs the task's mean core iterations
    per generated token."""
    plt = pyplot()
    iterations = {row["task"]: row for row in rows if row["metric"] == ITERATIONS}
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for row in rows:
        if row["metric"] == ITERATIONS or row["task"] not in iterations:
            continue
        points = sorted((iterations[row["task"]][s], row[s]) for s in map(str, settings) if s in row)
        ax.plot(*zip(*points, strict=True), marker="o", label=f"{row['task']} {row['metric']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("mean core iterations per generated token")
    ax.set_ylabel("score")
    ax.set_title("test-time compute curve", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, Path(out) / CURVE_PNG)


def plot_accuracy(rows: list[dict[str, Any]], recurrences: Sequence[int], out: str | Path) -> Path:
    """accuracy_vs_r.png: every (task, metric) whose values are fractions in [0, 1], vs r."""
    series = {
        f"{row['task']} {row['metric']}": {r: row[str(r)] for r in recurrences if str(r) in row}
        for row in rows
        if row["metric"] != ITERATIONS and all(0 <= row[str(r)] <= 1 for r in recurrences if str(r) in row)
    }
    title = "lm-eval-harness accuracy vs test recurrence"
    return save_figure(figure_vs_r(series, "accuracy", title), Path(out) / ACCURACY_PNG)


def write_results(results: dict[str, dict[str, Any]], out: str | Path) -> tuple[Path, Path]:
    """results_r{setting}.json (samples, if logged, in samples_r{setting}.json), table.json, table.md and
    compute_curve.png into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for setting, result in results.items():
        result = dict(result)
        samples = result.pop("samples", None)
        _dump(result, out / f"results_r{setting}.json")
        if samples is not None:
            _dump(samples, out / f"samples_r{setting}.json")
    rows = results_table(results)
    _dump(rows, out / TABLE_JSON)
    (out / TABLE_MD).write_text(markdown_table(rows, list(results)))
    plot_compute_curve(rows, list(results), out)
    return out / TABLE_JSON, out / TABLE_MD


def _dump(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, default=handle_non_serializable) + "\n")
