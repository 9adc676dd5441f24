"""The Trainer: a run built from its config (model, data, optimizers, checkpoints, metrics) and its loop.

The command around it is titan_recur/cli/train.py (``[torchrun ...] python -m titan_recur.train --config FILE``).
One process or any number under torchrun; nccl on GPU, gloo on CPU. Everything a run writes goes
under ``job.dump_folder``: checkpoints/, tb/, metrics.jsonl, config.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from titan_recur.config import (
    FINAL_MODEL_FOLDER,
    ConfigError,
    JobConfig,
    config_to_dict,
    config_to_json,
    grad_accum_steps,
)
from titan_recur.data.loader import LoaderGeometry, build_dataloader
from titan_recur.data.tokenizer import load_tokenizer
from titan_recur.models.args import ModelArgs
from titan_recur.models.loss import count_labels
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelState,
    OptimizerState,
    RankLocalState,
    ResumePoint,
    TorchRNGState,
    load_from,
)
from titan_recur.storage.lock import DumpFolderLock, DumpFolderLockedError
from titan_recur.storage.model_io import (
    resolve_model_args,
    write_atomically,
    write_model_folder,
)
from titan_recur.training import cost_model, preflight
from titan_recur.training.build import build_model
from titan_recur.training.cost_model import dp_mesh_shape
from titan_recur.training.fingerprint import check_unchanged, run_fingerprint
from titan_recur.training.metrics import MetricsLogger
from titan_recur.training.optim import build_optimizers, clip_coefficient, grad_square_sum, scale_grads_
from titan_recur.training.parallelize import build_dp_mesh, forward_autocast
from titan_recur.training.profiling import PhaseTimer, StepProfiler
from titan_recur.training.recurrence import RecurrenceSchedule
from titan_recur.training.validation import Validator, batch_document_ids
from titan_recur.training.watchdog import StepWatchdog, heartbeat_store
from titan_recur.utils.exit_codes import EXIT_PREEMPTED


@dataclass
class DistInfo:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return dist.is_initialized()


def init_distributed(device_choice: str, timeout_s: float) -> DistInfo:
    """Join the process group when launched by torchrun; nccl on GPU, gloo on CPU; collectives time out."""
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = 'cuda' but CUDA is not available (use 'auto' or 'cpu')")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            device_id=device if use_cuda else None,
            timeout=timedelta(seconds=timeout_s),
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return DistInfo(rank=rank, world_size=world, device=device)


class PreemptionFlag:
    """Set by SIGTERM/SIGUSR1 on this rank, and by the first Ctrl-C once training runs; ``agreed`` (any rank
    got one) travels with each step's reduction. ``notice``: what rank 0 says on the first Ctrl-C."""

    def __init__(self, notice: str | None) -> None:
        self.requested = False
        self.agreed = False
        self.stopped_at_once = False  # a second Ctrl-C: whatever it broke (a save half written) is its doing
        self.notice = notice
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def catch_interrupt(self) -> None:
        """The first Ctrl-C ends the run as SIGTERM does; the next raises KeyboardInterrupt (stop at once).
        Before training a Ctrl-C stops at once: nothing is worth saving yet."""
        self._previous.setdefault(signal.SIGINT, signal.signal(signal.SIGINT, self._interrupt))

    def restore(self) -> None:
        """The handlers from before the trainer (a process that goes on, as a test's, gets its own back)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def _interrupt(self, signum: int, frame: object) -> None:
        if self.requested:
            self.stopped_at_once = True
            raise KeyboardInterrupt
        self.requested = True
        if self.notice:
            os.write(1, f"[titan_recur] {self.notice}\n".encode())  # no print: a handler may interrupt one


class NonFiniteError(RuntimeError):
    """A non-finite or spiking loss stopped the run; nothing of the bad step was saved."""


class Trainer:
    """Builds everything from the config (checking inputs first), then runs the loop."""

    def __init__(self, cfg: JobConfig, force: bool = False) -> None:
        """``force``: start over where an earlier run finished, replacing its final_model/ (``--force``)."""
        self.cfg = cfg
        self.dist = init_distributed(cfg.training.device, cfg.parallel.timeout_s)
        self.dump = Path(cfg.job.dump_folder)
        preflight.check_output_folders(cfg)
        preflight.check_finished_run(cfg, force)
        self.model_args = resolve_model_args(cfg.model)
        self.tokenizer = self._load_tokenizer()
        self.dp_world = self.dist.world_size
        dp_mesh_shape(self.dp_world, cfg.parallel.dp_replicate, cfg.parallel.dp_shard)
        self.grad_accum = grad_accum_steps(cfg.training, self.dp_world)
        preflight.check_step_memory(cfg, self.model_args, self.dp_world, self.dist.device)
        preflight.check_data(cfg, self.tokenizer)
        preflight.check_loggers(cfg)  # a missing wandb is one line before any work
        torch.manual_seed(cfg.job.seed + self.dist.rank)
        if cfg.job.deterministic:
            torch.use_deterministic_algorithms(True)
        self.mesh = None
        if self.dist.is_distributed:
            self.mesh = build_dp_mesh(
                self.dist.device.type, self.dist.world_size, cfg.parallel.dp_replicate, cfg.parallel.dp_shard
            )
        self.model = build_model(cfg, self.model_args, self.dist.device, self.mesh)
        self.optimizers = build_optimizers(self.model, cfg.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.schedule = RecurrenceSchedule.from_config(cfg.recurrence, cfg.training.steps)
        geometry = LoaderGeometry.of_run(cfg, self.dist.rank, self.dp_world, self.grad_accum)
        self.dataloader = build_dataloader(
            cfg.data, self.tokenizer, geometry, attention_mask=cfg.training.attention_mask
        )
        self.validator = Validator(cfg, self.tokenizer, self.dist.rank, self.dp_world, self.dist.device)
        self.step = 0
        self.progress = TrainProgress()
        global_batch = cfg.training.local_batch_size * self.dp_world * self.grad_accum
        self.fingerprint = run_fingerprint(cfg, self.model_args, self.tokenizer_folder(), global_batch)
        self.checkpointer = self._build_checkpointer()
        self.metrics = MetricsLogger(  # opens its files only in train(), once the inputs are checked
            self.dump,
            enabled=self.dist.rank == 0,
            tensorboard=cfg.metrics.enable_tensorboard,
            jsonl=cfg.metrics.jsonl,
            peak_flops=cost_model.peak_flops(override=cfg.metrics.peak_flops),
            total_steps=cfg.training.steps,
            wandb=cfg.metrics if cfg.metrics.enable_wandb else None,
            run_config=config_to_dict(cfg),
        )
        saving = " and writing a checkpoint" if cfg.checkpoint.enable else ""
        self.preemption = PreemptionFlag(
            f"Ctrl-C: finishing this step{saving}, then exiting ({EXIT_PREEMPTED}); Ctrl-C again stops at once"
            if self.dist.rank == 0
            else None
        )
        self.async_save_written = False  # every rank's background save has finished (agreed each step)
        self.training = False  # the loop has started: failures from now on name the step and last checkpoint
        self.watchdog = StepWatchdog(cfg.training.step_timeout_s, self.dist.rank, self.dist.world_size)
        self.profiler = StepProfiler(cfg.profiling, self.dump, self.dist.rank, self.dist.device)
        self.phases = PhaseTimer(self.dist.device)  # timing off: the benchmark turns it on
        self.run_locks: list[DumpFolderLock] = []

    def _load_tokenizer(self):
        folder = self.tokenizer_folder()
        if folder is None:
            raise ConfigError(
                "set data.tokenizer (a folder with tokenizer files) when training from model.preset or from scratch"
            )
        tokenizer = load_tokenizer(folder)
        preflight.check_model_fit(self.cfg, self.model_args, tokenizer)
        if self.cfg.model.dim is not None:  # from scratch: the special tokens are the tokenizer's
            self.model_args = dataclasses.replace(
                self.model_args, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id
            )
        return tokenizer

    def _build_checkpointer(self) -> CheckpointManager:
        states: dict[str, Stateful] = {
            "model": ModelState(self.model),
            "train": self.progress,
            "schedulers": self.optimizers,
        }
        for i, optimizer in enumerate(self.optimizers.optimizers):
            states[f"optimizer_{i}"] = OptimizerState(self.model, optimizer)
        rank = self.dist.rank
        states["dataloader"] = RankLocalState(f"rank_{rank}", self.dataloader)
        states["rng"] = RankLocalState(f"rank_{rank}", TorchRNGState())
        c = self.cfg.checkpoint
        return CheckpointManager(
            self.dump / c.folder,
            states,
            interval=c.interval,
            keep_latest_k=c.keep_latest_k,
            async_mode=c.async_mode,
            fingerprint=self.fingerprint,
            timeout_s=self.cfg.parallel.timeout_s,
        )

    # ----------------------------------------------------------------------------------------- loop

    def resume(self) -> None:
        """Continue from this run's latest verified checkpoint (or checkpoint.load_step); else initial_load_path.

        The checkpoint's files must match its manifest and its run settings this run's (fingerprint).
        After a rewind the later steps are set aside, so this run's lineage continues from the step.
        """
        c = self.cfg.checkpoint
        point = None
        if c.enable:
            point = self.checkpointer.choose_resume(
                c.load_step, verify=c.verify, fallback_on_corruption=c.fallback_on_corruption
            )
        if point is None:
            if c.initial_load_path:
                load_from(
                    Path(c.initial_load_path), {"model": ModelState(self.model)}, verify=c.verify, required=c.verify
                )
                self._log(f"initialised the model from {c.initial_load_path} (model only)")
            elif c.enable:
                self._log(f"no checkpoint in {self.checkpointer.folder}: starting at step 0")
            return
        step, folder = point.step, self.checkpointer.step_folder(point.step)
        changed = self._check_fingerprint(point)
        saved_world = self.checkpointer.saved_world_size(step)
        if saved_world == self.dist.world_size:
            self.checkpointer.load(step)
        else:
            self._resume_resharded(step, saved_world)
        self.step = self.progress.step
        allowed = f"; allowed changes: {', '.join(changed)}" if changed else ""
        self._log(f"resumed from {folder} at step {self.step}: {point.reason}{allowed}")
        moved = self.checkpointer.set_aside(point.set_aside, point.set_aside_as)
        if moved is not None:
            rerun = " (drop --checkpoint.load_step when rerunning or requeuing, or each rerun rewinds again)"
            self._log(
                f"moved the later checkpoints {point.set_aside} to {moved}: kept, never resumed automatically"
                + (rerun if c.load_step >= 0 else "")
            )

    def _check_fingerprint(self, point: ResumePoint) -> list[str]:
        """The allowed changes of settings since the checkpoint; any other change is refused."""
        folder = self.checkpointer.step_folder(point.step)
        if point.manifest is None:
            self._log(f"warning: {folder} has no manifest: its files and run settings are not checked")
            return []
        saved = point.manifest.get("fingerprint", {})
        return check_unchanged(saved, self.fingerprint, self.cfg.checkpoint.allow_changes, str(folder))

    def _resume_resharded(self, step: int, saved_world: int) -> None:
        """Another world size: model, optimizers, schedules and progress reshard; the data position cannot.

        With data.reshard = "restart" every rank hands the old data state of rank ``rank % saved_world``
        to its loader, which sees the new geometry and restarts its streams at a new epoch from ``step``
        (data/loader.py); the RNG keeps this run's per-rank seed.
        """
        folder = self.checkpointer.step_folder(step)
        if self.cfg.data.reshard != "restart":
            raise CheckpointError(
                f"{folder} was written by {ranks(saved_world)}, this run has {self.dist.world_size}: model and "
                f"optimizer reshard but the data position cannot; set data.reshard = 'restart' "
                f"(--data.reshard restart) to restart the data streams at a new epoch from step {step}"
            )
        self.checkpointer.load(step, names=[n for n in self.checkpointer.states if n not in ("dataloader", "rng")])
        source = RankLocalState(f"rank_{self.dist.rank % saved_world}", self.dataloader)
        load_from(folder, {"dataloader": source})
        self._log(
            f"resharded {folder} from {ranks(saved_world)} to {ranks(self.dist.world_size)}; data streams restarted"
        )

    def train(self) -> int:
        self.run_locks = take_run_locks(self._locked_folders())  # before the first read of the checkpoints
        self.resume()
        self._write_run_config()
        self.metrics.open()
        self._print_plan()
        steps = self.cfg.training.steps
        with torch.random.fork_rng(devices=[]):  # iter() draws a seed: keep the restored RNG for bit-exact resume
            data_iter = iter(self.dataloader)
        self.watchdog.start(heartbeat_store())
        self.preemption.catch_interrupt()
        self.training = True
        while self.step < steps:
            self.step += 1
            self.watchdog.step_started(self.step)
            with self.profiler.step(self.step):
                record = self.train_step(data_iter)
            if record is not None and (self.step % self.cfg.metrics.log_freq == 0 or self.step == steps):
                self.metrics.log_window(record, self.dist.device)
            if self.validator.due(self.step, steps):
                self._validate()
            if self._step_boundary():
                return EXIT_PREEMPTED
            self.watchdog.step_finished(self.step)
        self.checkpointer.wait()
        if self.cfg.checkpoint.export_final:
            export_model(self.model, self.model_args, self.dump / FINAL_MODEL_FOLDER, self.tokenizer_folder())
        self.metrics.close()
        return 0

    def train_step(self, data_iter: Iterator[dict[str, torch.Tensor]]) -> dict | None:
        """One optimizer step over grad_accum micro-steps, each with its own sampled (n, k).

        Returns the step's record, or None when a non-finite step was skipped. The micro-steps issue
        no collective and no host sync; the step's scalars travel in one all-reduce afterwards.
        """
        loss_sum = torch.zeros((), device=self.dist.device)
        labels = torch.zeros((), device=self.dist.device)
        tokens, step_flops = 0, 0.0
        for micro_step in range(self.grad_accum):
            batch = next(data_iter)
            n, k = self.schedule.sample(self.step, micro_step)
            micro_loss, micro_labels = self.forward_backward(batch, n, k)
            loss_sum += micro_loss
            labels += micro_labels
            tokens += batch["input_ids"].numel()
            per_token = cost_model.training_flops_per_token(self.model_args, (n, k), batch["input_ids"].shape[1])
            step_flops += per_token.total * batch["input_ids"].numel()
        result = self.optimizer_step(loss_sum, labels)
        if result is None:
            return None
        loss, grad_norm, lrs = result
        self.progress.step = self.step
        self.progress.tokens_seen += tokens * self.dp_world
        self.metrics.window.add(tokens, step_flops, loss)
        return {
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": next(iter(lrs.values())),
            **{f"lr_{name}": lr for name, lr in lrs.items()},
            **(self._recurrence_record(n, k) if self.model_args.is_recurrent else {}),
            "tokens_seen": self.progress.tokens_seen,
        }

    def _recurrence_record(self, n: int, k: int) -> dict[str, int | float]:
        """The step's depth: the schedule's mean r and backprop depth, the sampled no-grad and grad iterations."""
        return {
            "mean_recurrence": self.schedule.mean(self.step),
            "backprop_depth": self.schedule.backprop_depth(self.step),
            "n": n,
            "k": k,
        }

    def forward_backward(self, batch: dict[str, torch.Tensor], n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward with n no-grad and k grad iterations, backward of the summed token loss.

        Returns (loss sum, label count) as device scalars. Gradients are of the sum; `optimizer_step`
        rescales them once the global label count is known.
        """
        t = self.cfg.training
        input_ids = batch["input_ids"].to(self.dist.device, non_blocking=True)
        labels = batch["labels"].to(self.dist.device, non_blocking=True)
        documents = batch_document_ids(batch, self.dist.device)
        with (
            self.phases.phase("forward"),
            forward_autocast(self.dist.device.type, t.mixed_precision_param, t.mixed_precision_mode),
        ):
            loss_sum = self.model(
                input_ids, (n, k), labels=labels, loss_chunk_tokens=t.loss_chunk_tokens, document_ids=documents
            )
        if self.step == self.cfg.debug.inject_nan_at_step:
            loss_sum = loss_sum * float("nan")
        if self.step == self.cfg.debug.inject_spike_at_step:
            loss_sum = loss_sum * 1000
        with self.phases.phase("backward"):
            loss_sum.backward()
        return loss_sum.detach(), count_labels(labels)

    def optimizer_step(
        self, loss_sum: torch.Tensor, labels: torch.Tensor
    ) -> tuple[float, float, dict[str, float]] | None:
        """Reduce the step's scalars, turn summed gradients into the global mean, clip, check, step.

        One all-reduce carries this rank's loss sum, label count, squared gradient norm and two
        step-boundary flags (a preemption signal arrived; its background checkpoint write finished).
        FSDP averaged the gradient sums over ranks, so dp / labels makes them the exact mean over
        every label of the global batch. Returns (loss, grad norm, lrs), or None when the step was
        skipped (non-finite, or a loss spike).
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        local = torch.stack(
            [
                loss_sum.float(),
                labels.float(),
                grad_square_sum(params) / self.cfg.parallel.dp_replicate,
                torch.full(
                    (), float(self.preemption.requested), device=self.dist.device
                ),  # a fill, not a copy: no sync
                torch.full((), float(self.checkpointer.write_finished()), device=self.dist.device),
            ]
        )
        if dist.is_initialized():
            dist.all_reduce(local)
        total_loss, total_labels, square_sum, preempted, written = local.tolist()
        self.preemption.agreed = preempted > 0
        self.async_save_written = written == self.dist.world_size
        if total_labels == 0:  # e.g. only prompt tokens: no loss to learn from, the same at every rerun
            self.optimizers.zero_grad()
            self._handle_bad_step(
                f"no labelled token in the global batch of step {self.step} (every label is ignored, as in a "
                "prompt with no completion token)",
                skippable=True,
            )
            return None
        grad_scale = self.dp_world / total_labels
        loss, grad_norm = total_loss / total_labels, math.sqrt(square_sum) * grad_scale
        problem = self._bad_step(loss, grad_norm)
        if problem:
            self.optimizers.zero_grad()
            self._handle_bad_step(problem)
            return None
        scale_grads_(params, grad_scale * clip_coefficient(grad_norm, self.cfg.training.max_norm))
        lrs = self.optimizers.current_lrs()
        with self.phases.phase("optimizer"):
            self.optimizers.step()
        self.optimizers.step_schedulers()
        self.optimizers.zero_grad()
        self.progress.record_loss(loss, self.cfg.training.loss_spike_window)
        return loss, grad_norm, lrs

    def _bad_step(self, loss: float, grad_norm: float) -> str | None:
        """Why this step must not be applied: a non-finite loss or grad norm, or a loss spike; else None."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return f"non-finite loss {loss} or grad norm {grad_norm} at step {self.step}"
        t, window = self.cfg.training, self.progress.recent_losses
        if t.loss_spike_factor and len(window) == t.loss_spike_window:
            median = statistics.median(window)
            if loss > t.loss_spike_factor * median:
                return (
                    f"loss spike {loss:.4g} > {t.loss_spike_factor:g} x {median:.4g} (the median of the last "
                    f"{len(window)} steps, training.loss_spike_factor) at step {self.step}"
                )
        return None

    def _validate(self) -> None:
        losses = self.validator.run(self.model)
        if losses is None:
            self._log(
                f"validation at step {self.step} skipped: no labelled token in its {self.cfg.validation.steps} "
                "batches (every label is ignored, as in prompts with no completion token)"
            )
            return
        self.metrics.log_validation(self.step, losses)

    def _print_plan(self) -> None:
        """The start-up banner: the plan `--check` prints, for this world size and device."""
        if self.dist.rank == 0:
            lines = preflight.plan_lines(
                self.cfg, self.model_args, self.dist.world_size, device_type=self.dist.device.type
            )
            for line in lines:
                self._log(f"plan: {line}")

    def _step_boundary(self) -> bool:
        """Complete a finished background save; checkpoint when due or on a preemption signal (True: exit)."""
        c, steps = self.cfg.checkpoint, self.cfg.training.steps
        if self.async_save_written:
            self.checkpointer.wait()
        preempted = self.preemption.agreed
        if c.enable and (preempted or self.checkpointer.should_save(self.step, steps)):
            self.checkpointer.save(self.step)
        if not preempted:
            return False
        self.checkpointer.wait()
        saved = f"checkpoint {self.checkpointer.step_folder(self.step)} written" if c.enable else "checkpoints disabled"
        self._log(f"preemption signal at step {self.step}: {saved}; exiting with {EXIT_PREEMPTED}")
        return True

    def _handle_bad_step(self, message: str, skippable: bool = False) -> None:
        """Skip the step, or stop; ``skippable``: skipped even without training.skip_nonfinite (up to the limit)."""
        self.progress.skipped_steps += 1
        stop = None
        if not (skippable or self.cfg.training.skip_nonfinite):
            stop = "stopping (training.skip_nonfinite = false)"
        elif self.progress.skipped_steps > self.cfg.training.max_skipped_steps:
            stop = f"stopping: {self.progress.skipped_steps} steps skipped > training.max_skipped_steps"
        if stop:
            self.checkpointer.wait()  # an in-flight save holds the last good state: complete it
            latest = self.checkpointer.latest_step()
            last_good = "none" if latest is None else self.checkpointer.step_folder(latest)
            raise NonFiniteError(
                f"{message}; {stop}; nothing of this state is saved (latest good checkpoint: {last_good})"
            )
        self._log(f"{message}; step skipped ({self.progress.skipped_steps} so far)")
        self.progress.step = self.step

    def _log(self, message: str) -> None:
        if self.dist.rank == 0:
            print(f"[titan_recur] {message}", flush=True)

    def _write_run_config(self) -> None:
        """The resolved config beside the run's outputs (and on the console with job.print_config)."""
        if self.dist.rank == 0:
            text = config_to_json(self.cfg)
            self.dump.mkdir(parents=True, exist_ok=True)
            tmp = self.dump / "config.json.tmp"  # a failed write (disk full) leaves the previous config.json
            try:
                tmp.write_text(text)
                tmp.replace(self.dump / "config.json")
            finally:
                tmp.unlink(missing_ok=True)
            if self.cfg.job.print_config:
                print(text, end="", flush=True)

    def tokenizer_folder(self) -> str | None:
        return preflight.tokenizer_folder(self.cfg)

    def _locked_folders(self) -> list[tuple[Path, str]]:
        """The dump folder, and the checkpoint folder on its own: an absolute checkpoint.folder may be another
        run's (or inside another run's dump folder), so it is locked wherever it is."""
        folders = [(self.dump, "job.dump_folder")]
        checkpoints = self.checkpointer.folder
        if self.cfg.checkpoint.enable and checkpoints.resolve() != self.dump.resolve():
            folders.append((checkpoints, "checkpoint.folder"))
        return folders

    def close(self) -> None:
        self.preemption.restore()
        self.watchdog.stop()
        self.metrics.close()
        for lock in self.run_locks:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainProgress:
    """Step counters, and the recent losses the spike guard compares with, saved in every checkpoint."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.recent_losses: list[float] = []

    def record_loss(self, loss: float, window: int) -> None:
        self.recent_losses = (self.recent_losses + [loss])[-window:]

    def state_dict(self) -> dict:
        # The losses as one JSON string: DCP would load a list only up to the length of the template's.
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "recent_losses": json.dumps(self.recent_losses),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.skipped_steps = int(state["skipped_steps"])
        self.recent_losses = json.loads(state["recent_losses"])


def export_model(model: RecurrentLM, args: ModelArgs, folder: Path, tokenizer_folder: str | None) -> None:
    """Model-only export of the trained weights as a model folder (load_model reads it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # A model's full state dict: tensors only.
    state = cast(
        "dict[str, torch.Tensor]",
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
    )
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    write_atomically(folder, lambda tmp: write_model_folder(tmp, args, state, tokenizer_folder), kind="trained")
    print(f"[titan_recur] exported final model to {folder}", flush=True)


def ranks(count: int) -> str:
    """'1 rank', '2 ranks'."""
    return f"{count} rank{'' if count == 1 else 's'}"


def take_run_locks(folders: list[tuple[Path, str]]) -> list[DumpFolderLock]:
    """Rank 0 takes the locks of the run's folders (folder, setting naming it) for the whole run; every rank
    learns the outcome, so no other rank races for them and a refusal stops all of them with rank 0's one
    line (storage/lock.py). A refusal releases the locks already taken."""
    locks: list[DumpFolderLock] = []
    refusal = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            for folder, what in folders:
                locks.append(DumpFolderLock.acquire(folder, what))
        except (DumpFolderLockedError, OSError) as err:  # held by a live run; a read-only or full folder
            refusal = err
            for lock in locks:
                lock.release()
    if dist.is_initialized():
        outcome = [refusal]
        dist.broadcast_object_list(outcome, src=0)
        refusal = outcome[0]
    if refusal is not None:
        # The other ranks exit with its code, silently (a marker on whichever exception it is, read by getattr).
        refusal.said_by_rank0 = True  # type: ignore[union-attr]
        raise refusal
    return locks
