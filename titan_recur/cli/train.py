"""``python -m titan_recur.train`` / ``titan-recur-train``: train from a TOML config (titan_recur/training/trainer.py),
or check every input and print the plan (``--check``). Every failure the user can act on is one line on stderr,
with the exit code docs/checkpointing.md lists."""

from __future__ import annotations

import os
import re
import sys

import torch.distributed as dist

from titan_recur.config import ConfigError, JobConfig, parse_args
from titan_recur.data.loader import DataError
from titan_recur.storage.checkpoint import CheckpointError, CheckpointWriteError
from titan_recur.training import preflight
from titan_recur.training.trainer import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_IO_FAILURE,
    EXIT_NONFINITE,
    NonFiniteError,
    Trainer,
)
from titan_recur.training.watchdog import EXIT_STALLED

# Bad input found before training (exit 2); FileNotFoundError before its parent OSError (exit 1).
_BAD_INPUT = (ConfigError, CheckpointError, FileNotFoundError, NotADirectoryError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """Train; every failure the user can act on is one line on stderr (prefixed by the rank when several)."""
    argv = sys.argv[1:] if argv is None else argv
    force = "--force" in argv  # start over where an earlier run finished (preflight.check_finished_run)
    try:
        check, argv = preflight.split_check_args([arg for arg in argv if arg != "--force"])
        cfg = parse_args(argv)
    except ConfigError as err:  # the same command line on every rank: said once
        if int(os.environ.get("RANK", 0)) == 0:
            report_error(str(err))
        return EXIT_BAD_INPUT
    if check is not None:
        return preflight.main_check(cfg, check, force)
    trainer = None
    try:
        trainer = Trainer(cfg, force)
        return trainer.train()
    except KeyboardInterrupt:
        return report_interrupt(trainer)
    except Exception as err:
        if trainer is not None and trainer.preemption.stopped_at_once:  # a save broken by the second Ctrl-C
            return report_interrupt(trainer)
        code = exit_code(err, training=trainer is not None and trainer.training)
        if code is None:  # a bug: its traceback
            raise
        if not getattr(err, "said_by_rank0", False) or int(os.environ.get("RANK", 0)) == 0:
            report_error(describe_failure(err, code, trainer, cfg))
        return code
    finally:
        if trainer is not None:
            trainer.close()


def exit_code(err: Exception, training: bool) -> int | None:
    """The exit code of a failure the user can act on (docs/checkpointing.md); None for a bug.

    Before training, any ValueError is bad input; once the loop runs, only data and checkpoint errors are.
    """
    if isinstance(err, NonFiniteError):
        return EXIT_NONFINITE
    if isinstance(err, CheckpointWriteError):
        return EXIT_IO_FAILURE
    if isinstance(err, (CheckpointError, DataError)) or (not training and isinstance(err, _BAD_INPUT)):
        return EXIT_BAD_INPUT
    if isinstance(err, OSError):
        return EXIT_IO_FAILURE
    if isinstance(err, RuntimeError) and _is_collective_failure(err):
        return EXIT_STALLED
    return None


def describe_failure(err: Exception, code: int, trainer: Trainer | None, cfg: JobConfig) -> str:
    """The error line: where it happened (the step, the latest checkpoint) when the loop was running."""
    training = trainer is not None and trainer.training
    where, last_good = describe_position(trainer)
    if code == EXIT_STALLED:
        reason = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip()).splitlines()[0]  # gloo's source location
        return (
            f"a collective failed {where}: {reason} (parallel.timeout_s = {cfg.parallel.timeout_s:g}): another "
            f"rank stopped, crashed or hung; exiting with {EXIT_STALLED}"
        )
    if isinstance(err, (NonFiniteError, CheckpointWriteError)):
        return str(err)
    if code == EXIT_IO_FAILURE:
        return f"I/O failure {where}: {err}{last_good}"
    return f"{where}: {err}{last_good}" if training else str(err)


def report_interrupt(trainer: Trainer | None) -> int:
    where, last_good = describe_position(trainer)
    report_error(f"interrupted {where} (Ctrl-C): stopped at once, nothing of this step saved{last_good}")
    return EXIT_INTERRUPTED


def describe_position(trainer: Trainer | None) -> tuple[str, str]:
    """("before training", "") or, once the loop runs, ("at step N", "; latest complete checkpoint: FOLDER")."""
    if trainer is None or not trainer.training:
        return "before training", ""
    latest = trainer.checkpointer.latest_step()
    folder = "none" if latest is None else trainer.checkpointer.step_folder(latest)
    return f"at step {trainer.step}", f"; latest complete checkpoint: {folder}"


def report_error(message: str) -> None:
    """One line on stderr in one write (so the lines of several ranks never interleave)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    prefix = f"[rank {os.environ.get('RANK', 0)}] " if world > 1 else ""
    sys.stdout.flush()
    sys.stderr.write(f"{prefix}error: {' '.join(message.split())}\n")
    sys.stderr.flush()


def _is_collective_failure(err: RuntimeError) -> bool:
    """A timeout or a lost peer in gloo/NCCL (not a bug in the training code)."""
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        marker in text for marker in ("Timed out", "Connection closed by peer", "Connection reset by peer")
    )


if __name__ == "__main__":
    sys.exit(main())
