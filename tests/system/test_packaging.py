"""The wheel: what it ships, its metadata, its console scripts, and what the install finds outside the checkout.

The wheel is built from this checkout and installed by pip (--no-deps --target) into a temporary
folder, imported from there (the dependencies are the test environment's). Running one command of
each kind from a fresh virtual environment is tools/check_wheel.sh (a step of .ci/run).
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

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

import titan_recur
from titan_recur.utils.resources import find_config, project_folder

REPO = Path(__file__).resolve().parents[2]
# The console scripts as pyproject.toml declares them: name -> "module:function".
SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "-q",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (path,) = out.glob("titan_recur-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def test_wheel_ships_the_package_configs_tasks_and_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(REPO)) for p in (REPO / "titan_recur").rglob("*.py")}
    for folder, pattern in (("train_configs", "**/*.toml"), ("tasks", "*.yaml")):
        expected |= {f"titan_recur/{p.relative_to(REPO)}" for p in (REPO / folder).glob(pattern)}
    assert expected <= names, sorted(expected - names)
    assert "titan_recur/train_configs/base/paper.toml" in names and "titan_recur/tasks/gsm8k_cot_recur.yaml" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "assets/", "tools/", "titan_recur/tools/")) for n in names)


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
    """Each entry point names a main() of a package module."""
    module, func = SCRIPTS[script].split(":")
    path = REPO.joinpath(*module.split("."))
    tree = ast.parse(path.with_suffix(".py").read_text())
    assert func in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def help_texts(runs: list[tuple[list[str], dict[str, str], Path]]) -> list[str]:
    """The --help text of each (command, env, cwd), run side by side, its program name and line wrapping left
    out (a script's name is argparse's default)."""
    procs = [
        subprocess.Popen(
            [*command, "--help"], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command, env, cwd in runs
    ]
    texts = []
    for (command, _, _), proc in zip(runs, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.startswith("usage:"), (command, err[-2000:])
        texts.append(" ".join(out.split()[2:]))
    return texts


# The checkout's tool shims, the console script each runs.
SHIMS = {
    "convert_hf": "titan-recur-convert",
    "export_hf": "titan-recur-export",
    "flops": "titan-recur-flops",
    "prepare_data": "titan-recur-prepare-data",
    "analyze_layers": "titan-recur-analyze-layers",
    "compare": "titan-recur-compare",
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_scripts_run_in_the_editable_install_the_wheel_and_the_checkout(script, installed, tmp_path):
    """--help of each command: the test environment's (editable) script, the wheel's script with only the wheel
    on the path, and in the checkout `python tools/<name>.py` for the tools' shims (the same text)."""
    wheel_env = {**os.environ, "PYTHONPATH": str(installed)}
    runs = [
        ([str(Path(sys.executable).parent / script)], dict(os.environ), tmp_path),  # the editable install's
        ([sys.executable, str(installed / "bin" / script)], wheel_env, tmp_path),
    ]
    shim = next((name for name, s in SHIMS.items() if s == script), None)
    if shim is not None:
        runs.append(([sys.executable, f"tools/{shim}.py"], dict(os.environ), REPO))
    editable, *others = help_texts(runs)
    assert others == [editable] * len(others)


def test_the_install_finds_its_configs_and_tasks(installed, tmp_path):
    """Outside the checkout, the installed package finds the shipped configs (with their extends) and task
    yaml, and pip wrote every console script (tools/check_wheel.sh runs each one from a fresh venv)."""
    assert {p.name for p in (installed / "bin").iterdir()} == set(SCRIPTS)
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import titan_recur; from titan_recur.config import load_config; "
            "from titan_recur.utils.resources import find_config, project_folder; "
            "cfg = load_config(find_config('train_configs/tinyllama_cc_math.toml')); "
            "print(titan_recur.__file__, project_folder('tasks'), cfg.training.steps, cfg.model.preset, "
            "cfg.recurrence.curriculum)",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    package = installed / "titan_recur"
    assert where == [str(package / "__init__.py"), str(package / "tasks"), "50000", "tinyllama-1.1b", "1-sqrt"]
    assert (package / "tasks" / "gsm8k_cot_recur.yaml").is_file()


def test_checkout_resources_are_the_top_level_folders(tmp_path, monkeypatch):
    """The top-level folders users type are the package's own (links), so every install reads one copy."""
    assert project_folder("train_configs") == REPO / "titan_recur" / "train_configs"
    assert (REPO / "train_configs").resolve() == project_folder("train_configs")
    assert (REPO / "tasks").resolve() == project_folder("tasks")
    monkeypatch.chdir(tmp_path)
    package_configs = REPO / "titan_recur" / "train_configs"
    assert find_config("train_configs/debug_model.toml") == str(package_configs / "debug_model.toml")
    assert find_config("base/paper.toml") == str(package_configs / "base" / "paper.toml")
    (tmp_path / "train_configs").mkdir()
    (tmp_path / "train_configs" / "debug_model.toml").write_text("")
    assert find_config("train_configs/debug_model.toml") == "train_configs/debug_model.toml"  # a local file wins
    assert find_config("nope.toml") == "nope.toml" and find_config("/abs/nope.toml") == "/abs/nope.toml"


def test_every_console_script_is_in_the_readme_table_and_the_wheel_check():
    """A command users install is listed where they look for it and run from a fresh venv by the wheel check."""
    readme, wheel_check = (REPO / "README.md").read_text(), (REPO / "tools" / "check_wheel.sh").read_text()
    assert [s for s in SCRIPTS if f"| `{s}` |" not in readme] == []
    assert [s for s in SCRIPTS if f'"$BIN/{s}"' not in wheel_check] == []
