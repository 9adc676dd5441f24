"""The run's fingerprint: the settings a checkpoint only makes sense with, stored in each manifest.

On resume the current settings are compared with the checkpoint's. Any difference is refused with
one line listing the fields, unless ``checkpoint.allow_changes`` names it and the field is one whose
change is safe by design (``config.ALLOWED_CHANGES``: what each does is in docs/checkpointing.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_recur.config import ALLOWED_CHANGES, JobConfig, config_to_dict
from titan_recur.models.args import ModelArgs
from titan_recur.storage.manifest import file_checksum
from titan_recur.storage.model_io import TOKENIZER_FILES

# Fields whose change on resume is never allowed (the saved state would contradict them).
FIXED = ("model", "tokenizer", "seed", "optimizer", "lr_scheduler")
# Fields added after checkpoints were first written, with the value every earlier run had.
ADDED_FIELDS = {"attention_mask": "causal"}
_SHOWN_CHANGES = 6
_SHOWN_VALUE = 40


class FingerprintError(ValueError):
    """The run's settings differ from those a checkpoint was written with; one line for the user."""


def run_fingerprint(cfg: JobConfig, model_args: ModelArgs, tokenizer_folder: str | None, global_batch: int) -> dict:
    """Model, tokenizer, seq_len, attention mask, global batch, steps, curriculum, seed, data, optimizer, schedule."""
    data = cfg.data
    sources = [(p.start_step, p.sources) for p in data.phases] or [(0, data.sources)]
    fingerprint = {
        "model": model_args.to_dict(),
        "tokenizer": tokenizer_hash(Path(tokenizer_folder)) if tokenizer_folder else None,
        "seq_len": cfg.training.seq_len,
        "attention_mask": cfg.training.attention_mask,
        "global_batch_size": global_batch,
        "steps": cfg.training.steps,
        "recurrence": config_to_dict(cfg.recurrence),
        "seed": cfg.job.seed,
        "data": {
            "validation_fraction": data.validation_fraction,
            "phases": [
                {"start_step": start, "sources": [_source(s) for s in phase_sources]}
                for start, phase_sources in sources
            ],
            "validation_sources": [_source(s) for s in data.validation_sources],
        },
        "optimizer": config_to_dict(cfg.optimizer),
        "lr_scheduler": config_to_dict(cfg.lr_scheduler),
    }
    return json.loads(json.dumps(fingerprint))  # as the manifest stores it (tuples become lists)


def _source(s: Any) -> dict[str, Any]:
    """What identifies a source's stream and its share (its ``name`` is only a label)."""
    fields = ("kind", "path", "hf_config", "split", "text_field", "sample_by", "weight")
    return {f: getattr(s, f) for f in fields}


def tokenizer_hash(folder: Path) -> str:
    """Checksums of the tokenizer files present in ``folder`` (what ids mean)."""
    return json.dumps({name: file_checksum(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()})


def check_unchanged(saved: dict[str, Any], current: dict[str, Any], allowed: Sequence[str], where: str) -> list[str]:
    """Raise FingerprintError listing the fields that changed and are not allowed; return the allowed ones."""
    saved = {**ADDED_FIELDS, **saved}
    changed = [name for name in current if saved.get(name) != current[name]]
    refused = [name for name in changed if name not in allowed]
    if refused:
        details = [change for name in refused for change in _differences(name, saved.get(name), current[name])]
        shown = ", ".join(details[:_SHOWN_CHANGES]) + (
            f" (+{len(details) - _SHOWN_CHANGES} more)" if len(details) > _SHOWN_CHANGES else ""
        )
        safe = [name for name in refused if name in ALLOWED_CHANGES]
        fixed = [name for name in refused if name not in ALLOWED_CHANGES]
        advice = []
        if safe:
            advice.append(
                f"to resume with the new {', '.join(safe)}, pass --checkpoint.allow_changes "
                f"{','.join(safe)} (docs/checkpointing.md says what each does)"
            )
        if fixed:
            advice.append(
                f"{', '.join(fixed)} cannot change on resume: start a new run from this one's model with "
                "checkpoint.initial_load_path"
            )
        raise FingerprintError(f"{where} was written with other settings: {shown}; {'; '.join(advice)}")
    return changed


def _differences(name: str, old: Any, new: Any) -> list[str]:
    """'steps 30 -> 60', or one entry per differing leaf of a nested field ('model.dim 32 -> 64')."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = list(old) + [k for k in new if k not in old]
        changed = [k for k in keys if old.get(k) != new.get(k)]
        return [d for k in changed for d in _differences(f"{name}.{k}", old.get(k), new.get(k))]
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{name} ({len(old)} entries -> {len(new)})"]
        return [
            d
            for i, (a, b) in enumerate(zip(old, new, strict=True))
            if a != b
            for d in _differences(f"{name}[{i}]", a, b)
        ]
    if name == "tokenizer":
        return ["tokenizer (other tokenizer files)"]
    return [f"{name} {_short(old)} -> {_short(new)}"]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_VALUE else text[: _SHOWN_VALUE - 3] + "..."
