"""Surgery (titan_recur/convert/surgery.py): layer plans, config mapping, exact equivalence with transformers, bad
input. The convert command: tests/cli/test_convert.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.convert_util import SEQ_LEN, converted_logits, hf_logits, input_ids
from titan_recur.convert.surgery import (
    ConversionError,
    ConvertOptions,
    SourceModel,
    convert,
    format_layers,
    format_summary,
    hf_config_to_model_args,
    parse_layers,
    plan_layers,
    read_source,
)
from titan_recur.inference.engine import check_prompts
from titan_recur.models.args import PRESETS
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.model_io import WEIGHTS_NAME, load_model, load_state_dict_into, read_model_args

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets"
EXACT = ConvertOptions(adapter_init="identity", state_init="zero")


def convert_plan(source: Path, output: Path, options: ConvertOptions = EXACT, **plan_kwargs) -> None:
    convert(source, output, plan_layers(read_source(source).n_layers, **plan_kwargs), options)


# ---------------------------------------------------------------- plans


@pytest.mark.parametrize(
    "n_layers, shape, expected",
    [
        (22, (4, 8, 4), ("0-3", "10-17", "18-21", "4-9")),  # docs/method.md §2 table
        (16, (4, 6, 4), ("0-3", "6-11", "12-15", "4-5")),
        (16, (2, 4, 2), ("0-1", "10-13", "14-15", "2-9")),
        (22, (6, 10, 6), ("0-5", "6-15", "16-21", "-")),
        (8, (0, 3, 0), ("-", "5-7", "-", "0-4")),
    ],
)
def test_shape_plans(n_layers, shape, expected):
    plan = plan_layers(n_layers, shape)
    assert tuple(format_layers(getattr(plan, p)) for p in ("prelude", "core", "coda", "dropped")) == expected


def test_layer_lists_parse_in_order_and_round_trip():
    assert parse_layers("0,2,5-7") == [0, 2, 5, 6, 7]
    assert parse_layers("9, 3-4") == [9, 3, 4]
    assert parse_layers("") == []
    assert format_layers([0, 2, 5, 6, 7]) == "0,2,5-7"
    plan = plan_layers(12, prelude=[0], core=[9, 3, 4], coda=[11])
    assert plan.core == (9, 3, 4) and plan.dropped == (1, 2, 5, 6, 7, 8, 10)


def test_static_plans():
    assert plan_layers(6, static=True).prelude == tuple(range(6))
    plan = plan_layers(22, (4, 8, 4), static=True)
    assert plan.is_static and plan.prelude == (*range(4), *range(10, 22)) and plan.dropped == tuple(range(4, 10))
    assert plan_layers(8, prelude=[0, 1], coda=[7], static=True).prelude == (0, 1, 7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prelude=[0], core=[8]), "layer 8 is out of range"),
        (dict(prelude=[0, 1], core=[1, 2]), "layer 1 is selected more than once"),
        (dict(prelude=[0, 1], coda=[7]), "the core is empty"),
        (dict(shape=(2, 0, 2)), "the core is empty"),
        (dict(shape=(4, 4, 2)), "needs 10 layers; the source has 8"),
        (dict(shape=(2, 4, 2), core=[3]), "not both"),
        (dict(), "choose the layers"),
    ],
)
def test_bad_plans(kwargs, message):
    with pytest.raises(ConversionError, match=message):
        plan_layers(8, **kwargs)


@pytest.mark.parametrize("text", ["1-", "a", "3-1", "-2"])
def test_bad_layer_lists(text):
    with pytest.raises(ConversionError, match="bad layer list"):
        parse_layers(text)


# ---------------------------------------------------------------- config mapping

# Fields of the real source configs (as the hub serves them, transformers 4 style).
REAL_CONFIGS = {
    "tinyllama-1.1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        hidden_size=2048,
        intermediate_size=5632,
        max_position_embeddings=2048,
        num_attention_heads=32,
        num_hidden_layers=22,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        rope_scaling=None,
        tie_word_embeddings=False,
        vocab_size=32000,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        hidden_size=2048,
        head_dim=64,
        intermediate_size=8192,
        max_position_embeddings=131072,
        num_attention_heads=32,
        num_hidden_layers=16,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        vocab_size=128256,
        rope_scaling=dict(
            factor=32.0,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "olmo2-1b": dict(
        architectures=["Olmo2ForCausalLM"],
        model_type="olmo2",
        hidden_act="silu",
        hidden_size=2048,
        intermediate_size=8192,
        max_position_embeddings=4096,
        num_attention_heads=16,
        num_hidden_layers=16,
        num_key_value_heads=16,
        rms_norm_eps=1e-6,
        rope_scaling=None,
        rope_theta=500000,
        tie_word_embeddings=False,
        vocab_size=100352,
    ),
}
SHAPE_FIELDS = (
    "vocab_size",
    "dim",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_dim",
    "block_type",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_seq_len",
    "n_prelude",
    "n_core",
    "n_coda",
)


@pytest.mark.parametrize("preset_name", sorted(REAL_CONFIGS))
def test_real_configs_map_to_the_presets(preset_name):
    preset = PRESETS[preset_name]
    source = SourceModel(Path("."), REAL_CONFIGS[preset_name], REAL_CONFIGS[preset_name]["architectures"][0])
    args = hf_config_to_model_args(source, plan_layers(preset.n_layers, preset.default_shape), ConvertOptions())
    expected = preset.model_args(*preset.default_shape)
    assert {f: getattr(args, f) for f in SHAPE_FIELDS} == {f: getattr(expected, f) for f in SHAPE_FIELDS}


def test_transformers5_config_fields():
    """rope_parameters (transformers 5) instead of top-level theta/scaling; EOS lists; default rope = None."""
    config = dict(REAL_CONFIGS["llama3.2-1b"], eos_token_id=[128001, 128008, 128009])
    scaling = config.pop("rope_scaling")
    config["rope_parameters"] = dict(scaling, rope_theta=config.pop("rope_theta"))
    args = hf_config_to_model_args(
        SourceModel(Path("."), config, "LlamaForCausalLM"), plan_layers(16, (4, 6, 4)), ConvertOptions()
    )
    assert (args.rope_theta, args.rope_scaling, args.eos_id) == (500000.0, scaling, 128001)
    config["rope_parameters"] = dict(rope_type="default", rope_theta=1000.0)
    args = hf_config_to_model_args(
        SourceModel(Path("."), config, "LlamaForCausalLM"), plan_layers(16, (4, 6, 4)), ConvertOptions()
    )
    assert (args.rope_theta, args.rope_scaling) == (1000.0, None)


# ---------------------------------------------------------------- equivalence with transformers


@pytest.mark.parametrize("name", ["llama", "olmo2", "qwen2", "qwen3", "mistral", "llama_tied", "llama_sharded"])
def test_all_layers_kept_reproduce_the_source(tiny_hf_checkpoint, tmp_path, name):
    source = tiny_hf_checkpoint(name)
    convert_plan(source, tmp_path / "out", shape=(2, 2, 2))
    ids = input_ids()
    torch.testing.assert_close(converted_logits(tmp_path / "out", ids), hf_logits(source, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "olmo2", "qwen2", "qwen3", "mistral"])
def test_dropped_layers_reproduce_the_truncated_source(tiny_hf_checkpoint, tmp_path, name):
    source = tiny_hf_checkpoint(name)
    convert_plan(source, tmp_path / "out", shape=(1, 2, 1))
    assert read_model_args(tmp_path / "out").source_layers["dropped"] == [1, 2]
    ids = input_ids()
    expected = hf_logits(source, ids, layers=[0, 3, 4, 5])
    torch.testing.assert_close(converted_logits(tmp_path / "out", ids), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(expected, hf_logits(source, ids), atol=1e-3)  # dropping layers matters


def test_a_sliding_window_caps_max_seq_len(tiny_hf_checkpoint, tmp_path):
    """titan_recur attends over the whole sequence: equal to Mistral's sliding-window attention only up to the
    window, so the converted model's max_seq_len is the window, longer runs are refused in one line, and the
    conversion's summary says why. Which configs slide a layer: tests/convert/test_source_config.py."""
    source = tiny_hf_checkpoint("mistral")
    args = convert(source, tmp_path / "out", plan_layers(6, (2, 2, 2)), EXACT)
    assert args.max_seq_len == 128 == read_model_args(tmp_path / "out").max_seq_len
    assert "max_seq_len   128: the source's sliding attention window" in format_summary(read_source(source), args)
    with pytest.raises(ValueError, match=r"exceeds the model's max_seq_len \(128\)"):
        check_prompts(torch.ones(1, 100), 29, args.max_seq_len)


def test_non_contiguous_reordered_selection(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("llama")
    convert_plan(source, tmp_path / "out", prelude=[0], core=[4, 2], coda=[5])
    ids = input_ids()
    expected = hf_logits(source, ids, layers=[0, 4, 2, 5])
    torch.testing.assert_close(converted_logits(tmp_path / "out", ids), expected, atol=1e-5, rtol=0)


def test_identity_adapter_is_exact_at_any_state_and_depth(tiny_hf_checkpoint, tmp_path):
    """A = [0 | I] ignores the state, so the normal state init and deeper recurrence change nothing."""
    source = tiny_hf_checkpoint("llama")
    convert_plan(source, tmp_path / "out", ConvertOptions(state_init="normal"), shape=(1, 2, 1))
    ids = input_ids()
    expected = hf_logits(source, ids, layers=[0, 3, 4, 5])
    model = load_model(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(ids, num_steps=3), expected, atol=1e-5, rtol=0)


def test_rope_scaling_is_applied_and_matters(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("llama_rope_scaled")
    convert_plan(source, tmp_path / "out", shape=(2, 2, 2))
    ids = input_ids(SEQ_LEN)  # longer than original_max_position_embeddings = 16
    scaled = converted_logits(tmp_path / "out", ids)
    torch.testing.assert_close(scaled, hf_logits(source, ids), atol=1e-5, rtol=0)

    args = read_model_args(tmp_path / "out")
    assert args.rope_scaling["rope_type"] == "llama3"
    args.rope_scaling = None
    unscaled = RecurrentLM(args)
    load_state_dict_into(unscaled, load_file(str(tmp_path / "out" / WEIGHTS_NAME)), "test")
    with torch.no_grad():
        assert (unscaled.eval()(ids, num_steps=1) - scaled).abs().max() > 1e-2


def test_tied_source(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("llama_tied")
    assert "lm_head.weight" not in load_file(str(source / WEIGHTS_NAME))
    convert_plan(source, tmp_path / "untied", shape=(1, 2, 1))
    convert_plan(source, tmp_path / "tied", ConvertOptions(state_init="zero", tie_embeddings=True), shape=(1, 2, 1))
    untied = load_file(str(tmp_path / "untied" / WEIGHTS_NAME))
    assert torch.equal(untied["lm_head.weight"], untied["embed_tokens.weight"])
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / WEIGHTS_NAME))
    ids = input_ids()
    expected = hf_logits(source, ids, layers=[0, 3, 4, 5])
    for out in ("untied", "tied"):
        torch.testing.assert_close(converted_logits(tmp_path / out, ids), expected, atol=1e-5, rtol=0)
    model = load_model(tmp_path / "tied")
    assert model.lm_head is None  # tied: the head is the embedding matrix


def test_static_conversion(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("olmo2")
    convert(source, tmp_path / "out", plan_layers(6, (1, 2, 1), static=True), EXACT)
    args = read_model_args(tmp_path / "out")
    assert (args.n_prelude, args.n_core, args.n_coda, args.is_recurrent) == (4, 0, 0, False)
    assert "core.adapter.weight" not in load_file(str(tmp_path / "out" / WEIGHTS_NAME))
    ids = input_ids()
    expected = hf_logits(source, ids, layers=[0, 3, 4, 5])
    torch.testing.assert_close(converted_logits(tmp_path / "out", ids), expected, atol=1e-5, rtol=0)


def test_random_adapter_is_seeded_and_options_are_recorded(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("llama")
    plan = plan_layers(6, (2, 2, 2))
    options = ConvertOptions(adapter_init="random", state_init="embed", state_std=0.01, mean_recurrence=8, seed=3)
    for out in ("a", "b"):
        convert(source, tmp_path / out, plan, options)
    convert(source, tmp_path / "c", plan, ConvertOptions(adapter_init="random", seed=4))
    adapters = [load_file(str(tmp_path / out / WEIGHTS_NAME))["core.adapter.weight"] for out in "abc"]
    assert torch.equal(adapters[0], adapters[1]) and not torch.equal(adapters[0], adapters[2])
    bound = 1 / (2 * 64) ** 0.5  # nn.Linear's default init range for fan_in 2d
    assert 0.9 * bound < adapters[0].abs().max() <= bound
    args = read_model_args(tmp_path / "a")
    assert (args.adapter_init, args.state_init, args.state_std, args.mean_recurrence) == ("random", "embed", 0.01, 8)
    assert json.loads((tmp_path / "a" / "conversion.json").read_text())["options"]["seed"] == 3


def test_bfloat16_output(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("llama")
    convert(source, tmp_path / "out", plan_layers(6, (2, 2, 2)), ConvertOptions(dtype="bfloat16"))
    state = load_file(str(tmp_path / "out" / WEIGHTS_NAME))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert torch.equal(state["core.adapter.weight"][:, 64:], torch.eye(64, dtype=torch.bfloat16))


def test_output_folder_contents_and_summary(tiny_hf_checkpoint, tmp_path):
    source = tiny_hf_checkpoint("llama")
    args = convert(source, tmp_path / "out", plan_layers(6, (1, 3, 1)), EXACT)
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {
        "config.json",
        WEIGHTS_NAME,
        "conversion.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left
    assert read_model_args(tmp_path / "out") == args
    assert args.source_layers == {"prelude": [0], "core": [2, 3, 4], "coda": [5], "dropped": [1]}
    summary = format_summary(read_source(source), args)
    assert re.search(r"dropped +1 layers +source 1\n", summary) and "params total" in summary
    assert "r=4 (mean recurrence): 14 blocks" in summary


def test_committed_tiny_llama_asset(tmp_path):
    source = ASSETS / "tiny_llama"
    convert(source, tmp_path / "out", plan_layers(8, (2, 4, 2)), EXACT)
    assert read_model_args(tmp_path / "out").source_layers["dropped"] == []
    ids = input_ids(64)
    torch.testing.assert_close(converted_logits(tmp_path / "out", ids), hf_logits(source, ids), atol=1e-5, rtol=0)
    convert(source, tmp_path / "cut", plan_layers(8, (1, 4, 1)), EXACT)
    expected = hf_logits(source, ids, layers=[0, 3, 4, 5, 6, 7])
    torch.testing.assert_close(converted_logits(tmp_path / "cut", ids), expected, atol=1e-5, rtol=0)


def test_committed_recurrent_asset_is_the_converted_tiny_llama():
    """assets/tiny_llama_recurrent (the CPU demo's model) is tiny_llama at shape 1,2,1 with the identity adapter."""
    args = read_model_args(ASSETS / "tiny_llama_recurrent")
    assert args.source_layers == {"prelude": [0], "core": [5, 6], "coda": [7], "dropped": [1, 2, 3, 4]}
    ids = input_ids(64)
    expected = hf_logits(ASSETS / "tiny_llama", ids, layers=[0, 5, 6, 7])
    torch.testing.assert_close(converted_logits(ASSETS / "tiny_llama_recurrent", ids), expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- bad input: one-line errors, nothing written


def _broken_source(tiny_hf_checkpoint, tmp_path: Path, breakage: str) -> Path:
    source = tmp_path / "source"
    shutil.copytree(tiny_hf_checkpoint("llama"), source)
    config = json.loads((source / "config.json").read_text())
    if breakage == "architecture":
        config["architectures"] = ["GemmaForCausalLM"]
    elif breakage == "activation":
        config["hidden_act"] = "gelu"
    elif breakage == "no weights":
        (source / WEIGHTS_NAME).unlink()
    elif breakage == "no config":
        (source / "config.json").unlink()
        return source
    elif breakage == "missing tensor":
        from safetensors.torch import save_file

        state = load_file(str(source / WEIGHTS_NAME))
        del state["model.layers.4.mlp.up_proj.weight"]
        save_file(state, str(source / WEIGHTS_NAME))
    elif breakage == "shape":
        config["intermediate_size"] = 128
    (source / "config.json").write_text(json.dumps(config))
    return source


@pytest.mark.parametrize(
    "breakage, message",
    [
        (
            "architecture",
            "architecture 'GemmaForCausalLM'; supported: LlamaForCausalLM, Olmo2ForCausalLM, Qwen2ForCausalLM, "
            "Qwen3ForCausalLM, MistralForCausalLM",
        ),
        ("activation", "unsupported hidden_act 'gelu'"),
        ("no weights", "no model.safetensors or model.safetensors.index.json"),
        ("no config", "config.json: no such file"),
        ("missing tensor", "tensor model.layers.4.mlp.up_proj.weight is missing"),
        ("shape", r"has shape \(96, 64\), the config implies \(128, 64\)"),
    ],
)
def test_bad_sources(tiny_hf_checkpoint, tmp_path, breakage, message):
    source = _broken_source(tiny_hf_checkpoint, tmp_path, breakage)
    with pytest.raises(ConversionError, match=message):
        convert(source, tmp_path / "out", plan_layers(6, (2, 2, 2)), EXACT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_tying_an_untied_source_is_an_error(tiny_hf_checkpoint, tmp_path):
    with pytest.raises(ConversionError, match="LM head is not its embedding"):
        convert(
            tiny_hf_checkpoint("llama"),
            tmp_path / "out",
            plan_layers(6, (2, 2, 2)),
            ConvertOptions(tie_embeddings=True),
        )
    assert not (tmp_path / "out").exists()


def test_existing_output(tiny_hf_checkpoint, tmp_path):
    source, out = tiny_hf_checkpoint("llama"), tmp_path / "out"
    plan = plan_layers(6, (2, 2, 2))
    out.mkdir()
    convert(source, out, plan, EXACT)  # an empty folder is fine
    with pytest.raises(ConversionError, match="exists and is not empty; pass --force"):
        convert(source, out, plan_layers(6, (1, 2, 1)), EXACT)
    assert read_model_args(out).n_prelude == 2
    convert(source, out, plan_layers(6, (1, 2, 1)), EXACT, force=True)
    assert read_model_args(out).n_prelude == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="refusing to overwrite"):
        convert(source, other, plan, EXACT, force=True)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
