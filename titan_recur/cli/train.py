"""``python -m titan_recur.train`` / ``titan-recur-train``: train from a TOML config (titan_recur/training/trainer.py),
or check every input and print the plan (``--check``). Every failure the user can act on is one line on stderr,
with the exit code docs/checkpointing.md lists."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn

import torch.distributed as dist

from titan_recur.config import ConfigError, JobConfig, parse_args
from titan_recur.data.loader import DataError
from titan_recur.storage.checkpoint import CheckpointError, CheckpointWriteError
from titan_recur.training import cost_model, preflight
from titan_recur.training.trainer import NonFiniteError, Trainer
from titan_recur.utils.exit_codes import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_IO_FAILURE, EXIT_NONFINITE, EXIT_STALLED

# Bad input found before training (exit 2); FileNotFoundError before its parent OSError (exit 1).
_BAD_INPUT = (ConfigError, CheckpointError, FileNotFoundError, NotADirectoryError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """Train; every failure the user can act on is one line on stderr (prefixed by the rank when several)."""
    try:
        flags, rest = TrainFlags().parse_known_args(sys.argv[1:] if argv is None else argv)
        check = check_options(flags)
        cfg = parse_args(rest)
    except ConfigError as err:  # the same command line on every rank: said once
        if int(os.environ.get("RANK", 0)) == 0:
            report_error(str(err))
        return EXIT_BAD_INPUT
    if check is not None:
        return preflight.main_check(cfg, check, flags.force)
    trainer = None
    try:
        trainer = Trainer(cfg, flags.force)
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


class TrainFlags(argparse.ArgumentParser):
    """The trainer's own flags (--force, --check and its options); the rest of the command line is the config's
    (--config, --section.key VALUE, --help: config.parse_args). Its errors are ConfigErrors, said once."""

    def __init__(self) -> None:
        super().__init__(add_help=False, allow_abbrev=False)
        self.add_argument("--force", action="store_true")  # start over where an earlier run finished
        self.add_argument("--check", action="store_true")
        self.add_argument("--world-size", type=int)
        self.add_argument("--assume-mfu", type=float)
        self.add_argument("--gpu")

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"command line: {message}")


def check_options(flags: argparse.Namespace) -> preflight.CheckOptions | None:
    """--check's options (None without --check, which refuses them); the world size defaults to torchrun's."""
    given = [
        f"--{name.replace('_', '-')}"
        for name in ("world_size", "assume_mfu", "gpu")
        if getattr(flags, name) is not None
    ]
    if not flags.check:
        if given:
            raise ConfigError(f"command line: {', '.join(given)} only apply with --check")
        return None
    world = flags.world_size if flags.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    mfu = flags.assume_mfu if flags.assume_mfu is not None else preflight.ASSUMED_MFU
    if world < 1 or not 0 < mfu <= 1:
        raise ConfigError(f"command line: --world-size must be >= 1 and --assume-mfu in (0, 1], got {world}, {mfu}")
    if flags.gpu is not None and cost_model.peak_flops(device_name=flags.gpu) is None:
        names = ", ".join(name.lower() for name, _ in cost_model.PEAK_BF16_FLOPS)
        raise ConfigError(
            f"command line: --gpu {flags.gpu!r} is not in the peak table ({names}); set --metrics.peak_flops"
        )
    return preflight.CheckOptions(world, mfu, flags.gpu)


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
