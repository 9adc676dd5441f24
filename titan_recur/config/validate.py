"""Cross-field checks that types can't express, and the batch geometry (grad_accum_steps)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titan_recur.config.errors import ConfigError, suggest
from titan_recur.config.schema import FINAL_MODEL_FOLDER, RECORD_SOURCE_KINDS, Data, JobConfig, Model, Training
from titan_recur.models.args import PRESETS
from titan_recur.utils.limits import check_recurrences

_AT_LEAST = {
    "training.steps": 1,
    "training.local_batch_size": 1,
    "training.seq_len": 1,
    "training.max_skipped_steps": 0,
    "training.loss_spike_window": 3,
    "training.step_timeout_s": 0,
    "debug.inject_nan_at_step": 0,
    "debug.inject_spike_at_step": 0,
    "training.loss_chunk_tokens": 0,
    "recurrence.start": 1,
    "recurrence.backprop_depth": 1,
    "recurrence.backprop_start": 1,
    "recurrence.sigma": 0,
    "optimizer.ns_steps": 1,
    "optimizer.weight_decay": 0,
    "optimizer.adamw_weight_decay": 0,
    "parallel.dp_replicate": 1,
    "checkpoint.interval": 1,
    "checkpoint.keep_latest_k": 0,
    "checkpoint.load_step": -1,
    "data.num_workers": 0,
    "validation.interval": 1,
    "validation.steps": 1,
    "metrics.log_freq": 1,
}
_POSITIVE = ("training.max_norm", "optimizer.lr", "optimizer.adamw_lr", "optimizer.adamw_eps", "parallel.timeout_s")
_FRACTIONS = (
    "recurrence.warmup_fraction",
    "recurrence.backprop_warmup_fraction",
    "lr_scheduler.warmup_fraction",
    "lr_scheduler.decay_fraction",
    "lr_scheduler.min_lr_factor",
)


def _get(cfg: JobConfig, name: str) -> Any:
    section, key = name.split(".")
    return getattr(getattr(cfg, section), key)


def _require(ok: Any, message: str) -> None:
    if not ok:
        raise ConfigError(f"invalid config: {message}")


_ARCHITECTURE = ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size")


def _validate_model(m: Model) -> None:
    if any(getattr(m, f) is not None for f in (*_ARCHITECTURE, "n_kv_heads")):
        return _validate_architecture(m)
    _require(
        m.path or m.preset,
        "set model.path (a converted model folder), model.preset, or an architecture "
        "to train from scratch (model.dim, n_layers, n_heads, ffn_dim, vocab_size)",
    )
    if not m.preset:
        _require(not m.shape, "model.shape only applies with model.preset")
        return
    hint = suggest(m.preset, list(PRESETS))
    known = f" (did you mean {hint!r}?)" if hint else f"; known: {', '.join(PRESETS)}"
    _require(m.preset in PRESETS, f"unknown model.preset {m.preset!r}{known}")
    try:
        PRESETS[m.preset].check_shape(m.shape, m.preset)
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    if not m.path:
        _require(m.init == "random", "model.preset has no weights: set model.init = 'random' (or use model.path)")


def _validate_architecture(m: Model) -> None:
    """An architecture of its own, from scratch: complete, consistent, and not mixed with a folder or preset."""
    _require(
        not m.path and not m.preset,
        "model.dim, n_layers, ... describe a model trained from scratch: "
        "drop model.path and model.preset (or drop the architecture fields)",
    )
    missing = [f"model.{f}" for f in _ARCHITECTURE if getattr(m, f) is None]
    _require(not missing, f"training from scratch needs {', '.join(missing)} too")
    _require(m.init == "random", "a model trained from scratch has no weights: set model.init = 'random'")
    for f in (*_ARCHITECTURE, "n_kv_heads"):
        value = getattr(m, f)
        _require(value is None or value >= 1, f"model.{f} must be >= 1, got {value}")
    assert m.dim is not None and m.n_heads is not None  # required above
    _require(m.dim % m.n_heads == 0, f"model.dim ({m.dim}) must be a multiple of model.n_heads ({m.n_heads})")
    kv = m.n_kv_heads or m.n_heads
    _require(m.n_heads % kv == 0, f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({kv})")
    _require(
        not m.shape or (len(m.shape) == 3 and min(m.shape) >= 0 and sum(m.shape) == m.n_layers),
        f"model.shape must be P,R,C counts summing to model.n_layers ({m.n_layers}), got {m.shape}",
    )


def _validate_data(d: Data) -> None:
    _require(
        0 <= d.validation_fraction < 1,
        f"data.validation_fraction must be in [0, 1), got {d.validation_fraction}",
    )
    starts = [p.start_step for p in d.phases]
    _require(starts == sorted(set(starts)), f"data.phases start_steps must be increasing, got {starts}")
    sources = [(f"[data.sources][{i}]", s) for i, s in enumerate(d.sources)]
    for j, phase in enumerate(d.phases):
        _require(phase.sources, f"[data.phases][{j}] has no sources")
        sources += [(f"[data.phases][{j}].sources[{i}]", s) for i, s in enumerate(phase.sources)]
    _require(
        not (d.validation_sources and d.validation_fraction > 0),
        "[[data.validation_sources]] are the validation split: set data.validation_fraction = 0 (a hash split "
        "would also hold documents out of training)",
    )
    sources += [(f"[data.validation_sources][{i}]", s) for i, s in enumerate(d.validation_sources)]
    for where, s in sources:
        _require(s.path, f"{where} needs a path")
        _require(s.weight > 0, f"{where} weight must be > 0, got {s.weight}")
        _require(s.shuffle_buffer >= 0, f"{where} shuffle_buffer must be >= 0, got {s.shuffle_buffer}")
        _require(
            s.format == "text" or s.kind in RECORD_SOURCE_KINDS,
            f"{where} format 'prompt_completion' needs records with fields: kind jsonl, parquet or hf, not {s.kind!r}",
        )
        _require(
            s.kind == "hf" or (s.revision is None and not s.data_files),
            f"{where} revision and data_files are for kind = 'hf' (a local {s.kind} source is its path)",
        )


def _validate_profiling(cfg: JobConfig) -> None:
    p, steps = cfg.profiling, cfg.training.steps
    for step in p.trace_steps:
        _require(1 <= step <= steps, f"profiling.trace_steps must be in 1..training.steps ({steps}), got {step}")
    _require(
        not p.memory_snapshot or p.trace_steps,
        "profiling.memory_snapshot is written with a trace: set profiling.trace_steps (the steps to record)",
    )
    dump = Path(os.path.abspath(cfg.job.dump_folder))
    traces = Path(os.path.normpath(dump / p.save_folder))
    _require(
        traces == dump or dump in traces.parents,
        f"profiling.save_folder {p.save_folder!r} is outside job.dump_folder ({dump}): traces stay with the run; "
        "give a folder relative to it (default 'profile')",
    )
    checkpoints = Path(os.path.normpath(dump / cfg.checkpoint.folder))
    for folder, what in ((checkpoints, "the checkpoint folder"), (dump / FINAL_MODEL_FOLDER, "the final model folder")):
        _require(
            not _writes_into(traces, folder, dump),
            f"profiling.save_folder {p.save_folder!r} would write into {what} ({folder}): its step-N trace folders "
            "would mix with what the run saves there; choose a folder beside them (default 'profile')",
        )


def _writes_into(traces: Path, folder: Path, dump: Path) -> bool:
    """Traces at or under ``folder``; a checkpoint folder that is the dump folder itself owns only its step-N."""
    if traces == folder:
        return True
    if folder not in traces.parents:
        return False
    return folder != dump or traces.relative_to(dump).parts[0].startswith("step-")


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that types can't express; file existence is left to the trainer."""
    for name, low in _AT_LEAST.items():
        _require(_get(cfg, name) >= low, f"{name} must be >= {low}, got {_get(cfg, name)}")
    for name in _POSITIVE:
        _require(_get(cfg, name) > 0, f"{name} must be > 0, got {_get(cfg, name)}")
    for name in _FRACTIONS:
        _require(0 <= _get(cfg, name) <= 1, f"{name} must be in [0, 1], got {_get(cfg, name)}")
    t, r, o, s = cfg.training, cfg.recurrence, cfg.optimizer, cfg.lr_scheduler
    try:
        grad_accum_steps(t, dp_world=None)
    except ConfigError as err:
        raise ConfigError(f"invalid config: {err}") from None
    _require(
        r.mean_recurrence >= r.start,
        f"recurrence.mean_recurrence ({r.mean_recurrence}) must be >= recurrence.start ({r.start})",
    )
    _require(
        r.backprop_start <= r.backprop_depth,
        f"recurrence.backprop_start ({r.backprop_start}) must be <= backprop_depth ({r.backprop_depth})",
    )
    _require(0 <= o.momentum < 1, f"optimizer.momentum must be in [0, 1), got {o.momentum}")
    _require(
        not cfg.validation.enable or cfg.data.validation_fraction > 0 or cfg.data.validation_sources,
        "validation.enable needs data.validation_fraction > 0 or [[data.validation_sources]] (held-out "
        "documents to validate on)",
    )
    betas = o.adamw_betas
    _require(all(0 <= b < 1 for b in betas), f"optimizer.adamw_betas must be in [0, 1), got {betas}")
    _require(
        s.warmup_fraction + s.decay_fraction <= 1,
        f"lr_scheduler.warmup_fraction + decay_fraction must be <= 1, got {s.warmup_fraction} + {s.decay_fraction}",
    )
    dp_shard = cfg.parallel.dp_shard
    _require(dp_shard == -1 or dp_shard >= 1, f"parallel.dp_shard must be -1 or >= 1, got {dp_shard}")
    spike = t.loss_spike_factor
    _require(spike == 0 or spike > 1, f"training.loss_spike_factor must be 0 (off) or > 1, got {spike}")
    # Beyond the bound a step would run until the watchdog called it a stall.
    for name, values in (
        ("recurrence.mean_recurrence", [r.mean_recurrence]),
        ("validation.recurrences", cfg.validation.recurrences),
    ):
        if not values:
            continue  # no validation.recurrences: no validation
        try:
            check_recurrences(values, name)
        except ValueError as err:
            raise ConfigError(f"invalid config: {err}") from None
    peak = cfg.metrics.peak_flops
    _require(peak is None or peak > 0, f"metrics.peak_flops must be > 0, got {peak}")
    _validate_profiling(cfg)
    _validate_model(cfg.model)
    _validate_data(cfg.data)


def grad_accum_steps(t: Training, dp_world: int | None) -> int:
    """Micro-steps per optimizer step: global_batch_size / (local_batch_size x dp ranks).

    ``dp_world=None`` checks only what holds for every world size (a multiple of local_batch_size).
    """
    per_micro_step = t.local_batch_size * (dp_world or 1)
    global_batch = t.global_batch_size or per_micro_step
    if global_batch < 1 or global_batch % per_micro_step:
        divisor = f"local_batch_size ({t.local_batch_size})"
        if dp_world:
            divisor = f"local_batch_size x data-parallel ranks ({t.local_batch_size} x {dp_world} = {per_micro_step})"
        raise ConfigError(f"training.global_batch_size ({global_batch}) must be a multiple of {divisor}")
    return global_batch // per_micro_step
