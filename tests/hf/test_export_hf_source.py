"""Both exports of a conversion against its source, transformers' own model: every rope-scaling form transformers
reads, and a sliding attention window shorter than the input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.hf_util import load
from tests.tiny_models import edited_source
from titan_recur.convert.surgery import ConversionError, ConvertOptions, convert, plan_layers
from titan_recur.hf.export import export_hf
from titan_recur.storage.model_io import load_model, read_model_args, write_model_args

EXACT = ConvertOptions(adapter_init="identity", state_init="zero")
LINEAR = {"factor": 2.0}
LLAMA3 = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@torch.no_grad()
def source_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids, use_cache=False).logits


def exports(source: Path, root: Path) -> dict[str, Path]:
    """The source converted with all its layers, static and recurrent (identity adapter: exact at r = 1), and each
    exported for transformers."""
    plans = {"static": plan_layers(6, static=True), "recurrent": plan_layers(6, (2, 2, 2))}
    folders = {}
    for kind, plan in plans.items():
        convert(source, root / kind, plan, EXACT)
        folders[kind] = export_hf(load_model(root / kind), root / f"{kind}_hf", tokenizer_folder=root / kind)
    return folders


@torch.no_grad()
def export_logits(kind: str, folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load(folder, dtype=torch.float32).eval()
    return (model(ids) if kind == "static" else model(ids, num_steps=1)).logits


@pytest.mark.parametrize(
    "scaling",
    [
        {"type": "linear", **LINEAR},
        {"rope_type": "linear", **LINEAR},
        {"type": "llama3", **LLAMA3},
        {"rope_type": "llama3", **LLAMA3},
        # transformers' llama3 default for the original context: max_position_embeddings.
        {"rope_type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}},
    ],
)
def test_both_exports_keep_the_sources_rope_scaling(tiny_hf_checkpoint, tmp_path, scaling):
    """The legacy rope_scaling of a hub config.json ({type: linear}: the key transformers read before rope_type)
    and the current one, with rope_theta beside it: each export computes the source's RoPE."""
    source = edited_source(
        tiny_hf_checkpoint("llama"), tmp_path / "source", rope_parameters=None, rope_scaling=scaling, rope_theta=5e4
    )
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0))  # past the original context
    expected = source_logits(source, ids)
    plain = edited_source(source, tmp_path / "plain", rope_scaling=None)
    assert not torch.allclose(source_logits(plain, ids), expected, atol=1e-2)  # the scaling matters
    for kind, folder in exports(source, tmp_path).items():
        torch.testing.assert_close(export_logits(kind, folder, ids), expected, atol=1e-5, rtol=1e-5, msg=kind)


def test_a_legacy_scaling_stored_by_an_earlier_conversion_is_exported_as_transformers_reads_it(
    tiny_hf_checkpoint, tmp_path
):
    """Conversion writes rope_type; a folder converted before it did keeps the source's {type: linear}, which the
    static export writes under rope_type (beside rope_type: default, transformers would run plain RoPE)."""
    legacy = {"type": "linear", **LINEAR}
    source = edited_source(
        tiny_hf_checkpoint("llama"), tmp_path / "source", rope_parameters=None, rope_scaling=legacy, rope_theta=5e4
    )
    convert(source, tmp_path / "static", plan_layers(6, static=True), EXACT)
    write_model_args(
        dataclasses.replace(read_model_args(tmp_path / "static"), rope_scaling=legacy), tmp_path / "static"
    )
    export_hf(load_model(tmp_path / "static"), tmp_path / "hf", tokenizer_folder=tmp_path / "static")
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        export_logits("static", tmp_path / "hf", ids), source_logits(source, ids), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("key", ["type", "rope_type"])
@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_rope_scalings_titan_recur_does_not_compute_are_refused(tiny_hf_checkpoint, tmp_path, key, kind):
    source = edited_source(
        tiny_hf_checkpoint("llama"),
        tmp_path / "source",
        rope_parameters=None,
        rope_scaling={key: kind, "factor": 2.0, "original_max_position_embeddings": 64},
    )
    with pytest.raises(
        ConversionError, match=rf"^unsupported rope scaling '{kind}'; supported: default, linear, llama3$"
    ):
        convert(source, tmp_path / "out", plan_layers(6, (2, 2, 2)), EXACT)
    assert not (tmp_path / "out").exists()


def test_exports_of_a_sliding_window_source_never_compute_past_the_window(tiny_hf_checkpoint, tmp_path):
    """A window-8 Mistral: conversion caps max_seq_len at 8. The static export is a plain MistralForCausalLM that
    keeps the window, so it equals its source at any length; the recurrent export (titan_recur's full attention)
    equals it up to the window and refuses a longer input in one line, as titan_recur's own tools do."""
    source = edited_source(tiny_hf_checkpoint("mistral"), tmp_path / "source", sliding_window=8)
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = source_logits(source, ids)
    folders = exports(source, tmp_path)
    torch.testing.assert_close(export_logits("static", folders["static"], ids), expected, atol=1e-5, rtol=1e-5)
    recurrent = folders["recurrent"]
    torch.testing.assert_close(export_logits("recurrent", recurrent, ids[:, :8]), expected[:, :8], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"^24 tokens exceed the model's max_seq_len 8 \(") as refused:
        export_logits("recurrent", recurrent, ids)
    assert "\n" not in str(refused.value)
    # Left padding does not count: a row's real tokens do.
    model = load(recurrent, dtype=torch.float32).eval()
    mask = torch.cat([torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)], dim=1)
    with torch.no_grad():
        padded = model(torch.cat([ids[:, :4], ids[:, :8]], dim=1), attention_mask=mask, num_steps=1).logits
    torch.testing.assert_close(padded[:, 4:], expected[:, :8], atol=1e-5, rtol=1e-5)
