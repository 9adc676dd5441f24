"""`train --print-config` shows the resolved config before any file is opened; `--ARRAY.N none` drops an entry."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from titan_recur.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def train(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_recur.train", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_print_config_shows_a_paper_config_whose_model_is_not_converted_yet(tmp_path):
    # A model folder that does not exist (not converted yet): the trainer would refuse it, --print-config must not.
    config, missing = REPO / "train_configs/llama3_2_1b_mixture.toml", str(tmp_path / "not_converted")
    result = train(
        "--config", str(config), "--print-config", "--model.path", missing, "--training.steps", "7", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["training"]["steps"] == 7 and printed["model"]["path"] == missing
    assert [s["name"] for s in printed["data"]["sources"]] == ["fineweb-edu", "sft-general", "sft-math"]
    assert list(tmp_path.iterdir()) == []  # nothing written: no dump folder, no config.json


def test_print_config_output_is_a_config_the_trainer_reads_back(tmp_path):
    result = train(
        "--config", str(REPO / "train_configs/debug_model.toml"), "--print-config", "--data.sources.0", "none"
    )
    assert result.returncode == 0, result.stderr
    saved = tmp_path / "resolved.json"
    saved.write_text(result.stdout)
    assert load_config(str(saved)) == load_config(
        str(REPO / "train_configs/debug_model.toml"), ["--data.sources.0", "none"]
    )


def test_print_config_still_refuses_a_bad_value_in_one_line():
    result = train("--config", str(REPO / "train_configs/debug_model.toml"), "--print-config", "--training.steps", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: invalid config: training.steps must be >= 1, got 0"]


def test_help_documents_print_config_and_dropping_entries():
    result = train("--help")
    assert "--print-config" in result.stdout and "--data.sources.1 none" in result.stdout


def test_dropping_an_inherited_source_renumbers_the_rest():
    cfg = load_config("train_configs/llama3_2_1b_mixture.toml", ["--data.sources.1", "none"])
    assert [s.name for s in cfg.data.sources] == ["fineweb-edu", "sft-math"]
    # Overrides apply in order: after the drop, entry 1 is the former entry 2.
    cfg = load_config(
        "train_configs/llama3_2_1b_mixture.toml", ["--data.sources.0", "none", "--data.sources.1.weight", "0.5"]
    )
    assert [(s.name, s.weight) for s in cfg.data.sources][1] == ("sft-math", 0.5)


def test_dropping_an_entry_of_a_nested_array(tmp_path):
    path = tmp_path / "phases.toml"
    path.write_text(
        textwrap.dedent(
            """
            [model]
            path = "models/x"
            [[data.phases]]
            start_step = 0
            [[data.phases.sources]]
            name = "a"
            path = "a.jsonl"
            [[data.phases.sources]]
            name = "b"
            path = "b.jsonl"
            [[data.phases]]
            start_step = 10
            [[data.phases.sources]]
            name = "c"
            path = "c.jsonl"
            """
        )
    )
    cfg = load_config(str(path), ["--data.phases.0.sources.0", "none"])
    assert [[s.name for s in p.sources] for p in cfg.data.phases] == [["b"], ["c"]]


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--data.sources.2", "none"], "--data.sources.2: data.sources has 2 entries (0..1); nothing to drop"),
        (["--data.sources.0", "keep"], "--data.sources.0 is an entry of data.sources; the only value it takes is "),
        (["--data.sources.0"], "--data.sources.0 needs a value"),
    ],
)
def test_bad_drops_are_one_line_errors(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config("train_configs/debug_model.toml", override)
    assert expected in str(err.value) and "\n" not in str(err.value)
