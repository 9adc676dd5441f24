"""Training metrics: one console line per log step, TensorBoard scalars, metrics.jsonl and, optionally,
Weights & Biases (rank 0 only). Every sink receives the same records.

The logger also owns the log window: throughput, MFU and the loss averaged over the steps since
the last log line (a single step's loss is noisy under sampled depth).
"""

from __future__ import annotations

import json
import math
import resource
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from titan_recur.config import ConfigError, Metrics
from titan_recur.training import cost_model
from titan_recur.utils.plots import figure_vs_r

WANDB_ID_FILE = "wandb_run_id"  # in the dump folder: the W&B run a resumed run continues


def max_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib / 2**20 if sys.platform != "darwin" else rss_kib / 2**30


class StepWindow:
    """Tokens, model FLOPs and losses of the steps since the window opened."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.tokens, self.flops, self.losses = 0, 0.0, []  # type: ignore[var-annotated]

    def add(self, tokens: int, step_flops: float, loss: float) -> None:
        self.tokens += tokens
        self.flops += step_flops
        self.losses.append(loss)

    def summary(self, peak_flops: float | None, steps_left: int | None = None) -> dict[str, float | None]:
        """Window figures; with ``steps_left``, the ETA at the window's mean step time (validation and
        checkpoint time included: they recur)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        flops_per_sec = self.flops / elapsed
        step_time = elapsed / len(self.losses) if self.losses else math.nan
        return {
            "loss_avg": sum(self.losses) / len(self.losses) if self.losses else math.nan,
            "tokens_per_sec": self.tokens / elapsed,
            "flops_per_sec": flops_per_sec,
            "mfu": cost_model.mfu(flops_per_sec, peak_flops),
            "step_time": step_time,
            "eta_seconds": steps_left * step_time if steps_left is not None else math.nan,
        }


def import_wandb() -> Any:
    """The wandb module, or a one-line error saying how to install it (checked before any work)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "metrics.enable_wandb = true needs wandb: pip install 'titan_recur[wandb]' "
            "(or --metrics.enable_wandb false)"
        ) from None
    return wandb


def scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """A record's numbers other than the step, named as TensorBoard and W&B group them (section/key)."""
    for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
            yield key.replace(".", "/"), value


class WandbSink:
    """One W&B run per dump folder: its id is kept there, so a resumed run continues the same W&B run.

    Records are logged against their own ``step`` (W&B's step_metric), not W&B's internal counter, so
    the steps a resumed run repeats after its checkpoint are kept, as in metrics.jsonl.
    """

    def __init__(self, dump_folder: Path, cfg: Metrics, run_config: dict[str, Any]) -> None:
        wandb = import_wandb()
        id_file = dump_folder / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        try:
            self.run = wandb.init(
                project=cfg.wandb_project,
                entity=cfg.wandb_entity,
                name=cfg.wandb_run_name or dump_folder.name,
                tags=cfg.wandb_tags,
                mode=cfg.wandb_mode,
                id=run_id,
                resume="allow",
                dir=str(dump_folder),
                config=run_config,
            )
        except wandb.Error as err:
            message = " ".join(str(err).split())
            raise ConfigError(f"metrics.enable_wandb: wandb.init failed: {message}") from None
        id_file.write_text(run_id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({"step": record["step"], **dict(scalars(record))})

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Writes each record to console, TensorBoard, JSON lines and W&B; no-ops on ranks other than 0.

    Nothing touches the disk before :meth:`open`, which the trainer calls once every input has been
    checked (a run that fails on bad input leaves no event file behind).
    """

    def __init__(
        self,
        dump_folder: str | Path,
        *,
        enabled: bool,
        tensorboard: bool,
        jsonl: bool,
        peak_flops: float | None = None,
        total_steps: int | None = None,
        wandb: Metrics | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        """``wandb``: the [metrics] section when metrics.enable_wandb (``run_config`` is stored with the run)."""
        self.enabled = enabled
        self.dump_folder = Path(dump_folder)
        self.tensorboard, self.jsonl = tensorboard, jsonl
        self.peak_flops = peak_flops
        self.total_steps = total_steps
        self._chart_written = False
        self.window = StepWindow()
        self.writer = None
        self.jsonl_file = None
        self.wandb: WandbSink | None = None
        self._wandb_section, self._run_config = wandb, run_config or {}

    def open(self) -> None:
        if not self.enabled:
            return
        self.dump_folder.mkdir(parents=True, exist_ok=True)
        if self._wandb_section is not None:  # first: the one sink that can refuse (not logged in)
            self.wandb = WandbSink(self.dump_folder, self._wandb_section, self._run_config)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            self.writer = SummaryWriter(log_dir=str(self.dump_folder / "tb"))  # type: ignore[assignment]
        if self.jsonl:
            self.jsonl_file = open(self.dump_folder / "metrics.jsonl", "a", buffering=1)  # type: ignore[assignment]

    def log_window(self, record: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """Complete a step record with the window's figures and peak memory, log it, open a new window."""
        steps_left = None if self.total_steps is None else self.total_steps - record["step"]
        record = {**record, **self.window.summary(self.peak_flops, steps_left), "max_memory": max_memory_gib(device)}
        self.window.reset()
        mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
        eta = "" if steps_left is None else f"  eta {format_duration(record['eta_seconds'])}"
        depth = (  # a static model's record has none
            f"mean r {record['mean_recurrence']} (this step n={record['n']} k={record['k']})  " if "n" in record else ""
        )
        console = (
            f"step {record['step']:>6}  loss {record['loss']:.4f} (avg {record['loss_avg']:.4f})  "
            f"grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  {depth}"
            f"tok/s {record['tokens_per_sec']:,.0f}  mfu {mfu}  mem {record['max_memory']:.2f}GiB{eta}"
        )
        self.log(record, console)
        return record

    def log_validation(self, step: int, losses: dict[int, float]) -> None:
        """Validation loss per r: scalars validation/loss_r{r}, one TensorBoard chart of all r over steps
        (custom scalars) and, with matplotlib, a loss-vs-r figure per validation."""
        record = {"step": step, **{f"validation.loss_r{r}": loss for r, loss in losses.items()}}
        console = f"validation step {step:>6}  " + "  ".join(f"r={r}: {loss:.4f}" for r, loss in losses.items())
        self.log(record, console)
        if self.writer is None:
            return
        if not self._chart_written:
            tags = [f"validation/loss_r{r}" for r in losses]
            self.writer.add_custom_scalars({"validation": {"loss vs step, one line per r": ["Multiline", tags]}})
            self._chart_written = True
        try:
            figure = figure_vs_r({"validation": losses}, "validation loss", f"step {step}")
        except ImportError:  # matplotlib is the optional eval extra; the scalars are written regardless
            return
        self.writer.add_figure("validation/loss_vs_r", figure, step)
        self.writer.flush()

    def log(self, record: dict[str, Any], console: str) -> None:
        if not self.enabled:
            return
        print(console, flush=True)
        step = record["step"]
        if self.writer is not None:
            for key, value in scalars(record):
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.jsonl_file is not None:
            self.jsonl_file.write(json.dumps(_jsonable(record)) + "\n")
        if self.wandb is not None:
            self.wandb.log(record)

    def close(self) -> None:
        """Flush and close every sink; a sink that cannot (a full disk) is one warning line, not a traceback
        that would bury the error the run stops with."""
        writer, jsonl_file, self.writer, self.jsonl_file = self.writer, self.jsonl_file, None, None
        for name, sink in (("TensorBoard", writer), ("metrics.jsonl", jsonl_file)):
            if sink is None:
                continue
            try:
                sink.close()
            except (OSError, RuntimeError) as err:  # TensorBoard re-raises its writer thread's error at close
                reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                print(f"[titan_recur] warning: {name} in {self.dump_folder} not fully written: {reason}", flush=True)
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


def _quiet_tensorboard_thread() -> None:
    """TensorBoard's writer thread re-raises a write error (a full disk) in the trainer's next add/flush/close,
    where it becomes the run's one error line; the thread's own copy would print a traceback into the log."""
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def format_duration(seconds: float) -> str:
    """h:mm:ss (hours past a day keep counting); '?' before a step time is known."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats become null so every line is strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
