"""Progress bars for the long offline commands (conversion, export, data preparation, the loss sweep)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], *, desc: str, unit: str = "it", total: int | None = None) -> Iterable[T]:
    """``items`` with a tqdm bar on stderr when stderr is a terminal; unchanged otherwise (clean logs).

    The bar disappears when done (leave=False): the command's own summary line stays.
    """
    return tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())
