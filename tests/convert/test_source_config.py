"""A source's config.json as conversion reads it: the sliding window transformers runs, a Hub source's config
checked before its weights are fetched, and hand-edited or foreign values refused in one line by both commands
that read a source (tools/convert_hf.py, tools/analyze_layers.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import edited_source
from titan_recur.cli import analyze_layers, convert
from titan_recur.convert.surgery import SourceModel
from titan_recur.models.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]
# tools/analyze_layers.py's calibration: 4 rows of 32 tokens.
CALIBRATION = ["--data", str(REPO / "assets" / "corpus" / "general.jsonl"), "--seq-len", "32", "--tokens", "128"]
ANALYZE = analyze_layers
CONVERT = convert
# A tiny source's shapes (tests/conftest.py's), 6 layers; its positions (256) are longer than the windows below.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=6,
    max_position_embeddings=256,
)


# ---------------------------------------------------------------- the sliding window transformers runs


@torch.no_grad()
def windowed_in_transformers(family: str, config: dict[str, Any]) -> bool:
    """Whether transformers' model of ``config`` computes other logits past an 8-token window than the same weights
    with full attention: the oracle of whether any of its layers slides."""
    import transformers

    record = FAMILIES[family]
    config_cls, model_cls = (getattr(transformers, name) for name in (record.config_class, record.architecture))
    torch.manual_seed(0)
    model = model_cls(config_cls(**config)).eval()
    no_window = {
        "sliding_window": None,
        "use_sliding_window": False,
        **({"layer_types": None} if "layer_types" in config else {}),
    }
    full = model_cls(config_cls(**{**config, **no_window})).eval()
    full.load_state_dict(model.state_dict())
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    return not torch.allclose(model(ids, use_cache=False).logits, full(ids, use_cache=False).logits, atol=1e-4)


FULL = ["full_attention"] * 6


@pytest.mark.parametrize(
    "family, window",
    [
        ("mistral", dict(sliding_window=8)),
        ("mistral", dict(sliding_window=None)),
        ("llama", dict(sliding_window=8)),  # Llama has no window: the key is ignored
        ("qwen2", dict(sliding_window=8)),  # use_sliding_window defaults to false
        ("qwen2", dict(sliding_window=8, use_sliding_window=False, max_window_layers=0)),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True)),  # max_window_layers defaults to 28 > 6 layers
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=6)),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=5)),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=0, layer_types=FULL)),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, layer_types=[*FULL[:5], "sliding_attention"])),
        ("qwen3", dict(sliding_window=8, use_sliding_window=True, max_window_layers=6)),
        ("qwen3", dict(sliding_window=8, use_sliding_window=True, max_window_layers=2)),
    ],
)
def test_max_seq_len_is_capped_where_transformers_slides_a_layer(family, window):
    """max_seq_len is the window exactly where transformers' model of the config computes a windowed layer (Mistral's
    sliding_window; Qwen's use_sliding_window, max_window_layers and layer_types), else the source's positions."""
    record = FAMILIES[family]
    config = {**TINY, "architectures": [record.architecture], "model_type": family, **window}
    capped = SourceModel(Path("."), config, record.architecture).max_seq_len
    assert capped == (8 if windowed_in_transformers(family, config) else 256)


# ---------------------------------------------------------------- bad config values: one line, exit 2, no work


def small_embedding_source(source: Path, folder: Path) -> Path:
    """The source with a 256-row embedding and head (config vocab_size 256) beside its 512-id tokenizer."""
    edited_source(source, folder, vocab_size=256)
    weights = load_file(str(folder / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][:256].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


BAD_CONFIGS = {
    "architectures a string": (dict(architectures="LlamaForCausalLM"), "architectures must be a list of names"),
    "no num_attention_heads": (dict(num_attention_heads=None), "num_attention_heads is missing"),
    "zero num_attention_heads": (dict(num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),
    "no num_hidden_layers": (dict(num_hidden_layers=None), "num_hidden_layers is missing"),
    "string num_hidden_layers": (dict(num_hidden_layers="6"), "num_hidden_layers must be an integer >= 1, got '6'"),
    "huge num_hidden_layers": (dict(num_hidden_layers=10**12), "num_hidden_layers 1,000,000,000,000 is more than"),
    "zero sliding_window": (dict(sliding_window=0), "sliding_window must be an integer >= 1 or null, got 0"),
    "negative sliding_window": (dict(sliding_window=-8), "sliding_window must be an integer >= 1 or null, got -8"),
    "tokenizer past the embedding": (
        None,
        "the tokenizer produces ids up to 511 but the model's vocab_size is 256",
    ),
}


def run_convert(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """The convert command in this process, as its console script runs it: its exit code."""
    monkeypatch.setattr(sys, "argv", ["titan-recur-convert", *argv])
    try:
        return CONVERT.main()
    except SystemExit as exit:
        return int(exit.code or 0)


@pytest.mark.parametrize("command", ["convert", "analyze"])
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_values_are_one_line_exit_2_before_any_work(
    tiny_hf_checkpoint, tmp_path, capsys, monkeypatch, command, case
):
    changes, message = BAD_CONFIGS[case]
    family = "mistral" if "sliding_window" in case else "llama"
    if changes is None:
        source = small_embedding_source(tiny_hf_checkpoint(family), tmp_path / "source")
    else:
        source = edited_source(tiny_hf_checkpoint(family), tmp_path / "source", **changes)
    capsys.readouterr()  # building the source reports progress
    out = tmp_path / "out"
    if command == "convert":
        code = run_convert([str(source), str(out), "--shape", "2,2,2"], monkeypatch)
    else:
        code = ANALYZE.main([str(source), *CALIBRATION, "--recommend", "2,2,2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


# ---------------------------------------------------------------- a Hub source: its config first


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """huggingface_hub's downloaders replaced by ones that serve ``hub["folder"]`` and record what was fetched."""
    import huggingface_hub

    hub: dict[str, Any] = {"fetched": []}

    def hf_hub_download(repo_id: str, filename: str, **kwargs: Any) -> str:
        hub["fetched"].append(filename)
        return str(hub["folder"] / filename)

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        hub["fetched"].append(f"snapshot {kwargs.get('allow_patterns')}")
        return str(hub["folder"])

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return hub


@pytest.mark.parametrize("command", ["convert", "analyze"])
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3"), "unsupported architecture 'SmolLM3"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope scaling 'yarn'"),
        (dict(num_hidden_layers="6"), "num_hidden_layers must be an integer >= 1"),
    ],
)
def test_a_hub_source_is_refused_on_its_config_before_its_weights_are_fetched(
    tiny_hf_checkpoint, tmp_path, capsys, monkeypatch, hub, command, changes, message
):
    hub["folder"] = edited_source(tiny_hf_checkpoint("llama"), tmp_path / "hub", **changes)
    capsys.readouterr()  # building the source reports progress
    out = tmp_path / "out"
    if command == "convert":
        code = run_convert(["owner/model", str(out), "--shape", "2,2,2"], monkeypatch)
    else:
        code = ANALYZE.main(["owner/model", *CALIBRATION, "--recommend", "2,2,2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert hub["fetched"] == ["config.json"] and not out.exists()


def test_a_supported_hub_source_is_fetched_after_its_config(tiny_hf_checkpoint, tmp_path, monkeypatch, capsys, hub):
    hub["folder"] = tiny_hf_checkpoint("llama")
    code = run_convert(["owner/model", str(tmp_path / "out"), "--shape", "2,2,2", "--dry-run"], monkeypatch)
    assert code == 0 and "dry run: nothing written" in capsys.readouterr().out
    assert hub["fetched"][0] == "config.json" and hub["fetched"][1].startswith("snapshot ") and len(hub["fetched"]) == 2
