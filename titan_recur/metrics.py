"""Training metrics: one console line per log step, TensorBoard scalars and metrics.jsonl (rank 0 only)."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def max_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib / 2**20 if sys.platform != "darwin" else rss_kib / 2**30


class MetricsLogger:
    """Writes each record to console, TensorBoard and JSON lines; no-ops on ranks other than 0."""

    def __init__(self, dump_folder: str | Path, *, enabled: bool, tensorboard: bool, jsonl: bool) -> None:
        self.enabled = enabled
        self.writer = None
        self.jsonl_file = None
        if not enabled:
            return
        dump_folder = Path(dump_folder)
        dump_folder.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(dump_folder / "tb"))
        if jsonl:
            self.jsonl_file = open(dump_folder / "metrics.jsonl", "a", buffering=1)

    def log(self, record: dict[str, Any], console: str) -> None:
        if not self.enabled:
            return
        print(console, flush=True)
        step = record["step"]
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.writer.add_scalar(key.replace(".", "/"), value, step)
            self.writer.flush()
        if self.jsonl_file is not None:
            self.jsonl_file.write(json.dumps(_jsonable(record)) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl_file is not None:
            self.jsonl_file.close()


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats become null so every line is strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
