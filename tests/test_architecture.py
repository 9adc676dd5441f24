"""The module layers of docs/architecture.md: every titan_recur import points down, tools never import train."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "titan_recur"
# A module may import modules of a lower layer, or of its own package group (models.*, eval.*, hf.*).
LAYER = {
    "models": 0, "resources": 0, "progress": 0,
    "config": 1, "plots": 1,
    "tokenizer": 2, "recurrence": 2, "checkpoint": 2, "fingerprint": 2, "watchdog": 2,
    "data": 3, "flops": 3, "optim": 3,
    "surgery": 4, "parallelize": 4,
    "metrics": 5, "eval": 5,
    "validation": 6, "hf": 6, "analysis": 6, "preflight": 6, "generate": 6, "compare": 6,
    "train": 7, "cli": 7,
}


def group(module: str) -> str:
    """titan_recur.models.io -> models; titan_recur.train -> train."""
    return module.split(".")[1] if module.count(".") else "__init__"


def titan_recur_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every titan_recur import run at import or call time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(child) for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for child in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titan_recur"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("titan_recur")]
    return found


def library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def test_every_library_module_has_a_layer():
    groups = {group("titan_recur." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)) for p in library_modules()}
    assert groups - {"__init__"} <= set(LAYER), groups - set(LAYER)


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_down(path: Path):
    me = group("titan_recur." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    if me == "__init__":
        return  # the package's public re-exports
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for line, module in titan_recur_imports(path)
        if module != "titan_recur" and group(module) != me and LAYER[group(module)] >= LAYER[me]
    ]
    assert not bad, bad


# Tools that exist to run the Trainer itself (not to borrow helpers from it).
RUNS_THE_TRAINER = {"bench_step.py"}


def test_tools_build_from_config_not_from_the_trainer():
    bad = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted((REPO / "tools").glob("*.py")) if path.name not in RUNS_THE_TRAINER
        for line, module in titan_recur_imports(path)
        if module == "titan_recur.train"
    ]
    assert not bad, bad


def test_the_check_sees_a_violation(tmp_path: Path):
    """An upward import (the model importing the trainer) is reported."""
    bad = tmp_path / "model.py"
    bad.write_text("def f():\n    from titan_recur.train import Trainer\n")
    assert titan_recur_imports(bad) == [(2, "titan_recur.train")]
    assert LAYER[group("titan_recur.train")] >= LAYER["models"]
