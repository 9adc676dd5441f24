"""Helpers for the tests of the commands (titan_recur/cli/)."""

from __future__ import annotations

from collections.abc import Callable


def exit_code(main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """A command's main run in this process as its console script runs it: its exit code, whether main returns
    it (titan_recur/cli/kit.py's run_command) or argparse raises SystemExit (a bad flag)."""
    try:
        return main(argv) or 0
    except SystemExit as exit:
        return int(exit.code or 0)
