"""Compute-matched comparison of training runs: training FLOPs against accuracy and loss at each test r.

A run is a trainer dump folder (config.json, metrics.jsonl, checkpoints/step-N, final_model/). Its
training FLOPs come from its saved config and progress through ``titan_recur.training.cost_model`` (the paper's and
the full convention, exactly as tools/flops.py counts them); its models (the final one and, on
request, every checkpoint) are evaluated at each test recurrence r: held-out loss through
``titan_recur.eval.sweep`` and task scores through the lm-eval-harness sweep. A static run (no
recurrent core) computes the same thing at every r, so it is evaluated once and drawn as a baseline.
``tools/compare.py`` is the command line.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from titan_recur.config import FINAL_MODEL_FOLDER, DataFormat, JobConfig, load_config
from titan_recur.storage.checkpoint import read_metadata, scan_checkpoints
from titan_recur.storage.model_io import check_output_files, read_model_args
from titan_recur.training.cost_model import CONVENTIONS, TrainingRun, config_training_run
from titan_recur.training.recurrence import RecurrenceSchedule
from titan_recur.utils.plots import figure_vs_r, pyplot, save_figure

CONFIG_NAME, METRICS_NAME = "config.json", "metrics.jsonl"
JSON_NAME, MARKDOWN_NAME = "compare.json", "compare.md"
MARKDOWN_TITLE = "# Compute-matched comparison"
# Headline metric of a task when --metric is not given: the first of these the task reports.
PREFERRED_METRICS = ("exact_match,flexible-extract", "exact_match,strict-match", "exact_match,none", "acc,none")
_RANK_ENTRY = re.compile(r"^rng\.rank_(\d+)")  # the trainer's per-rank RNG state: one entry per rank


@dataclass
class EvalPoint:
    """One model of a run to evaluate: the final export or a DCP step folder (architecture from model_config)."""

    step: int
    path: Path
    model_config: Path | None = None


@dataclass
class Run:
    """A training run as found on disk, with its FLOP account."""

    folder: Path
    label: str
    config: JobConfig
    flops: TrainingRun
    world_size: int
    step: int
    points: list[EvalPoint] = field(default_factory=list)

    @property
    def recurrent(self) -> bool:
        return self.flops.args.is_recurrent

    def training_flops(self, step: int) -> dict[str, float]:
        """Cumulative training FLOPs after ``step`` optimizer steps, in both conventions."""
        return {c: self.flops.cumulative_flops(step, c) for c in CONVENTIONS}


def checkpoint_world_size(step_folder: Path) -> int:
    """Ranks that wrote a DCP step folder of the trainer: each saves its own RNG state entry."""
    keys = read_metadata(step_folder).state_dict_metadata
    ranks = {m.group(1) for key in keys if (m := _RANK_ENTRY.match(key))}
    if not ranks:
        raise ValueError(f"{step_folder}: no per-rank entries; not a titan_recur training checkpoint")
    return len(ranks)


def train_records(folder: Path) -> list[dict[str, Any]]:
    """The optimizer-step records of metrics.jsonl (validation records left out); [] without the file."""
    path = folder / METRICS_NAME
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "loss" in r and "tokens_seen" in r]


def read_run(
    folder: str | Path, *, world_size: int | None = None, label: str | None = None, checkpoints: bool = False
) -> Run:
    """A run folder's config, progress, world size and the models to evaluate; ValueError if unusable.

    Progress is the last step the run logged or checkpointed. The world size (it sets the micro-steps
    per step, each drawing its own (n, k)) comes from the latest checkpoint unless given. The final
    model is evaluated when present; ``checkpoints`` adds every complete step folder, and a run
    without a final model contributes its latest checkpoint.
    """
    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        raise ValueError(f"{folder}: not a training run (no {CONFIG_NAME}; the trainer writes it at start)")
    cfg = load_config(str(folder / CONFIG_NAME))
    final = folder / FINAL_MODEL_FOLDER
    final = final if (final / "config.json").is_file() else None  # type: ignore[assignment]
    ckpt_folder = folder / cfg.checkpoint.folder
    steps = scan_checkpoints(ckpt_folder).complete
    records = train_records(folder)
    progress = max([*steps, *(r["step"] for r in records), cfg.training.steps if final else 0], default=0)
    if progress == 0:
        raise ValueError(f"{folder}: no progress yet (no {METRICS_NAME} records, checkpoints or {FINAL_MODEL_FOLDER})")
    saved_world = checkpoint_world_size(ckpt_folder / f"step-{steps[-1]}") if steps else None
    if not records and (folder / METRICS_NAME).is_file() and world_size is None and saved_world is None:
        raise ValueError(
            f"{folder / METRICS_NAME} has no step records and the run no checkpoint, so nothing confirms its "
            "data-parallel ranks (the micro-steps of the FLOP count): pass --world-size, the ranks it trained on"
        )
    if world_size is not None and saved_world is not None and world_size != saved_world:
        raise ValueError(
            f"{folder}: its checkpoints were written by {saved_world} rank(s), --world-size says {world_size}"
        )
    world_size = world_size or saved_world or 1
    flops = config_training_run(cfg, world_size, read_model_args(final) if final else None)
    _check_tokens_per_step(folder, records, flops.tokens_per_step, cfg.training.max_skipped_steps)
    run = Run(folder, label or folder.name, cfg, flops, world_size, progress)
    model_config = final or (Path(cfg.model.path) if cfg.model.path else None)
    chosen = steps if checkpoints else ([] if final else steps[-1:])
    run.points = [
        EvalPoint(s, ckpt_folder / f"step-{s}", model_config) for s in chosen if not (final and s == progress)
    ]
    if final:
        run.points.append(EvalPoint(progress, final))
    if not run.points:
        raise ValueError(f"{folder}: nothing to evaluate (no {FINAL_MODEL_FOLDER} and no complete checkpoint)")
    if any(p.model_config is not None and not (p.model_config / "config.json").is_file() for p in run.points):
        raise ValueError(
            f"{folder}: its checkpoints need a model folder for their architecture; "
            f"neither {FINAL_MODEL_FOLDER}/ nor model.path {cfg.model.path} has a config.json"
        )
    return run


def _check_tokens_per_step(folder: Path, records: list[dict[str, Any]], tokens_per_step: int, max_skipped: int) -> None:
    """The logged tokens_seen must match the config's batch (up to skipped non-finite steps): catches a wrong world size."""
    if not records:
        return
    last = records[-1]
    done = last["tokens_seen"] / tokens_per_step
    least = max(last["step"] - max_skipped, last["step"] // 2 + 1)  # the trainer stops after max_skipped skips
    if not (done.is_integer() and least <= done <= last["step"]):
        raise ValueError(
            f"{folder}: metrics.jsonl has {last['tokens_seen']} tokens after step {last['step']}, the config "
            f"gives {tokens_per_step} per step; pass the run's --world-size"
        )


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class EvalSettings:
    """What to measure at each r: loss on ``data`` and/or ``tasks`` through the harness."""

    recurrences: list[int]
    tasks: list[str] = field(default_factory=list)
    data: str | None = None
    text_field: str = "text"
    data_format: DataFormat = "text"  # 'prompt_completion': the loss on the completions only
    loss_batches: int = 8
    loss_batch_size: int = 8
    seq_len: int | None = None  # default: the run's training.seq_len
    batch_size: int = 16
    max_gen_toks: int = 256
    limit: float | None = None
    num_fewshot: int | None = None
    include_path: list[str] = field(default_factory=list)
    device: str = "auto"

    def recurrences_of(self, run: Run) -> list[int]:
        """A static model ignores r: one evaluation stands for all."""
        return self.recurrences if run.recurrent else self.recurrences[:1]


def task_manager(settings: EvalSettings):
    """The harness task index with the project's tasks/ and the extra include paths.

    When every task is a YAML file, lm_eval's own index (some 15k tasks, most of a minute to build
    on a small CPU) is left out: only the files' folders and the include paths are indexed.
    """
    from titan_recur.eval import harness

    files_only = bool(settings.tasks) and all(harness.is_task_file(t) for t in settings.tasks)
    return harness.task_manager(settings.tasks, settings.include_path, include_defaults=not files_only)


def evaluate_point(
    run: Run, point: EvalPoint, settings: EvalSettings, tasks_index: Any, advance: Callable[[], None]
) -> dict[str, dict[str, Any]]:
    """{str(r): {"loss": float, "tasks": {task: {metric: value}}}} for one model, loaded once."""
    from titan_recur.eval.lm_eval_model import TitanRecurLM

    lm = TitanRecurLM(
        pretrained=str(point.path),
        model_config=str(point.model_config) if point.model_config else None,
        batch_size=settings.batch_size,
        device=settings.device,
        max_gen_toks=settings.max_gen_toks,
    )
    batches = _loss_batches(lm, run, settings) if settings.data else None
    results = {}
    for r in settings.recurrences_of(run):
        entry: dict[str, Any] = {}
        if batches is not None:
            from titan_recur.eval.sweep import loss_sweep

            entry["loss"] = loss_sweep(lm.model, iter(batches), [r], lm.device)["loss"][str(r)]
        if settings.tasks:
            entry["tasks"] = _task_scores(lm, r, settings, tasks_index)
        results[str(r)] = entry
        advance()
    return results


def _loss_batches(lm: Any, run: Run, settings: EvalSettings) -> list:
    from titan_recur.eval.sweep import heldout_batches

    return list(
        heldout_batches(
            lm.tokenizer,
            seq_len=settings.seq_len or run.config.training.seq_len,
            batch_size=settings.loss_batch_size,
            num_batches=settings.loss_batches,
            data=settings.data,
            text_field=settings.text_field,
            data_format=settings.data_format,
            attention_mask=run.config.training.attention_mask,  # rows packed as the run trained on them
        )
    )


def _task_scores(lm: Any, r: int, settings: EvalSettings, tasks_index: Any) -> dict[str, dict[str, float]]:
    from titan_recur.eval.harness import harness_sweep, results_table

    results = harness_sweep(
        lm, settings.tasks, [r], tasks_index, limit=settings.limit, num_fewshot=settings.num_fewshot
    )
    scores: dict[str, dict[str, float]] = {}
    for row in results_table(results):
        scores.setdefault(row["task"], {})[row["metric"]] = row[str(r)]
    return scores


def compare(
    runs: Sequence[Run],
    settings: EvalSettings,
    progress: Callable[[int], Callable[[], None]] | None = None,
    tasks_index: Any = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Evaluate every point of every run at each r; the report compare.json holds.

    ``progress(total)`` returns the callback called after each (model, r) evaluation; ``tasks_index``
    is a ``task_manager(settings)`` already built (default: built here). ``workers`` > 1 evaluates the
    models in that many processes: the same report, in about 1/workers of the time on as many cores.
    """
    if not settings.tasks and settings.data is None:
        raise ValueError("nothing to measure: give a task (--task) and/or held-out data (--data)")
    total = sum(len(run.points) * len(settings.recurrences_of(run)) for run in runs)
    advance = progress(total) if progress else (lambda: None)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    units = [(run, point) for run in runs for point in run.points]
    if workers > 1:
        results = iter(_evaluate_in_processes(units, settings, workers, advance))
    else:
        if settings.tasks and tasks_index is None:
            tasks_index = task_manager(settings)
        results = (evaluate_point(run, point, settings, tasks_index, advance) for run, point in units)
    report_runs = []
    for run in runs:
        points = [
            {"step": p.step, "model": str(p.path), "flops": run.training_flops(p.step), "results": next(results)}
            for p in run.points
        ]
        report_runs.append(_describe(run) | {"points": points})
    return {"recurrences": settings.recurrences, "tasks": settings.tasks, "data": settings.data, "runs": report_runs}


_worker_tasks_index: Any = None  # a worker process's harness task index, built once by _start_worker


def _start_worker(settings: EvalSettings, threads: int) -> None:
    global _worker_tasks_index
    import torch

    torch.set_num_threads(threads)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    _worker_tasks_index = task_manager(settings) if settings.tasks else None


def _evaluate_in_worker(run: Run, point: EvalPoint, settings: EvalSettings) -> dict[str, dict[str, Any]]:
    return evaluate_point(run, point, settings, _worker_tasks_index, lambda: None)


def _evaluate_in_processes(
    units: list[tuple[Run, EvalPoint]], settings: EvalSettings, workers: int, advance: Callable[[], None]
) -> list[dict[str, dict[str, Any]]]:
    """evaluate_point of every unit in ``workers`` spawned processes, each with its share of this process's
    threads; the recurrent models (evaluated at every r) first, so that the processes finish together. A
    failed evaluation fails the comparison: the models not started are dropped, never retried."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    threads = max(1, torch.get_num_threads() // workers)
    order = sorted(range(len(units)), key=lambda i: -sum(settings.recurrences_of(units[i][0])))
    results: list[dict[str, dict[str, Any]]] = [{} for _ in units]
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(settings, threads))
    try:
        futures = {pool.submit(_evaluate_in_worker, *units[i], settings): i for i in order}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            for _ in settings.recurrences_of(units[futures[future]][0]):
                advance()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _describe(run: Run) -> dict[str, Any]:
    args, t = run.flops.args, run.config.training
    schedule = run.flops.schedule
    return {
        "label": run.label,
        "folder": str(run.folder),
        "recurrent": run.recurrent,
        "shape": [args.n_prelude, args.n_core, args.n_coda],
        # A recurrent run's TrainingRun has a schedule.
        "train_mean_recurrence": cast(RecurrenceSchedule, schedule).mean(run.step) if run.recurrent else None,
        "steps": run.step,
        "planned_steps": t.steps,
        "world_size": run.world_size,
        "tokens_per_step": run.flops.tokens_per_step,
        "micro_steps": run.flops.micro_steps,
        "seq_len": run.flops.seq_len,
        "flops": run.training_flops(run.step),
    }


# ---------------------------------------------------------------------------------------------
# Tables and plots


@dataclass(frozen=True)
class Quantity:
    """A plotted number: the loss, or one (task, metric) score."""

    name: str
    task: str | None = None
    metric: str | None = None

    def value(self, entry: dict[str, Any]) -> float | None:
        if self.task is None:
            return entry.get("loss")
        return entry.get("tasks", {}).get(self.task, {}).get(self.metric)

    @property
    def title(self) -> str:
        return "held-out loss" if self.task is None else f"{self.task} {self.metric}"

    @property
    def axis_label(self) -> str:
        return "held-out loss" if self.metric is None else self.metric.split(",")[0]


def quantities(report: dict[str, Any], metric: str | None = None) -> list[Quantity]:
    """The loss (if measured) and each task's headline metric (``metric``, else PREFERRED_METRICS, else the first)."""
    found: dict[str, set[str]] = {}  # task names as the harness reports them (a YAML file gives its `task:`)
    first: dict[str, Any] = {}
    for run in report["runs"]:
        for point in run["points"]:
            for entry in point["results"].values():
                first = first or entry
                for task, scores in entry.get("tasks", {}).items():
                    found.setdefault(task, set()).update(scores)
    out = [Quantity("loss")] if "loss" in first else []
    for task in found:
        metrics = sorted(found[task])
        if metric is not None and metric not in metrics:
            raise ValueError(f"task {task} has no metric {metric!r}; it reports {', '.join(metrics) or 'none'}")
        chosen = metric or next((m for m in PREFERRED_METRICS if m in metrics), metrics[0] if metrics else None)
        if chosen:
            out.append(Quantity(_slug(task), task, chosen))
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _value_at(run: dict[str, Any], point: dict[str, Any], q: Quantity, r: int) -> float | None:
    """A static run's single evaluation stands for every r."""
    results = point["results"]
    entry = results.get(str(r), {}) if run["recurrent"] else next(iter(results.values()))
    return q.value(entry)


def markdown(report: dict[str, Any], qs: Sequence[Quantity]) -> str:
    """One table per quantity: a row per evaluated model, FLOPs in both conventions, a column per r."""
    rs = report["recurrences"]
    lines = [MARKDOWN_TITLE, ""]
    for run in report["runs"]:
        kind = (
            f"recurrent {tuple(run['shape'])}, train mean r {run['train_mean_recurrence']}"
            if run["recurrent"]
            else f"static, {run['shape'][0]} layers"
        )
        lines.append(
            f"- **{run['label']}** ({kind}): {run['steps']} steps x {run['tokens_per_step']} tokens, "
            f"{run['world_size']} rank(s), {run['micro_steps']} micro-step(s)/step; training FLOPs "
            f"{run['flops']['paper']:.3e} (paper), {run['flops']['full']:.3e} (full)"
        )
    for q in qs:
        lines += [
            "",
            f"## {q.title}",
            "",
            "| run | step | FLOPs (paper) | FLOPs (full) | " + " | ".join(f"r={r}" for r in rs) + " |",
            "|" + "---|" * (len(rs) + 4),
        ]
        for run in report["runs"]:
            for point in run["points"]:
                values = [_value_at(run, point, q, r) for r in rs]
                cells = ["" if v is None else f"{v:.4f}" for v in values]
                name = run["label"] if run["recurrent"] else f"{run['label']} (static: same at every r)"
                lines.append(
                    f"| {name} | {point['step']} | {point['flops']['paper']:.3e} | "
                    f"{point['flops']['full']:.3e} | " + " | ".join(cells) + " |"
                )
    return "\n".join(lines) + "\n"


def plot_vs_recurrence(report: dict[str, Any], q: Quantity, path: Path) -> None:
    """Score vs test r of each run's last evaluated model; static runs as horizontal lines."""
    rs = report["recurrences"]
    series, baselines = {}, {}
    for run in report["runs"]:
        point = run["points"][-1]
        if run["recurrent"]:
            series[f"{run['label']} (train mean {run['train_mean_recurrence']})"] = {
                r: v for r in rs if (v := _value_at(run, point, q, r)) is not None
            }
        elif (value := _value_at(run, point, q, rs[0])) is not None:
            baselines[f"static baseline: {run['label']}"] = value
    fig = figure_vs_r(series, q.axis_label, f"{q.title}\n(last evaluated model of each run)")
    ax = fig.axes[0]
    for label, value in baselines.items():
        ax.axhline(value, color="black", linestyle="--", label=label)
    ax.set_xticks(rs, [str(r) for r in rs])
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_vs_flops(report: dict[str, Any], q: Quantity, path: Path) -> None:
    """Score vs training FLOPs (paper | full convention): recurrent runs per test r, static runs as crosses."""
    plt = pyplot()
    rs = report["recurrences"]
    colors = plt.get_cmap("viridis")([i / max(len(rs) - 1, 1) for i in range(len(rs))])
    markers = "os^Dv<>"
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120, sharey=True)
    for ax, convention in zip(axes, CONVENTIONS, strict=True):
        recurrent = [run for run in report["runs"] if run["recurrent"]]
        for j, run in enumerate(recurrent):
            flops = [p["flops"][convention] for p in run["points"]]
            for color, r in zip(colors, rs, strict=True):
                label = f"r={r}" if j == 0 else None
                ax.plot(
                    flops,
                    [_value_at(run, p, q, r) for p in run["points"]],
                    marker=markers[j % len(markers)],
                    color=color,
                    label=label,
                )
        for run in report["runs"]:
            if not run["recurrent"]:
                ax.plot(
                    [p["flops"][convention] for p in run["points"]],
                    [_value_at(run, p, q, rs[0]) for p in run["points"]],
                    marker="x",
                    markersize=9,
                    color="black",
                    linestyle="--",
                    label=f"static baseline: {run['label']}",
                )
        ax.set_xscale("log")
        ax.set_xlabel(f"training FLOPs ({convention} convention)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(q.axis_label)
    names = ", ".join(
        f"'{markers[j % len(markers)]}' {run['label']}"
        for j, run in enumerate(r for r in report["runs"] if r["recurrent"])
    )
    fig.suptitle(
        f"{q.title} vs training FLOPs" + (f"  (recurrent runs at each test r, markers: {names})" if names else ""),
        fontsize=9,
    )
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def is_compare_output(path: Path) -> bool:
    """A file compare writes: its compare.json (a report with runs and recurrences), compare.md or a PNG plot."""
    try:
        if path.suffix == ".png":
            return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        text = path.read_text()
        if path.name == MARKDOWN_NAME:
            return text.startswith(MARKDOWN_TITLE)
        report = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(report, dict) and {"runs", "recurrences"} <= set(report)


def check_out(out: Path, force: bool) -> None:
    """Before any work: ``out`` is a folder (or not yet), holding no earlier result unless ``force`` (then only
    compare's own files are replaced)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    plots = sorted(out.glob("*_vs_r.png")) + sorted(out.glob("*_vs_flops.png")) if out.is_dir() else []
    check_output_files([out / JSON_NAME, out / MARKDOWN_NAME, *plots], force, is_compare_output, "a compare result")


def write_report(report: dict[str, Any], out: str | Path, metric: str | None = None) -> list[Path]:
    """compare.json, compare.md and, per quantity, <name>_vs_r.png and <name>_vs_flops.png into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / JSON_NAME, out / MARKDOWN_NAME]
    written[0].write_text(json.dumps(report, indent=2) + "\n")  # first: a bad --metric must not lose the results
    qs = quantities(report, metric)
    written[1].write_text(markdown(report, qs))
    for q in qs:
        plot_vs_recurrence(report, q, out / f"{q.name}_vs_r.png")
        plot_vs_flops(report, q, out / f"{q.name}_vs_flops.png")
        written += [out / f"{q.name}_vs_r.png", out / f"{q.name}_vs_flops.png"]
    return written
