"""Helpers the tests share: torchrun launches (torch.multiprocessing.spawn sometimes SIGABRTs at exit), the debug
run's argv, and tools/ scripts imported as modules."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS_DIR = Path(__file__).resolve().parent / "dist_workers"
OUTPUT_TAIL_CHARS = 8000
DEBUG_CONFIG = str(REPO_ROOT / "train_configs" / "debug_model.toml")


def debug_run_argv(dump: Path, *overrides: str) -> list[str]:
    """`-m titan_recur.train` on the debug config into ``dump``: what follows python or torchrun."""
    return ["-m", "titan_recur.train", "--config", DEBUG_CONFIG, "--job.dump_folder", str(dump), *overrides]


def run_torchrun(
    script_or_module_args: list[str], nproc: int, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc-per-node nproc <args>` from the repo root; raise on failure.

    Args are what follows torchrun's options: a script path and its arguments, or ["-m", module,
    ...]. Workers run with one OpenMP thread, offline HF and the repo root on PYTHONPATH. A non-zero
    exit or a timeout raises AssertionError carrying the tail of the output.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += script_or_module_args
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path, **(env or {})}
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{_tail(exc.stdout, exc.stderr)}") from None
    if proc.returncode != 0:
        raise AssertionError(f"exit code {proc.returncode}: {' '.join(cmd)}\n{_tail(proc.stdout, proc.stderr)}")
    return proc


def _tail(stdout: str | bytes | None, stderr: str | bytes | None) -> str:
    def text(out: str | bytes | None) -> str:
        if isinstance(out, bytes):
            return out.decode(errors="replace")
        return out or ""

    return (
        f"--- stdout (tail) ---\n{text(stdout)[-OUTPUT_TAIL_CHARS:]}\n"
        f"--- stderr (tail) ---\n{text(stderr)[-OUTPUT_TAIL_CHARS:]}"
    )


def load_tool(name: str, module_name: str | None = None) -> ModuleType:
    """tools/<name>.py imported in-process (cheaper than a subprocess), once per test session.

    It runs as the script would see it: tools/ first on sys.path (its sibling imports resolve) and the
    module registered in sys.modules before it runs (dataclasses and pickling look it up there).
    """
    module_name = module_name or f"{name}_tool"
    if module_name not in sys.modules:
        tools = str(REPO_ROOT / "tools")
        spec = importlib.util.spec_from_file_location(module_name, REPO_ROOT / "tools" / f"{name}.py")
        module = sys.modules[module_name] = importlib.util.module_from_spec(spec)
        sys.path.insert(0, tools)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        finally:
            sys.path.remove(tools)
    return sys.modules[module_name]
