"""What every command shares: its main (a failure the user can act on is one line on stderr and an exit code of
utils/exit_codes.py), errors as one line, list arguments, --force, the model arguments that
``eval.loading.load_checkpoint`` takes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from titan_recur.config import DATA_FORMATS
from titan_recur.storage.checkpoint import CheckpointError
from titan_recur.utils.exit_codes import EXIT_BAD_INPUT, EXIT_IO_FAILURE, EXIT_OK

Errors = tuple[type[BaseException], ...]
# Bad input (exit 2), found before anything is written: titan_recur's errors about an input are ValueErrors
# (ConfigError, ConversionError, DataError, ExportError, ...) or CheckpointErrors; ImportError is a missing
# optional extra (lm_eval).
BAD_INPUT: Errors = (ValueError, FileNotFoundError, NotADirectoryError, ImportError, CheckpointError)
# An I/O failure (exit 1): the output could not be written (a full disk); nothing is left half written.
IO_FAILURE: Errors = (OSError,)


def error_line(prog: str, message: object) -> str:
    """The one line of every command's error: its name, then the message with its line breaks joined."""
    return f"{prog}: error: {' '.join(str(message).split())}\n"


def run_command(
    prog: str, work: Callable[[], object], bad_input: Errors = BAD_INPUT, io_failure: Errors = IO_FAILURE
) -> int:
    """Every command's main: run ``work``; a failure the user can act on is one line on stderr and its exit
    code, any other exception (a bug) its traceback. A command widens a tuple where its own errors need it."""
    try:
        work()
    except bad_input as err:
        sys.stderr.write(error_line(prog, err))
        return EXIT_BAD_INPUT
    except io_failure as err:
        sys.stderr.write(error_line(prog, err))
        return EXIT_IO_FAILURE
    return EXIT_OK


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, error_line(self.prog, message))


def int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; bounds are each command's (e.g. ``utils.limits.check_recurrences``)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """'1e-2,1e-3' -> [0.01, 0.001]."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def add_force(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"replace {what} of an earlier run of this command (never a file of another kind)",
    )


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """--checkpoint, --model-config, --tokenizer, --unverified: what ``load_checkpoint`` and
    ``default_tokenizer_folder`` take."""
    parser.add_argument(
        "--checkpoint", required=True, help="model folder (config.json + model.safetensors) or DCP step folder"
    )
    parser.add_argument("--model-config", help="model folder giving the architecture of a DCP step folder")
    parser.add_argument("--tokenizer", help="folder with the tokenizer files (default: the model folder)")
    parser.add_argument(
        "--unverified",
        action="store_true",
        help="load a model folder or DCP step folder that has no manifest.json, its files unchecked (titan_recur "
        "seals every folder it writes; a missing manifest means it was deleted or hand-made)",
    )


def add_record_arguments(parser: argparse.ArgumentParser, records: str = "--data records") -> None:
    """--text-field and --format: which field of a jsonl/parquet record holds the text, and whether records are
    plain text or prompt/completion pairs (the names a DataSource takes)."""
    parser.add_argument("--text-field", default="text", help="record field holding the text (default: text)")
    parser.add_argument(
        "--format",
        dest="data_format",
        choices=DATA_FORMATS,
        default="text",
        help=f"{records}: 'text' (loss on every token) or 'prompt_completion' (fields prompt and completion; "
        "the loss on the completions only, e.g. a task's answers) (default: text)",
    )
