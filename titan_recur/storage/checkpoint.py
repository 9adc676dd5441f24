"""DCP checkpoints: every piece of training state, written atomically, checked on load, in one lineage.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/`` (DCP shards, ``.metadata`` and
``manifest.json``). A step is written into ``step-<N>.partial``; once every rank has finished, each
rank checksums the shards it wrote, rank 0 writes the manifest (sizes, checksums, the parent step,
the run's fingerprint) and renames the folder. A crash mid-save leaves only a ``.partial`` folder,
which is never loaded (it is reported and removed on resume). Anything else in the way
of a save, or a ``step-<N>`` without ``.metadata``, is renamed ``<name>.incomplete-<time>``: kept, and
no rerun fails on it. Loading checks every file against the manifest first. Rewinding
(``checkpoint.load_step``) moves the later steps to ``abandoned/``, where nothing resumes from them or
deletes them. See docs/checkpointing.md.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar

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

from titan_recur.storage.manifest import (
    MANIFEST_NAME,
    IntegrityError,
    check_files,
    describe_files,
    read_manifest,
    write_manifest,
)

STEP_PATTERN = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"
PRUNED_SUFFIX = ".pruned"  # an old step on its way out: renamed first, so a kill mid-removal leaves no half step
LEFTOVER_SUFFIXES = (PARTIAL_SUFFIX, PRUNED_SUFFIX)
ABANDONED = "abandoned"
_SHARD_PATTERN = re.compile(r"^__(\d+)_\d+\.distcp$")
# DCP warns on every save/load without a process group; one process is a supported way to train here.
_NO_PROCESS_GROUP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line for the user."""


class CorruptCheckpointError(CheckpointError):
    """A file of a checkpoint does not match its manifest (or the manifest is unreadable)."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error); the checkpoints written before are intact."""


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
            elif entry.name.endswith(LEFTOVER_SUFFIXES) or match:
                partial.append(entry)
    return StepFolders(sorted(complete), sorted(partial))


@dataclass
class ResumePoint:
    """The step to resume from, why, and the later (or corrupt) steps to move aside once it is loaded."""

    step: int
    reason: str
    manifest: dict[str, Any] | None
    set_aside: list[int] = field(default_factory=list)
    set_aside_as: str = ""


class CheckpointManager:
    """Saves and loads ``states`` (name -> Stateful) with DCP; all ranks call save/wait/load together.

    With ``async_mode="async"`` a save stages the state in memory and writes it in a background thread
    (on its own gloo group, so its collectives never interleave with training's); the folder is
    sealed and renamed complete at :meth:`wait`, which the trainer calls as soon as every rank's write
    has finished, before the next save and before exiting. ``fingerprint`` (the run's settings) is
    stored in each manifest; ``parent`` is the step this lineage continues from.
    """

    def __init__(
        self,
        folder: str | Path,
        states: dict[str, Stateful],
        *,
        interval: int,
        keep_latest_k: int,
        async_mode: str = "disabled",
        fingerprint: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.states = states
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.fingerprint = fingerprint or {}
        self.parent: int | None = None
        self._async_group = None
        if async_mode == "async" and dist.is_initialized():
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            self._async_group = dist.new_group(backend="gloo", timeout=timeout)
        self._pending: tuple[int, Future] | None = None

    def step_folder(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    # ------------------------------------------------------------------------------------ saving

    def save(self, step: int) -> None:
        """Write step-<step> (in the background with async_mode="async"; one save in flight at most).

        An I/O failure (disk full) on any rank raises CheckpointWriteError on every rank, after the
        incomplete folder was removed; the checkpoints written before are untouched.
        """
        self.wait()
        partial = self._partial(step)
        try:
            _agree(lambda: self._clear_the_way(step) if _is_rank0() else None)
            if self.async_mode == "async":
                # The writer thread warns after the block below has restored the filters: filter it for the
                # process (outside that block, which would undo it).
                warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP_WARNING)
            with _quiet_without_process_group():
                if self.async_mode == "async":
                    self._pending = (  # type: ignore[assignment]
                        step,
                        dcp.async_save(self.states, checkpoint_id=str(partial), process_group=self._async_group),
                    )
                    return
                dcp.save(self.states, checkpoint_id=str(partial))
        except (OSError, CheckpointException) as err:  # DCP raises a rank's failure on every rank
            self._write_failed(step, err)
        self._complete(step)

    def _clear_the_way(self, step: int) -> None:
        """Rank 0, before writing step-<step>: remove its leftover .partial folder (a save that did not finish)
        and set aside anything else where the save goes (an interrupted copy without .metadata, a foreign
        file), kept under another name: else the final rename fails at this step on every rerun."""
        final, partial = self.step_folder(step), self._partial(step)
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial)
        for path in (final, partial):
            if path.exists() or path.is_symlink():
                _log_rank0(f"set aside {path}, in the way of this save, as {_move_aside(path)}")
        partial.mkdir(parents=True)

    def write_finished(self) -> bool:
        """True when a background save is in flight and this rank's part of it has finished."""
        return self._pending is not None and self._pending[1].done()

    def wait(self) -> None:
        """Finish the save in flight, if any, and seal and rename its folder complete."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        try:
            future.result()
        except (OSError, CheckpointException) as err:
            self._write_failed(step, err)
        except RuntimeError as err:  # torch.save's "unexpected pos" on a full disk, raised from the writer thread
            if not _disk_full(self.folder, self._partial(step)):
                raise
            self._write_failed(step, err)
        self._complete(step)

    def _partial(self, step: int) -> Path:
        final = self.step_folder(step)
        return final.with_name(final.name + PARTIAL_SUFFIX)

    def _complete(self, step: int) -> None:
        """Every rank checksums the shards it wrote; rank 0 writes the manifest, renames, purges."""
        partial = self._partial(step)
        try:
            shares = _agree(lambda: describe_files(partial, _own_files(partial)))
            files = {name: entry for share in shares for name, entry in share.items()}
            _agree(lambda: self._publish(step, files) if _is_rank0() else None)
        except OSError as err:
            self._write_failed(step, err)
        self.parent = step

    def _publish(self, step: int, files: dict[str, dict[str, Any]]) -> None:
        partial = self._partial(step)
        world = dist.get_world_size() if dist.is_initialized() else 1
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        write_manifest(
            partial,
            "checkpoint",
            files,
            step=step,
            parent=self.parent,
            world_size=world,
            created=created,
            fingerprint=self.fingerprint,
        )
        partial.rename(self.step_folder(step))
        self._purge()

    def _write_failed(self, step: int, err: BaseException) -> None:
        partial, reason = self._partial(step), _describe(err)
        full = "" if "No space left" in reason else _disk_full(self.folder, partial)
        if dist.is_initialized():  # measured before rank 0 frees the space: every rank's line says "No space left"
            with contextlib.suppress(RuntimeError):  # a broken process group: each rank keeps its own reading
                full = next((f for f in _agree(lambda: full) if f), "")
        if _is_rank0():
            shutil.rmtree(partial, ignore_errors=True)  # free the space the incomplete save took
        latest = self.latest_step()
        last_good = "none" if latest is None else str(self.step_folder(latest))
        raise CheckpointWriteError(
            f"cannot write checkpoint {partial}: {reason}{full} (incomplete folder removed); latest "
            f"complete checkpoint: {last_good}"
        ) from err

    def _purge(self) -> None:
        """Leftover .partial folders, and all but the keep_latest_k newest steps of this lineage; a step folder
        without .metadata (never one of this trainer's: an interrupted copy) is set aside, not deleted."""
        found = scan_checkpoints(self.folder)
        self._remove_partials(found.partial)
        for path in found.partial:
            if not path.name.endswith(LEFTOVER_SUFFIXES):
                _log_rank0(f"set aside {path}, not a complete checkpoint, as {_move_aside(path)}")
        if self.keep_latest_k > 0:
            for step in found.complete[: -self.keep_latest_k]:
                folder = self.step_folder(step)
                pruned = folder.rename(folder.with_name(folder.name + PRUNED_SUFFIX))
                shutil.rmtree(pruned, ignore_errors=True)

    @staticmethod
    def _remove_partials(leftovers: list[Path]) -> None:
        """Rank 0: the .partial folders of saves that did not finish (never loaded) and the .pruned ones whose removal
        was cut short. Removed on resume too, before the run writes anything: one that filled the disk (an async save
        in flight when the run failed otherwise) made every rerun fail before training, when only the next save
        removed it."""
        for path in leftovers:
            if path.name.endswith(LEFTOVER_SUFFIXES) and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)

    # ---------------------------------------------------------------------------------- resuming

    def choose_resume(self, load_step: int, *, verify: bool, fallback_on_corruption: bool) -> ResumePoint | None:
        """The step to resume from (checked against its manifest on every rank), or None: start fresh.

        ``load_step`` >= 0 rewinds: the later steps are to be set aside (a new branch starts).
        Otherwise the latest complete step; with ``fallback_on_corruption`` a corrupt one is skipped
        for the newest that verifies (and set aside), else it is an error naming that fallback.
        """
        found = scan_checkpoints(self.folder)
        for path in found.partial:
            why = "its removal did not finish" if path.name.endswith(PRUNED_SUFFIX) else "a save did not finish"
            _log_rank0(f"ignoring incomplete checkpoint folder {path} ({why})")
        if _is_rank0():
            self._remove_partials(found.partial)
        if load_step >= 0:
            if load_step not in found.complete:
                raise CheckpointError(
                    f"checkpoint.load_step={load_step}: no complete checkpoint {self.step_folder(load_step)} "
                    f"(complete steps: {found.complete or 'none'})"
                )
            manifest = self._verified(load_step, found.complete, verify, explain="load_step")
            later = [s for s in found.complete if s > load_step]
            return ResumePoint(
                load_step, f"checkpoint.load_step = {load_step}", manifest, later, f"rewind-to-step-{load_step}"
            )
        corrupt: list[int] = []
        for step in reversed(found.complete):
            try:
                explain = "" if fallback_on_corruption else "latest"
                manifest = self._verified(step, found.complete, verify, explain=explain)
            except CorruptCheckpointError as err:
                if not fallback_on_corruption:
                    raise
                _log_rank0(f"{err}: falling back to an earlier step (checkpoint.fallback_on_corruption)")
                corrupt.append(step)
                continue
            if not corrupt:
                return ResumePoint(step, "the latest complete checkpoint", manifest)
            reason = f"the newest verified checkpoint (checkpoint.fallback_on_corruption; corrupt: {sorted(corrupt)})"
            return ResumePoint(step, reason, manifest, sorted(corrupt), f"corrupt-after-step-{step}")
        if corrupt:
            raise CorruptCheckpointError(f"no checkpoint in {self.folder} verifies (corrupt: {sorted(corrupt)})")
        return None

    def _verified(self, step: int, complete: list[int], checksums: bool, explain: str) -> dict | None:
        """The manifest of step-<step> after checking its files; a mismatch names the step to fall back to
        (``explain``: "load_step" for an explicit step, "latest" for the automatic choice, "" not at all)."""
        start = time.perf_counter()
        try:
            manifest = verify_checkpoint(self.step_folder(step), checksums=checksums, required=checksums)
        except CorruptCheckpointError as err:
            if not explain:
                raise
            earlier = self._newest_verified([s for s in complete if s < step], checksums)
            hint = "no earlier checkpoint verifies"
            if earlier is not None:
                hint = f"resume from the newest verified checkpoint with --checkpoint.load_step {earlier}"
                hint += ", or set checkpoint.fallback_on_corruption = true" if explain == "latest" else ""
            raise CorruptCheckpointError(f"{err}; {hint}") from None
        if manifest is not None:
            size = sum(entry["bytes"] for entry in manifest["files"].values())
            what = "checksums" if checksums else "sizes"
            _log_rank0(
                f"step-{step}: {what} of {len(manifest['files'])} files ({size / 2**20:.1f} MiB) match "
                f"{MANIFEST_NAME} ({time.perf_counter() - start:.2f} s)"
            )
        return manifest

    def _newest_verified(self, steps: list[int], checksums: bool) -> int | None:
        for step in reversed(steps):
            with contextlib.suppress(CheckpointError):
                verify_checkpoint(self.step_folder(step), checksums=checksums, required=checksums)
                return step
        return None

    def set_aside(self, steps: list[int], label: str) -> Path | None:
        """Move ``steps`` to ``abandoned/<k>-<label>/``: kept, never resumed automatically, never purged."""
        if not steps:
            return None

        def move() -> Path:
            root = self.folder / ABANDONED
            root.mkdir(exist_ok=True)
            destination = root / f"{len(list(root.iterdir())) + 1}-{label}"
            destination.mkdir()
            for step in steps:
                self.step_folder(step).rename(destination / f"step-{step}")
            return destination

        return _agree(lambda: move() if _is_rank0() else None)[0]

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
        """Load the given states (default all) from step-<step> (checked by choose_resume); one-line failures."""
        states = {name: self.states[name] for name in (names or list(self.states))}
        _dcp_load(self.step_folder(step), states)
        self.parent = step


def verify_checkpoint(path: Path, *, checksums: bool = True, required: bool = False) -> dict[str, Any] | None:
    """Check a DCP folder's files against its manifest, every rank reading a share; returns the manifest.

    Sizes are always checked, checksums with ``checksums``. A folder without a manifest (written
    before manifests existed, or copied without it) is an error when ``required``, else unchecked.
    """

    def check() -> dict[str, Any] | None:
        try:
            manifest = read_manifest(path)
        except IntegrityError as err:
            raise CorruptCheckpointError(str(err)) from None
        if manifest is None:
            if required:
                raise CheckpointError(
                    f"{path}: no {MANIFEST_NAME} (written by an older titan_recur, or copied without it); set "
                    "checkpoint.verify = false to load it unchecked"
                )
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        listed = [name for name in manifest["files"] if _owner(name, world) == _rank()]
        mine = sorted({*listed, *_own_files(path)})  # a file on disk the manifest leaves out is refused
        try:
            check_files(path, manifest["files"], mine, checksums)
        except IntegrityError as err:
            raise CorruptCheckpointError(str(err)) from None
        return manifest

    return _agree(check)[0]


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


def load_from(path: Path, states: dict[str, Stateful], *, verify: bool = True, required: bool = False) -> None:
    """dcp.load ``states`` from a checkpoint folder, checked against its manifest (if it has one; one is
    ``required`` where a run starts from it: its own checkpoints always have one)."""
    verify_checkpoint(path, checksums=verify, required=required)
    _dcp_load(path, states)


def _dcp_load(path: Path, states: dict[str, Stateful]) -> None:
    """dcp.load with one-line errors (a shape mismatch, a missing tensor)."""
    read_metadata(path)
    try:
        with _quiet_without_process_group():
            dcp.load(states, checkpoint_id=str(path))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot load checkpoint: {_describe(err)}") from err


def _own_files(folder: Path) -> list[str]:
    """The files of a step folder this rank checksums: the shards it wrote (rank 0 also the rest)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    return [name for name in names if _owner(name, world) == _rank()]


def _owner(name: str, world: int) -> int:
    """The rank that reads a file of a step folder: the writer of a shard ``__<rank>_<i>.distcp``, else 0."""
    match = _SHARD_PATTERN.match(name)
    return int(match.group(1)) % world if match else 0


def _disk_full(folder: Path, partial: Path) -> str:
    """'; No space left on device (12 KiB free)' when the file system has less free than a save needs.

    torch.save inside DCP turns the OSError of a full disk into "unexpected pos ...", so look.
    """
    try:
        free = shutil.disk_usage(folder).free
        written = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file()) if partial.is_dir() else 0
    except OSError:
        return ""
    if free > max(written, 1 << 20):
        return ""
    return f"; No space left on device ({free / 1024:.0f} KiB free on the checkpoint file system)"


def _move_aside(path: Path) -> Path:
    """Rename ``path`` to ``<name>.incomplete-<UTC time>``: a name nothing resumes from or purges."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    destination, k = path.with_name(f"{path.name}.incomplete-{stamp}"), 1
    while destination.exists() or destination.is_symlink():
        destination, k = path.with_name(f"{path.name}.incomplete-{stamp}-{k}"), k + 1
    path.rename(destination)
    return destination


def _agree(action: Callable[[], T]) -> list[T]:
    """Run ``action`` on every rank and gather the results; if it failed anywhere, every rank raises the
    first failure, so no rank is left waiting in a collective for one that gave up."""
    result: Any = None
    failure: BaseException | None = None
    try:
        result = action()
    except (OSError, CheckpointError) as err:
        failure = err
    if not dist.is_initialized():
        if failure is not None:
            raise failure
        return [result]
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (result, failure))
    failures = [f for _, f in outcomes if f is not None]
    if failures:
        raise failures[0]
    return [r for r, _ in outcomes]


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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _is_rank0() -> bool:
    return _rank() == 0


def _log_rank0(message: str) -> None:
    if _is_rank0():
        print(f"[checkpoint] {message}", flush=True)
