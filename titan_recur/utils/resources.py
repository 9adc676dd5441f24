"""The project folders that ship inside the package: train_configs/ and tasks/.

They live in titan_recur/ (the repository's top-level ``train_configs`` and ``tasks`` are links to
them), so a checkout, an editable install and a wheel all read the same files.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def project_folder(name: str) -> Path:
    """``train_configs`` or ``tasks`` of the installed (or checked-out) package."""
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
