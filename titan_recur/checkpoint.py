"""DCP checkpoints: every piece of training state, written atomically, resumed from the latest complete step.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/`` (DCP shards + ``.metadata``). A step is written
into ``step-<N>.partial`` and renamed once every rank has finished, so a crash mid-save leaves only a
``.partial`` folder, which is never loaded (it is reported on resume and removed by the next save).
See docs/checkpointing.md.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

STEP_PATTERN = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"
# DCP warns on every save/load without a process group; one process is a supported way to train here.
_NO_PROCESS_GROUP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


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
    """State that differs per rank (dataloader position, RNG), stored as one pickled blob under ``rank_<r>``.

    A blob, because DCP loads only the keys of the ``state_dict()`` it is given as a template, and a
    fresh object's template (a dataloader not yet iterated) lacks most of the saved structure.
    Loading reads the entry named by ``key``: after a world-size change a rank can read another's.
    """

    def __init__(self, key: str, obj: Any) -> None:
        self.key, self.obj = key, obj

    def state_dict(self) -> dict[str, Any]:
        return {self.key: pickle.dumps(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(pickle.loads(state_dict[self.key]))


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
    """Complete step numbers (ascending) and leftover incomplete folders (``*.partial``, or no ``.metadata``)."""
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
    """Saves and loads ``states`` (name -> Stateful) with DCP; all ranks call save/wait/load together.

    With ``async_mode="async"`` a save stages the state in memory and writes it in a background thread
    (on its own gloo group, so its collectives never interleave with training's); the folder is
    renamed complete when the next save starts or at :meth:`wait`, which the trainer calls before exiting.
    """

    def __init__(
        self,
        folder: str | Path,
        states: dict[str, Stateful],
        *,
        interval: int,
        keep_latest_k: int,
        async_mode: str = "disabled",
    ) -> None:
        self.folder = Path(folder)
        self.states = states
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self._async_group = dist.new_group(backend="gloo") if async_mode == "async" and dist.is_initialized() else None
        self._pending: tuple[int, Future] | None = None

    def step_folder(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def save(self, step: int) -> None:
        """Write step-<step> (in the background with async_mode="async"; one save in flight at most)."""
        self.wait()
        partial = self._partial(step)
        if _is_rank0():
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        _barrier()
        if self.async_mode == "async":
            with _quiet_without_process_group():
                future = dcp.async_save(self.states, checkpoint_id=str(partial), process_group=self._async_group)
            self._pending = (step, future)
        else:
            with _quiet_without_process_group():
                dcp.save(self.states, checkpoint_id=str(partial))
            self._complete(step)

    def wait(self) -> None:
        """Finish the save in flight, if any, and mark its folder complete."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        future.result()
        self._complete(step)

    def _partial(self, step: int) -> Path:
        final = self.step_folder(step)
        return final.with_name(final.name + PARTIAL_SUFFIX)

    def _complete(self, step: int) -> None:
        """Once every rank has written its shards, atomically rename step-<N>.partial to step-<N>."""
        _barrier()
        if _is_rank0():
            final = self.step_folder(step)
            if final.exists():  # rewound with load_step: move the old folder aside atomically first
                stale = final.with_name(f"{final.name}.replaced{PARTIAL_SUFFIX}")
                shutil.rmtree(stale, ignore_errors=True)
                final.rename(stale)
            self._partial(step).rename(final)
            self._purge()
        _barrier()

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
            later = [s for s in found.complete if s > load_step]
            if later:
                _log_rank0(
                    f"warning: resuming from step {load_step} while later checkpoints {later} exist; without "
                    "checkpoint.load_step a rerun would resume from the latest of them"
                )
            return load_step
        return found.complete[-1] if found.complete else None

    def latest_step(self) -> int | None:
        complete = scan_checkpoints(self.folder).complete
        return complete[-1] if complete else None

    def saved_world_size(self, step: int) -> int:
        """How many ranks wrote step-<step>: the number of ``rank_<r>`` entries of its rank-local states."""
        names = "|".join(re.escape(n) for n, s in self.states.items() if isinstance(s, RankLocalState))
        pattern = re.compile(rf"^(?:{names})\.rank_(\d+)$")
        keys = read_metadata(self.step_folder(step)).state_dict_metadata
        return len({m.group(1) for key in keys if (m := pattern.match(key))})

    def load(self, step: int, names: list[str] | None = None) -> None:
        """Load the given states (default all) from step-<step>; failures become one clear line."""
        states = {name: self.states[name] for name in (names or list(self.states))}
        load_from(self.step_folder(step), states)


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of a checkpoint folder; a missing or unreadable file is one clear line."""
    file = path / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"{path}: not a complete DCP checkpoint (no .metadata)")
    try:
        with _quiet_without_process_group():
            return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise CheckpointError(f"{file}: unreadable (truncated or corrupt?): {_describe(err)}") from err


def load_from(path: Path, states: dict[str, Stateful]) -> None:
    """dcp.load ``states`` from a checkpoint folder; a shape mismatch or missing tensor is one clear line."""
    read_metadata(path)
    try:
        with _quiet_without_process_group():
            dcp.load(states, checkpoint_id=str(path))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot load checkpoint: {_describe(err)}") from err


def _describe(err: BaseException) -> str:
    """One line: the first rank's underlying error for DCP's multi-rank exception, else the error itself."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def _quiet_without_process_group() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP_WARNING)
        yield


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _log_rank0(message: str) -> None:
    if _is_rank0():
        print(f"[checkpoint] {message}", flush=True)
