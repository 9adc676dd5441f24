"""The convert command (titan_recur/cli/convert.py, tools/convert_hf.py): --help, a conversion and a dry run, one-line
errors that write nothing. The conversion itself: tests/convert/test_surgery.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.convert_util import converted_logits, hf_logits, input_ids

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "tools" / "convert_hf.py"


def run_cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120)


def test_cli_help():
    result = run_cli("--help")
    assert result.returncode == 0
    for text in ("--shape P,R,C", "--static", "--adapter-init", "--untie-embeddings", "sqrt(2/(5*5280))", "--dry-run"):
        assert text in result.stdout


@pytest.mark.slow
def test_cli_converts_and_dry_run_writes_nothing(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("olmo2")
    dry = run_cli(source, tmp_path / "dry", "--shape", "1,2,1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"dropped +2 layers +source 1-2\n", dry.stdout) and "nothing written" in dry.stdout
    assert list(tmp_path.iterdir()) == []
    result = run_cli(source, tmp_path / "out", "--prelude", "0", "--core", "3,4", "--coda", "5", "--state-init", "zero")
    assert result.returncode == 0, result.stderr
    assert "Olmo2ForCausalLM" in result.stdout and "params total" in result.stdout
    ids = input_ids()
    expected = hf_logits(source, ids, layers=[0, 3, 4, 5])
    torch.testing.assert_close(converted_logits(tmp_path / "out", ids), expected, atol=1e-5, rtol=0)


def test_cli_errors_are_one_line_and_write_nothing(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("llama")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "file").write_text("x")
    result = run_cli(source, tmp_path / "out", "--shape", "4,4,2")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["titan-recur-convert: error: shape 4,4,2 needs 10 layers; the source has 6"]
    result = run_cli(source, tmp_path / "existing", "--shape", "2,2,2")
    assert result.returncode == 2 and "pass --force" in result.stderr and len(result.stderr.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert [p.name for p in (tmp_path / "existing").iterdir()] == ["file"]
