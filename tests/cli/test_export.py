"""The export command (titan_recur/cli/export.py), hub-ready exports: a model card that parses, transformers_version, --push-to-hub up to the upload call, and
the printed lm_eval command (docs/hf.md)."""

from __future__ import annotations

import contextlib
import importlib
import json
import shlex
from pathlib import Path

import pytest

from titan_recur.cli import export as export_cli

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "assets" / "tiny_llama_recurrent"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_export_is_hub_ready_and_pushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import huggingface_hub
    import transformers
    from huggingface_hub import ModelCard

    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: calls.append((repo_id, kw)))
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "upload_folder",
        lambda self, **kw: calls.append(("upload", kw)) or "https://hub/commit/1",
    )
    out = tmp_path / "hf"
    assert export_cli.main([str(SOURCE), str(out), "--push-to-hub", "someone/tiny-recurrent"]) == 0
    printed = capsys.readouterr().out
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.license == "other" and "depth-recurrent" in card.data.tags
    assert "trust_remote_code=True" in card.text and "num_steps" in card.text and "assets/tiny_llama" in card.text
    assert json.loads((out / "config.json").read_text())["transformers_version"] == transformers.__version__
    assert calls[0] == ("someone/tiny-recurrent", {"private": False, "exist_ok": True, "repo_type": "model"})
    assert calls[1][0] == "upload" and calls[1][1]["folder_path"] == str(out)
    assert calls[1][1]["repo_id"] == "someone/tiny-recurrent" and "uploaded to https://hub/commit/1" in printed
    command = next(line.strip() for line in printed.splitlines() if line.strip().startswith("lm_eval "))
    model_args = shlex.split(command)[shlex.split(command).index("--model_args") + 1]
    assert model_args == f"pretrained={out},trust_remote_code=True,prefix_token_id=2"
    assert f"`{command}`" not in card.text and command.replace(str(out), "someone/tiny-recurrent") in card.text


def test_push_to_hub_refuses_a_bad_repo_id_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert export_cli.main([str(SOURCE), str(tmp_path / "hf"), "--push-to-hub", "no-owner"]) == 2
    assert "needs a Hub repo id OWNER/NAME" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_from_pretrained_verifies_the_manifest(tmp_path: Path) -> None:
    """A flipped byte in the weights is refused; verify_checksums=False and a folder without manifest load
    unverified (``checksums_verified`` False)."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    assert export_cli.main([str(SOURCE), str(out)]) == 0

    def load(folder: Path, **kwargs):
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)

    assert load(out).checksums_verified
    flipped = tmp_path / "flipped"
    shutil.copytree(out, flipped)
    data = bytearray((flipped / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF  # a weight byte: the header still parses
    (flipped / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors: checksum mismatch with manifest.json"):
        load(flipped)
    assert not load(flipped, verify_checksums=False).checksums_verified
    (flipped / "manifest.json").unlink()
    assert not load(flipped).checksums_verified


def hub_errors() -> list:
    """What huggingface_hub raises without a login, with HF_HUB_OFFLINE set, on a 401 and without network (the
    requests, httpx and httpx2 transports of its versions), with the words the one line must hold."""
    from types import SimpleNamespace

    import requests
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    unauthorized = SimpleNamespace(status_code=401, headers={}, request=None)
    errors = [
        (LocalTokenNotFoundError("Token is required (`token=True`), but no token found."), "hf auth login"),
        (HfHubHTTPError("401 Client Error: Unauthorized", response=unauthorized), "hf auth login"),
        (OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled."), "HF_HUB_OFFLINE"),
        (requests.ConnectionError("Max retries exceeded with url: /api/repos/create"), "cannot reach the Hub"),
    ]
    for transport in ("httpx", "httpx2"):
        with contextlib.suppress(ImportError):
            errors.append((importlib.import_module(transport).ConnectError("Name or service not known"), "network"))
    return [
        pytest.param(error, words, id=f"{type(error).__module__}.{type(error).__name__}") for error, words in errors
    ]


@pytest.mark.parametrize(
    "error, words", hub_errors(), ids=lambda v: type(v).__name__ if isinstance(v, Exception) else ""
)
def test_a_failed_push_is_one_line_and_keeps_the_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, error: Exception, words: str
) -> None:
    import huggingface_hub

    def fail(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fail)
    out = tmp_path / "hf"
    assert export_cli.main([str(SOURCE), str(out), "--push-to-hub", "someone/tiny-recurrent"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titan-recur-export: error: "), lines
    assert words in lines[0] and f"hf upload someone/tiny-recurrent {out}" in lines[0], lines[0]
    assert (out / "model.safetensors").is_file()  # the export is kept for a later upload


def trained_run(folder: Path) -> Path:
    """A run folder as the trainer leaves it, in seconds: config.json (a data source, 3 steps), metrics.jsonl and
    the tiny recurrent model as final_model."""
    import shutil

    from titan_recur.config import DataSource, JobConfig, config_to_json

    cfg = JobConfig()
    cfg.model.path = str(SOURCE)
    cfg.data.sources = [DataSource(name="math", path="assets/corpus/math.jsonl", kind="jsonl")]
    cfg.training.steps, cfg.training.seq_len, cfg.training.global_batch_size = 3, 32, 16
    folder.mkdir()
    (folder / "config.json").write_text(config_to_json(cfg))
    (folder / "metrics.jsonl").write_text('{"step": 3, "loss": 2.5, "tokens_seen": 1536}\n')
    shutil.copytree(SOURCE, folder / "final_model")
    return folder


def test_model_card_describes_the_model_its_training_and_results(tmp_path: Path) -> None:
    """The card of a run's final model: its name, source and layer map, shape and depth knobs, the run's data and
    steps, the given eval table, limits and the citation; without a run or a table those sections are left out."""
    from huggingface_hub import ModelCard

    run = trained_run(tmp_path / "run")
    table = tmp_path / "table.md"
    table.write_text(
        "| task | metric | r=1 | r=4 |\n|---|---|---|---|\n| perm_7 | exact_match,none | 0.1250 | 0.5000 |\n"
    )
    out = tmp_path / "tiny-recurrent-hf"
    assert export_cli.main([str(run / "final_model"), str(out), "--eval-table", str(table)]) == 0
    text = ModelCard.load(out / "README.md").text
    assert "# tiny-recurrent-hf" in text and "`assets/tiny_llama`" in text
    assert "prelude: source layers 0; core: source layers 5, 6; coda: source layers 7; dropped: 1, 2, 3, 4" in text
    assert "1 prelude, 2 core, 1 coda" in text and "d 64" in text and "r defaults to 4" in text
    assert "## Training" in text and "math (assets/corpus/math.jsonl)" in text
    assert "3 of 3 steps" in text and "1,536 tokens" in text and "global batch 16" in text and "mean r 32" in text
    assert "| perm_7 | exact_match,none | 0.1250 | 0.5000 |" in text
    assert "## Limits" in text and "@article{mcleish2025retrofitted" in text
    plain = tmp_path / "plain"
    assert export_cli.main([str(SOURCE), str(plain)]) == 0
    text = ModelCard.load(plain / "README.md").text
    assert "## Training" not in text and "| perm_7 |" not in text and "## Limits" in text


def test_a_bad_eval_table_is_refused_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "notes.txt").write_text("not a table\n")
    for table in (tmp_path / "missing.md", tmp_path / "notes.txt"):
        assert export_cli.main([str(SOURCE), str(tmp_path / "hf"), "--eval-table", str(table)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"--eval-table {table}" in lines[0], lines
        assert not (tmp_path / "hf").exists()
