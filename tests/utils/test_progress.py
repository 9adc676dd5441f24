"""Progress bars: on stderr when it is a terminal, absent otherwise, in conversion, export and the loss sweep."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from titan_recur.convert.surgery import convert, plan_layers, read_source
from titan_recur.eval.sweep import loss_sweep
from titan_recur.hf.export import export_hf
from titan_recur.storage.model_io import load_model
from titan_recur.utils.progress import progress

ASSETS = Path(__file__).resolve().parents[2] / "assets"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(params=[True, False], ids=["tty", "pipe"])
def stderr(request) -> io.StringIO:
    return Terminal() if request.param else io.StringIO()


def test_bar_only_on_a_terminal(stderr, monkeypatch):
    monkeypatch.setattr(sys, "stderr", stderr)  # in the test: pytest resets sys.stderr after fixtures
    assert list(progress(range(5), desc="work", unit="step")) == [0, 1, 2, 3, 4]
    shown = "work:   0%|" in stderr.getvalue() and "0/5 [" in stderr.getvalue()  # cleared when done (leave=False)
    assert shown == stderr.isatty() and (shown or stderr.getvalue() == "")


def test_conversion_export_and_sweep_show_bars(monkeypatch, tiny_hf_checkpoint, tmp_path):
    """On a terminal (off elsewhere: the helper's test above, the one place the check is made)."""
    stderr = Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    source = tiny_hf_checkpoint("llama")
    convert(source, tmp_path / "model", plan_layers(read_source(source).n_layers, shape=(1, 2, 1)))
    model = load_model(tmp_path / "model")
    export_hf(model, tmp_path / "hf", tokenizer_folder=tmp_path / "model")
    batches = [{"input_ids": torch.randint(0, 512, (2, 8)), "labels": torch.randint(0, 512, (2, 8))}] * 3
    report = loss_sweep(model, iter(batches), [1, 2], "cpu", num_batches=3)
    assert set(report["loss"]) == {"1", "2"}
    text = stderr.getvalue()
    bars = ["convert:", "tensor", "export:", "loss at r=1,2:", "/3 ["]
    assert all(bar in text for bar in bars), text
