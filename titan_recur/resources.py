"""The project folders that ship with the package: train_configs/, tasks/ and tools/.

In a checkout they are the repository's top-level folders; an installed wheel carries copies inside
the package (pyproject.toml maps them to titan_recur.train_configs, .tasks and .tools).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]


def project_folder(name: str) -> Path:
    """``train_configs``, ``tasks`` or ``tools`` of this checkout, else of the installed package."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / name).is_dir():
        return _CHECKOUT / name
    return Path(str(importlib.resources.files("titan_recur") / name))


def find_config(path: str) -> str:
    """``path`` if it exists, else the shipped config it names (``train_configs/X.toml`` or ``X.toml``).

    So ``--config train_configs/tinyllama.toml`` works from any folder once the wheel is installed.
    """
    given = Path(path)
    if given.exists() or given.is_absolute():
        return path
    parts = given.parts[1:] if given.parts[:1] == ("train_configs",) else given.parts
    shipped = project_folder("train_configs").joinpath(*parts)
    return str(shipped) if parts and shipped.is_file() else path
