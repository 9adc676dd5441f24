"""The flops command (titan_recur/cli/flops.py, tools/flops.py): help, JSON and table output, model folders and
configs, its stated assumptions, one-line errors. The counts themselves: tests/training/test_cost_model.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_util import exit_code
from tests.tiny_models import SMALL
from tests.tiny_models import tiny_args as shared_tiny_args
from titan_recur.models.args import PRESETS, ModelArgs
from titan_recur.storage.model_io import write_model_args
from titan_recur.training.cost_model import document_masking_note, param_counts, training_flops_per_token

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "flops.py"
TINYLLAMA = PRESETS["tinyllama-1.1b"]
TOKENS_PER_STEP = 2**20


def tiny_args(**overrides) -> ModelArgs:
    """tests/training/test_cost_model.py's shape: d 64, GQA 4/2 heads, vocab 256."""
    return shared_tiny_args(256, SMALL, **overrides)


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_help(tool, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--preset" in out and "examples:" in out


def test_cli_json_paper_flops_and_match() -> None:
    result = run_tool(
        "--preset",
        "tinyllama-1.1b",
        "--shape",
        "4,8,4",
        "--max-mean",
        "4",
        "--at-step",
        "20000",
        "--match",
        "tinyllama-1.1b:static",
        "--world-size",
        "64",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["paper_flops"] == pytest.approx(9.664e19, rel=1e-3)
    assert out["full_flops"] > out["paper_flops"]
    static_step = 6 * TOKENS_PER_STEP * 968_976_384
    assert out["matched_steps"]["paper"] == pytest.approx(out["paper_flops"] / static_step, rel=1e-9)
    static_full = TOKENS_PER_STEP * training_flops_per_token(TINYLLAMA.model_args(22, 0, 0), (0, 1), 1024).total
    assert out["matched_steps"]["full"] == pytest.approx(out["full_flops"] / static_full, rel=1e-9)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--preset", "tinyllama-1.1b", "--shape", "10,10,10"], ["30 layers", "22"]),
        (["--preset", "tinyllama-1.1b", "--shape", "4,8"], ["--shape", "expected P,R,C"]),
        (["--preset", "tinyllama-1.1b", "--steps", "10", "--num-steps", "x"], ["--num-steps"]),
        (["--preset", "tinyllama-1.1b", "--steps", "10", "--match", "nonsense"], ["--match"]),
        (["--steps", "10"], ["give --preset", "--model FOLDER or --config FILE"]),  # no silent default model
        (["--model", "/nonexistent", "--shape", "4,8,4"], ["--model"]),
    ],
)
def test_cli_errors_are_one_line(tool, capsys: pytest.CaptureFixture, argv: list[str], words: list[str]) -> None:
    assert exit_code(tool.main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titan-recur-flops: error:")
    assert all(w in lines[0] for w in words), lines[0]


@pytest.fixture(scope="module")
def tool():
    """The flops command in-process (cheaper than a subprocess per case)."""
    from titan_recur.cli import flops

    return flops


def test_cli_config_batch_and_table(tool, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """tokens/step = global_batch_size * seq_len; micro-steps = global / (local * world size)."""
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\npreset = "tinyllama-1.1b"\nshape = [4, 8, 4]\ninit = "random"\n'
        "[training]\nsteps = 100\nlocal_batch_size = 4\nglobal_batch_size = 16\nseq_len = 512\n"
        '[recurrence]\nmean_recurrence = 8\ncurriculum = "linear"\n'
    )
    tool.main(["--config", str(config), "--world-size", "2", "--training.steps", "50", "--table", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert (out["steps"], out["tokens_per_step"], out["micro_steps"], out["seq_len"]) == (50, 16 * 512, 2, 512)
    rows = out["table"]["rows"]
    assert [r["step"] for r in rows] == [5 * i for i in range(11)]
    assert rows[-1]["paper_flops"] == pytest.approx(out["paper_flops"])
    assert out["table"]["other"].startswith("tinyllama-1.1b 22,0,0")
    assert exit_code(tool.main, ["--config", str(config), "--steps", "5"]) == 2
    assert "--config" in capsys.readouterr().err


def test_cli_model_folders(tool, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--model and --match read a converted folder's config.json; the folders share the run's schedule."""
    recurrent, static = tmp_path / "recurrent", tmp_path / "static"
    static_args = tiny_args(n_prelude=4, n_core=0, n_coda=0)
    for folder, args in ((recurrent, tiny_args()), (static, static_args)):
        folder.mkdir()
        write_model_args(args, folder)
    tool.main(
        [
            "--model",
            str(recurrent),
            "--steps",
            "20",
            "--max-mean",
            "4",
            "--seq-len",
            "32",
            "--tokens-per-step",
            str(TOKENS_PER_STEP),
            "--match",
            str(static),
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    static_step = TOKENS_PER_STEP * training_flops_per_token(static_args, (0, 1), 32).total
    assert out["matched_steps"]["full"] == pytest.approx(out["full_flops"] / static_step, rel=1e-9)
    assert out["params"]["total"] == param_counts(tiny_args()).total


def test_cli_prints_its_assumptions_from_the_trainer_defaults(tool, capsys: pytest.CaptureFixture) -> None:
    """Without --config the run is the trainer's defaults: 16 sequences x world size x seq_len per step."""
    from titan_recur.config import Recurrence, Training

    tool.main(["--preset", "tinyllama-1.1b", "--shape", "4,8,4", "--steps", "100", "--world-size", "2", "--json"])
    assumed = json.loads(capsys.readouterr().out)["assumptions"]
    t, r = Training(), Recurrence()
    assert assumed["tokens_per_step"] == t.local_batch_size * 2 * t.seq_len == 16 * 2 * 1024
    assert (assumed["steps"], assumed["world_size"], assumed["seq_len"], assumed["ac_mode"]) == (
        100,
        2,
        1024,
        t.ac_mode,
    )
    assert (
        assumed["curriculum"]
        == f"{r.curriculum} curriculum of the mean r from 1 to {r.mean_recurrence} over 0.75 of the steps"
    )
    assert assumed["backprop_depth"] == r.backprop_depth
    tool.main(["--preset", "tinyllama-1.1b", "--steps", "100"])
    out = capsys.readouterr().out
    assert "assuming (the trainer's defaults and the flags given): 100 steps of 16,384 tokens" in out
    assert assumed["attention_mask"] == "causal" and "document masking" not in out


def test_cli_says_what_document_masking_changes(tool, capsys: pytest.CaptureFixture) -> None:
    """The counts are those of causal attention, and a line says why (the dense mask computes the full square)."""
    config = str(ROOT / "train_configs" / "debug_model.toml")
    tool.main(["--config", config, "--json"])
    causal = json.loads(capsys.readouterr().out)
    tool.main(["--config", config, "--training.attention_mask", "document", "--json"])
    masked = json.loads(capsys.readouterr().out)
    assert masked["assumptions"]["attention_mask"] == "document"
    assert (masked["flops_per_token"], masked["full_flops"]) == (causal["flops_per_token"], causal["full_flops"])
    tool.main(["--config", config, "--training.attention_mask", "document"])
    assert f"  {document_masking_note()}\n" in capsys.readouterr().out
