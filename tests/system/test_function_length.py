"""No function of titan_recur/ or tools/ is longer than MAX_LINES: a longer one is several ideas (split it).

Today's long functions are on LONG_FUNCTIONS, a list that only shrinks: a new long function fails, and so do
an allow-listed one that got short (or was removed) and is still listed, and one that grew.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 80
# path:qualified name -> its length when listed. Split one, then drop it here.
LONG_FUNCTIONS = {
    "titan_recur/cli/flops.py:build_parser": 85,
    "titan_recur/cli/generate.py:build_parser": 85,
    "titan_recur/hf/export.py:model_card": 82,
    "titan_recur/hf/modeling_titan_recur.py:TitanRecurForCausalLM.generate": 122,
}


def function_lengths(path: Path) -> dict[str, int]:
    """Qualified name (Class.method, outer.inner) -> lines from ``def`` to the last line of the body."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[prefix + child.name] = int(child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, f"{prefix}{child.name}." if isinstance(child, ast.ClassDef) else prefix)

    visit(ast.parse(path.read_text()), "")
    return lengths


def long_functions() -> dict[str, int]:
    files = [*sorted((REPO / "titan_recur").rglob("*.py")), *sorted((REPO / "tools").rglob("*.py"))]
    return {
        f"{path.relative_to(REPO)}:{name}": length
        for path in files
        for name, length in function_lengths(path).items()
        if length > MAX_LINES
    }


def test_no_new_function_is_longer_than_the_limit():
    new = {name: length for name, length in long_functions().items() if name not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_LINES} lines (split them): {new}"


def test_the_allow_list_only_shrinks():
    """A listed function that is now short, or gone, leaves the list (so it cannot grow back unnoticed); one
    still listed does not grow past its listed length."""
    found = long_functions()
    stale = sorted(name for name in LONG_FUNCTIONS if name not in found)
    assert not stale, f"no longer over {MAX_LINES} lines: remove from LONG_FUNCTIONS: {stale}"
    grown = {name: found[name] for name, listed in LONG_FUNCTIONS.items() if found.get(name, 0) > listed}
    assert not grown, f"longer than LONG_FUNCTIONS lists (split them instead): {grown}"


def test_the_scan_measures_nested_functions_and_methods(tmp_path: Path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    source = tmp_path / "planted.py"
    source.write_text(
        f"class A:\n    def m(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n\ndef f():\n    pass\n"
    )
    assert function_lengths(source) == {"A.m": MAX_LINES + 1, "f": 2}
