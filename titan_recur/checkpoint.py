"""DCP checkpoints: every piece of training state, written atomically, resumed from the latest complete step.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/`` (DCP shards + ``.metadata``). A step is written
into ``step-<N>.partial`` and renamed once every rank has finished, so a crash mid-save leaves only a
``.partial`` folder, which is never loaded (it is reported and removed by the next save).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

STEP_PATTERN = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line for the user."""


class ModelState(Stateful):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """One optimizer's state keyed by parameter FQN, so it reshards across world sizes."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class RankLocalState(Stateful):
    """State that differs per data-parallel rank (dataloader position, RNG), stored under a per-rank key."""

    def __init__(self, key: str, obj: Any) -> None:
        self.key, self.obj = key, obj

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.obj.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.key not in state_dict:
            raise CheckpointError(
                f"checkpoint has no {self.key!r} state: it was written by a different number of ranks "
                "(see docs/checkpointing.md for resuming on another world size)"
            )
        self.obj.load_state_dict(state_dict[self.key])


class TorchRNGState:
    """The global torch RNG (used by the random state init), saved and restored per rank."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


@dataclass
class StepFolders:
    complete: list[int]
    partial: list[Path]


def scan_checkpoints(folder: Path) -> StepFolders:
    """Complete step numbers (ascending) and leftover partial folders."""
    complete, partial = [], []
    if folder.is_dir():
        for entry in folder.iterdir():
            match = STEP_PATTERN.match(entry.name)
            if match and (entry / ".metadata").is_file():
                complete.append(int(match.group(1)))
            elif entry.name.endswith(PARTIAL_SUFFIX) or match:
                partial.append(entry)
    return StepFolders(sorted(complete), sorted(partial))


class CheckpointManager:
    """Saves and loads ``states`` (name -> Stateful) with DCP; all ranks call save/load together."""

    def __init__(self, folder: str | Path, states: dict[str, Stateful], *, interval: int, keep_latest_k: int) -> None:
        self.folder = Path(folder)
        self.states = states
        self.interval = interval
        self.keep_latest_k = keep_latest_k

    def step_folder(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def save(self, step: int) -> Path:
        final = self.step_folder(step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if _is_rank0():
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        _barrier()
        dcp.save(self.states, checkpoint_id=str(partial))
        _barrier()
        if _is_rank0():
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            self._purge()
        _barrier()
        return final

    def _purge(self) -> None:
        found = scan_checkpoints(self.folder)
        for path in found.partial:
            shutil.rmtree(path, ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in found.complete[: -self.keep_latest_k]:
                shutil.rmtree(self.step_folder(step), ignore_errors=True)

    def resolve_load_step(self, load_step: int) -> int | None:
        """The step to resume from: an explicit one (which must exist) or the latest complete one."""
        found = scan_checkpoints(self.folder)
        for path in found.partial:
            _log_rank0(f"ignoring incomplete checkpoint folder {path} (a save did not finish)")
        if load_step >= 0:
            if load_step not in found.complete:
                raise CheckpointError(
                    f"checkpoint.load_step={load_step}: no complete checkpoint {self.step_folder(load_step)} "
                    f"(complete steps: {found.complete or 'none'})"
                )
            return load_step
        return found.complete[-1] if found.complete else None

    def load(self, step: int, names: list[str] | None = None) -> None:
        """Load the given states (default all) from step-<step>; shape mismatches become one clear line."""
        states = {name: self.states[name] for name in (names or list(self.states))}
        load_from(self.step_folder(step), states)


def load_from(path: Path, states: dict[str, Stateful]) -> None:
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a complete DCP checkpoint (no .metadata)")
    try:
        dcp.load(states, checkpoint_id=str(path))
    except CheckpointError:
        raise
    except Exception as err:  # DCP wraps per-rank failures; surface the first line of the cause.
        raise CheckpointError(f"{path}: cannot load checkpoint: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    for line in text.splitlines():
        if "size mismatch" in line or "shape" in line.lower():
            return line.strip()
    return text.splitlines()[0] if text else type(err).__name__


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _log_rank0(message: str) -> None:
    if _is_rank0():
        print(f"[checkpoint] {message}", flush=True)
