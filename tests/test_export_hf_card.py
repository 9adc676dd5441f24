"""Hub-ready exports: a model card the Hub parses, full metadata, the printed lm_eval command, --push-to-hub."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from titan_recur.hf.export import ExportError, push_to_hub

REPO = Path(__file__).resolve().parents[1]
CONVERTED = REPO / "assets" / "tiny_llama_recurrent"


@pytest.fixture(scope="module")
def export_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("card") / "hf"
    done = subprocess.run([sys.executable, "-m", "titan_recur.cli.export", str(CONVERTED), str(out)],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_the_model_card_parses_and_says_how_to_use_the_model(export_run) -> None:
    from huggingface_hub import ModelCard

    out, _ = export_run
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "titan_recur" in card.data.tags and card.data.license
    assert "trust_remote_code=True" in card.text and "num_steps" in card.text


def test_the_export_records_the_transformers_version(export_run) -> None:
    out, _ = export_run
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text())["transformers_version"] == transformers.__version__


def test_the_export_prints_the_lm_eval_command_with_the_prefix_token(export_run) -> None:
    out, stdout = export_run
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert f"lm_eval --model hf --model_args pretrained={out},trust_remote_code=True,prefix_token_id={eos}" in stdout


def test_push_to_hub_creates_the_repo_and_uploads_the_folder(export_run, monkeypatch) -> None:
    """Offline, up to the upload call: the repo is created (exist_ok) and the whole export folder uploaded."""
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, **kw: calls.append(("upload", kw)) or "https://huggingface.co/me/m/commit/1")
    out, _ = export_run
    assert push_to_hub(out, "me/tiny-recurrent", private=True) == "https://huggingface.co/me/m/commit/1"
    assert calls[0] == ("create", "me/tiny-recurrent", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert calls[1][1]["folder_path"] == str(out) and calls[1][1]["repo_id"] == "me/tiny-recurrent"
    with pytest.raises(ExportError, match="OWNER/NAME"):
        push_to_hub(out, "not a repo id")
