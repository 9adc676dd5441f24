"""torch.profiler traces and memory snapshots of chosen training steps ([profiling], docs/benchmarks.md).

Each traced step is profiled on its own (start before the step, stop after it): the trace holds
exactly that step, forward, backward and optimizer labelled, and nothing is recorded between traced
steps. Files go under ``job.dump_folder/<save_folder>/step-N/``, one set per rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from titan_recur.config import Profiling

# Entries the CUDA allocator keeps for a snapshot: enough for several steps of a 1B model.
MEMORY_HISTORY_ENTRIES = 100_000


def trace_path(folder: Path, step: int, rank: int) -> Path:
    """The Chrome / Perfetto trace of ``step`` on ``rank`` (open in ui.perfetto.dev or chrome://tracing)."""
    return folder / f"step-{step}" / f"rank{rank}_trace.json"


class StepProfiler:
    """Profiles the steps of ``cfg.trace_steps``; a no-op for every other step."""

    def __init__(self, cfg: Profiling, dump_folder: Path, rank: int, device: torch.device) -> None:
        self.steps = set(cfg.trace_steps)
        self.memory = cfg.memory_snapshot
        self.folder = dump_folder / cfg.save_folder
        self.rank = rank
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: a trace (and memory) of it when it is a chosen step."""
        if step not in self.steps:
            yield
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.memory and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        with profile(activities=activities, record_shapes=True, profile_memory=self.memory) as prof:
            yield
        self._write(prof, step)

    def _write(self, prof: profile, step: int) -> None:
        out = trace_path(self.folder, step, self.rank)
        out.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out))
        if self.memory and self.cuda:
            # The allocator's history of the step: drag into pytorch.org/memory_viz.
            torch.cuda.memory._dump_snapshot(str(out.parent / f"rank{self.rank}_memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        elif self.memory:
            # No allocator history on CPU: the operators by the memory they allocated.
            table = prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=40)
            (out.parent / f"rank{self.rank}_memory.txt").write_text(table + "\n")
        if self.rank == 0:
            print(f"[titan_recur] profile of step {step} written to {out.parent}", flush=True)


# The labelled phases of a training step, in order: trace ranges and `PhaseTimer`'s keys.
STEP_PHASES = ("forward", "backward", "optimizer")


class PhaseTimer:
    """Each phase of the training step is a `record_function` range (what a trace labels); when ``enabled``,
    its seconds are also summed: CUDA events on a GPU (read in ``seconds``, so the step itself never waits
    for the device), the wall clock on a CPU, where kernels run as they are called."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = False
        self._wall: dict[str, float] = dict.fromkeys(STEP_PHASES, 0.0)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in STEP_PHASES:
            raise ValueError(f"step phases are {STEP_PHASES}, got {name!r}")
        with record_function(name):
            if not self.enabled:
                yield
            elif self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self._events.append((name, start, end))
            else:
                began = time.perf_counter()
                yield
                self._wall[name] += time.perf_counter() - began

    def seconds(self) -> dict[str, float]:
        """Seconds per phase since the last ``reset``, every phase listed."""
        totals: dict[str, float] = {name: self._wall[name] for name in STEP_PHASES}
        if self._events:
            torch.cuda.synchronize()
        for name, start, end in self._events:
            totals[name] += start.elapsed_time(end) / 1000
        return totals

    def reset(self) -> None:
        self._wall = dict.fromkeys(STEP_PHASES, 0.0)
        self._events.clear()
