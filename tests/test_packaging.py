"""The wheel: what it ships, its metadata, and its console scripts run from an install, not the checkout.

The wheel is built from this checkout and installed by pip (--no-deps --target) into a temporary
folder whose scripts run with that folder first on the path (the dependencies are the test
environment's). The full check, a fresh virtual environment with the pinned dependencies and one
command of each kind, is tools/check_wheel.sh (a step of .ci/run).
"""

from __future__ import annotations

import ast
import email
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import titan_recur
from titan_recur.resources import find_config, project_folder

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "titan-recur-train": "titan_recur.train:main",
    "titan-recur-eval": "titan_recur.eval.__main__:main",
    "titan-recur-convert": "titan_recur.tools.convert_hf:main",
    "titan-recur-export": "titan_recur.tools.export_hf:main",
    "titan-recur-flops": "titan_recur.tools.flops:main",
    "titan-recur-prepare-data": "titan_recur.tools.prepare_data:main",
    "titan-recur-analyze-layers": "titan_recur.tools.analyze_layers:main",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "-w", str(out), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    (path,) = out.glob("titan_recur-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return target


def run_installed(installed: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """A console script of the install, from a folder outside the checkout, its package first on the path."""
    env = {**os.environ, "PYTHONPATH": str(installed), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([str(installed / "bin" / argv[0]), *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_wheel_ships_the_package_configs_tasks_tools_and_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(REPO)) for p in (REPO / "titan_recur").rglob("*.py")}
    for folder, pattern in (("train_configs", "**/*.toml"), ("tasks", "*.yaml"), ("tools", "*.py")):
        expected |= {f"titan_recur/{p.relative_to(REPO)}" for p in (REPO / folder).glob(pattern)}
    assert expected <= names, sorted(expected - names)
    assert "titan_recur/train_configs/base/paper.toml" in names and "titan_recur/tasks/gsm8k_cot_recur.yaml" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "assets/")) for n in names)


def test_wheel_metadata_and_version(wheel):
    archive = zipfile.ZipFile(wheel)
    info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.message_from_string(archive.read(info).decode())
    assert meta["Version"] == titan_recur.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Topic :: Scientific/Engineering :: Artificial Intelligence" in meta.get_all("Classifier")
    assert any(url.startswith("Paper, https://arxiv.org/abs/2511.07384") for url in meta.get_all("Project-URL"))
    assert set(meta.get_all("Provides-Extra")) >= {"eval", "wandb", "dev"}
    entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    for script, target in SCRIPTS.items():
        assert f"{script} = {target}" in entry_points


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_console_script_has_its_main(script):
    """Each entry point names a main() of the file it maps to (tools/ in the checkout)."""
    module, func = SCRIPTS[script].split(":")
    parts = module.split(".")[1:]
    path = REPO.joinpath("tools", *parts[1:]) if parts[0] == "tools" else REPO.joinpath("titan_recur", *parts)
    tree = ast.parse(path.with_suffix(".py").read_text())
    assert func in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_console_scripts_run_from_the_install(installed, tmp_path):
    """Outside the checkout: the shipped configs (with their extends) and task yaml are found."""
    flops = run_installed(installed, tmp_path, "titan-recur-flops", "--config", "train_configs/tinyllama_cc_math.toml",
                          "--world-size", "64", "--model.path", "none", "--model.init", "random", "--json")
    assert flops.returncode == 0, flops.stderr
    assert '"steps": 50000' in flops.stdout and "tinyllama-1.1b 4,8,4" in flops.stdout
    convert = run_installed(installed, tmp_path, "titan-recur-convert", str(REPO / "assets" / "tiny_llama"),
                            str(tmp_path / "out"), "--shape", "1,2,1", "--dry-run")
    assert convert.returncode == 0 and "dry run: nothing written" in convert.stdout, convert.stderr
    assert {p.name for p in (installed / "bin").iterdir()} == set(SCRIPTS)  # each one runs in tools/check_wheel.sh
    where = subprocess.run(
        [sys.executable, "-c", "import titan_recur.eval.__main__ as m, titan_recur; print(titan_recur.__file__); "
         "print(m.PROJECT_TASKS)"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(installed)}, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert where == [str(installed / "titan_recur" / "__init__.py"), str(installed / "titan_recur" / "tasks")]
    assert (installed / "titan_recur" / "tasks" / "gsm8k_cot_recur.yaml").is_file()


def test_checkout_resources_are_the_top_level_folders(tmp_path, monkeypatch):
    assert project_folder("train_configs") == REPO / "train_configs"
    assert project_folder("tasks") == REPO / "tasks"
    monkeypatch.chdir(tmp_path)
    assert find_config("train_configs/debug_model.toml") == str(REPO / "train_configs" / "debug_model.toml")
    assert find_config("base/paper.toml") == str(REPO / "train_configs" / "base" / "paper.toml")
    (tmp_path / "train_configs").mkdir()
    (tmp_path / "train_configs" / "debug_model.toml").write_text("")
    assert find_config("train_configs/debug_model.toml") == "train_configs/debug_model.toml"  # a local file wins
    assert find_config("nope.toml") == "nope.toml" and find_config("/abs/nope.toml") == "/abs/nope.toml"
