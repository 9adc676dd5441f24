"""The layers of docs/architecture.md: each folder of titan_recur/ imports only folders of lower layers.

Typing-only imports count too (a type annotation that names a higher layer is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "titan_recur"
# Folder (or top-level module) -> layer. A module may import its own folder or any lower layer.
LAYER = {
    "models": 0,
    "utils": 0,
    "config": 1,
    "data": 2,
    "storage": 2,
    "inference": 2,
    "training": 3,
    "eval": 4,
    "convert": 5,
    "hf": 6,
    "cli": 7,
    "train": 8,
    "generate": 8,  # the `python -m titan_recur.train|generate` entry points
}
DATA_FOLDERS = {"train_configs", "tasks"}  # shipped files, no code


# A package's ``python -m`` shim (eval/__main__.py): an entry point, like train.py, on top of every layer.
ENTRY_SHIM = "__main__"


def group(module: str) -> str:
    """titan_recur.storage.model_io -> storage; titan_recur.config -> config; titan_recur -> __init__;
    titan_recur.eval.__main__ -> __main__."""
    if module.endswith("." + ENTRY_SHIM):
        return ENTRY_SHIM
    return module.split(".")[1] if module.count(".") else "__init__"


def layer(group_name: str) -> int:
    return max(LAYER.values()) if group_name == ENTRY_SHIM else LAYER[group_name]


def titan_recur_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every titan_recur import in the file: at import time, call time or for typing."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titan_recur"):
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "titan_recur" else [node.module]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("titan_recur")]
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return "titan_recur." + ".".join(p for p in parts if p != "__init__") if parts != ("__init__",) else "titan_recur"


def library_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def upward_imports(path: Path) -> list[str]:
    me = group(module_name(path))
    if me == "__init__":
        return []  # the package's public re-exports
    return [
        f"{path.relative_to(REPO)}:{line} ({me}) imports {module} ({group(module)})"
        for line, module in titan_recur_imports(path)
        if group(module) not in (me, "__init__") and layer(group(module)) >= layer(me)
    ]


def test_every_folder_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} - DATA_FOLDERS
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert folders | modules == set(LAYER), (folders | modules) ^ set(LAYER)


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_down(path: Path):
    bad = upward_imports(path)
    assert not bad, bad


def test_no_module_imports_a_main_and_only_commands_parse_arguments():
    """A ``__main__`` is an entry shim, never a library (eval/comparison.py imported the eval command's
    task folder from one); argparse belongs to the commands in cli/, which share cli/kit.py."""
    mains = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in [*library_modules(), *sorted((REPO / "tools").glob("*.py"))]
        for line, module in titan_recur_imports(path)
        if module.endswith("." + ENTRY_SHIM)
    ]
    assert not mains, mains
    argparse_users = [
        str(path.relative_to(REPO))
        for path in library_modules()
        if path.parent.name != "cli"
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == "argparse")
    ]
    assert not argparse_users, argparse_users


def import_cycles() -> list[list[str]]:
    """Cycles of the package's module import graph, typing-only imports included (package __init__
    re-exports left out: they import downwards by design)."""
    modules = {module_name(p): p for p in library_modules() if p.name != "__init__.py"}
    graph = {
        name: sorted({m for _, m in titan_recur_imports(path) if m in modules and m != name})
        for name, path in modules.items()
    }
    cycles, state = [], {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for nxt in graph[name]:
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [name, nxt] if nxt in stack else [name, nxt])
            elif nxt not in state:
                visit(nxt, [*stack, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


def test_no_import_cycles_even_for_typing():
    """models/ had blocks <-> cache <-> model, typing only: KVCache.for_model named RecurrentLM and the
    attention context the cache (now RecurrentLM.new_cache and cache.BlockSlot)."""
    assert import_cycles() == []


# Tools that exist to run the Trainer itself (not to borrow helpers from it).
RUNS_THE_TRAINER = {"bench_step.py"}


def test_tests_share_helpers_through_helper_modules_not_other_tests():
    """Shared tiny models, runs and exports are conftest fixtures and tests/*.py helper modules: a test file that
    imports another test file runs (and rebuilds) that file's module fixtures and hides what it depends on."""
    found = [
        f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}"
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1].startswith("test_")
    ]
    assert not found, found


def test_test_file_names_are_unique():
    """tests/ folders have no __init__.py: pytest imports each test file by its bare name, so two files of one name
    (test_x.py in tests/cli/ and in tests/x/) stop the collection of the suite."""
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def test_tools_build_from_config_not_from_the_trainer():
    bad = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted((REPO / "tools").glob("*.py"))
        if path.name not in RUNS_THE_TRAINER
        for line, module in titan_recur_imports(path)
        if module == "titan_recur.training.trainer"
    ]
    assert not bad, bad


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    from titan_recur.training.trainer import Trainer\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from titan_recur.config import Model\n",
        "import titan_recur.storage.model_io\n",
        "from titan_recur import data\n",
    ],
)
def test_the_check_sees_a_planted_upward_import(source: str):
    """An upward import planted in the model folder is reported, whether run at call time or for typing only."""
    planted = PACKAGE / "models" / "_planted_upward_import.py"
    planted.write_text(source)
    try:
        assert len(upward_imports(planted)) == 1
    finally:
        planted.unlink()


def test_the_architecture_page_names_every_module():
    """docs/architecture.md lists each module of the package by its path under titan_recur/."""
    page = (REPO / "docs" / "architecture.md").read_text()
    modules = [str(p.relative_to(PACKAGE)) for p in library_modules() if p.name != "__init__.py"]
    missing = [m for m in modules if f"`{m}`" not in page]
    assert not missing, f"docs/architecture.md does not name {missing}"
