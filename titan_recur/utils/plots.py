"""Figures of a quantity vs test recurrence r (log2 x axis): loss vs r, accuracy vs r.

One home for the plot style, used by the offline loss sweep, the harness sweep and the trainer's
TensorBoard validation figure. matplotlib is the optional ``eval`` extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or an ImportError with the install hint."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the plots need matplotlib: pip install -e '.[eval]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_vs_r(series: Mapping[str, Mapping[int, float]], ylabel: str, title: str) -> Any:
    """One line per series ({label: {r: value}}), r on a log2 axis; the caller saves or logs it."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    rs = sorted({r for values in series.values() for r in values})
    for label, values in series.items():
        points = sorted(values.items())
        ax.plot([r for r, _ in points], [v for _, v in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(rs, [str(r) for r in rs])
    ax.set_xlabel("test recurrence r")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def save_figure(fig: Any, path: str | Path) -> Path:
    fig.savefig(path)
    pyplot().close(fig)
    return Path(path)
