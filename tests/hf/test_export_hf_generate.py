"""The export's generate behaves like transformers' own: the generation config resolved as transformers resolves
it, sampling from torch's RNG, harmless kwargs passed through, per-token depths returned, assisted decoding,
offloaded embeddings (docs/hf.md, "Generation")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_util import EXPORT_MEAN, batch, load
from titan_recur import greedy_generate, load_model
from titan_recur.inference.engine import generate as engine_generate
from titan_recur.inference.options import GenerationOptions


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def test_sampling_without_temperature_or_top_p(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """`do_sample=True` alone (generate and pipeline) samples, with transformers' top_k=50, in titan_recur's engine."""
    from transformers import pipeline

    model, tok = load(tiny_hf_export).eval(), tokenizer(tiny_hf_export)
    enc = tok("Question: What is 3 + 4?", return_tensors="pt")
    width = enc.input_ids.shape[1]
    sampled = model.generate(**enc, do_sample=True, max_new_tokens=5)
    assert sampled.shape == (1, width + 5)
    text = pipeline("text-generation", model=model, tokenizer=tok)("Question:", do_sample=True, max_new_tokens=4)
    assert text[0]["generated_text"].startswith("Question:")
    ours = model.generate(**enc, do_sample=True, top_k=0, top_p=0.9, max_new_tokens=6, seed=7)[:, width:]
    options = GenerationOptions(
        max_new_tokens=6,
        num_steps=EXPORT_MEAN,
        temperature=1.0,
        top_p=0.9,
        seed=7,
        eos_id=tok.eos_token_id,
        state_init="zero",
    )
    expected = engine_generate(load_model(tiny_model_dir), enc.input_ids, options, attention_mask=enc.attention_mask)
    assert torch.equal(ours, expected.tokens)


def test_generation_config_is_resolved_as_transformers_does(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """A `generation_config` argument, the model's generation config and transformers' defaults (max_length 20)."""
    from transformers import GenerationConfig

    model = load(tiny_hf_export).eval()
    ids = batch(shape=(2, 6))
    reference = greedy_generate(load_model(tiny_model_dir), ids, 14, num_steps=EXPORT_MEAN)
    by_config = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=5, eos_token_id=None))
    assert torch.equal(by_config[:, 6:], reference[:, :5])
    model.generation_config.eos_token_id = None
    assert torch.equal(model.generate(ids)[:, 6:], reference)  # max_length 20: 14 new tokens
    model.generation_config.max_new_tokens = 3
    assert torch.equal(model.generate(ids)[:, 6:], reference[:, :3])


def test_export_ships_a_generation_config(tiny_hf_export: Path) -> None:
    """generation_config.json names the special tokens (transformers 5 does not read them from config.json)."""
    model = load(tiny_hf_export)
    assert (tiny_hf_export / "generation_config.json").is_file()
    assert (model.generation_config.bos_token_id, model.generation_config.eos_token_id) == (1, 2)
    assert model.generation_config.pad_token_id == 0


@pytest.mark.parametrize("engine", [True, False])
def test_sampling_follows_torch_rng_and_a_generator(tiny_hf_export: Path, engine: bool) -> None:
    """Different samples under different torch.manual_seed, identical under the same; a passed generator too.
    (repetition_penalty: transformers' sampler; the engine serves top_k.)"""
    model = load(tiny_hf_export).eval()
    ids = batch(shape=(2, 4))
    strategy = dict(top_k=50) if engine else dict(repetition_penalty=1.2)
    kwargs = dict(do_sample=True, max_new_tokens=12, eos_token_id=None, **strategy)

    def sample(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return model.generate(ids, **kwargs)

    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))
    with_generator = [model.generate(ids, generator=torch.Generator().manual_seed(s), **kwargs) for s in (3, 3, 4)]
    assert torch.equal(with_generator[0], with_generator[1]) and not torch.equal(with_generator[0], with_generator[2])


def test_token_type_ids_are_accepted(tiny_hf_export: Path) -> None:
    """What transformers 4.x tokenizers return: zero token types change nothing; others are refused."""
    model = load(tiny_hf_export).eval()
    assert tokenizer(tiny_hf_export).model_input_names == ["input_ids", "attention_mask"]
    ids = batch()
    zeros = torch.zeros_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, token_type_ids=zeros).logits, model(ids).logits, rtol=0, atol=0)
        with pytest.raises(ValueError, match="token_type_ids must be all zero"):
            model(ids, token_type_ids=zeros + 1)
    common = dict(max_new_tokens=4, eos_token_id=None)
    assert torch.equal(model.generate(ids, token_type_ids=zeros, **common), model.generate(ids, **common))
    beams = dict(num_beams=2, **common)
    assert torch.equal(model.generate(ids, token_type_ids=zeros, **beams), model.generate(ids, **beams))


def test_exit_criterion_with_harmless_kwargs_returns_the_depths(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """exit_criterion with return_dict_in_generate and token_type_ids runs the engine; `steps` are its depths."""
    model = load(tiny_hf_export).eval()
    ids = batch(shape=(2, 5))
    knobs = dict(num_steps=6, exit_criterion="latent-diff", exit_threshold=0.3)
    out = model.generate(
        ids,
        max_new_tokens=8,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
        token_type_ids=torch.zeros_like(ids),
        **knobs,
    )
    options = GenerationOptions(max_new_tokens=8, state_init="zero", **knobs)
    expected = engine_generate(load_model(tiny_model_dir), ids, options, return_logits=True)
    assert torch.equal(out.sequences[:, 5:], expected.tokens)
    assert torch.equal(out.steps, expected.steps) and bool((out.steps < 6).any())
    torch.testing.assert_close(torch.stack(out.logits, dim=1), expected.logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot serve beam_search decoding"):
        model.generate(ids, max_new_tokens=2, num_beams=2, **knobs)


def test_prompt_lookup_decoding_equals_greedy(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """Assisted decoding (prompt lookup) drafts tokens, verifies them and crops the cache: greedy's tokens."""
    model = load(tiny_hf_export).eval()
    ids = torch.cat([batch(shape=(1, 6))] * 3, dim=1)  # repeated n-grams: lookups find drafts
    expected = greedy_generate(load_model(tiny_model_dir), ids, 16, num_steps=EXPORT_MEAN)
    looked_up = model.generate(ids, max_new_tokens=16, prompt_lookup_num_tokens=3, eos_token_id=None)
    assert torch.equal(looked_up[:, ids.shape[1] :], expected)


def test_generate_with_the_embedding_offloaded_to_disk(tiny_hf_export: Path, tmp_path: Path) -> None:
    """accelerate disk offload with embed_tokens on disk: greedy and sampled generate equal the in-memory model's."""
    device_map = {
        "model.embed_tokens": "disk",
        "model.prelude": "cpu",
        "model.core": "disk",
        "model.coda": "cpu",
        "model.norm": "disk",
        "model.lm_head": "disk",
    }
    offloaded = load(tiny_hf_export, device_map=device_map, offload_folder=str(tmp_path)).eval()
    assert offloaded.model.embed_tokens.weight.device.type == "meta"
    in_memory = load(tiny_hf_export).eval()
    ids = batch(shape=(2, 5))
    # output_scores: the in-memory model samples with transformers' sampler too, as an offloaded embedding does.
    sampled = dict(do_sample=True, output_scores=True, generator=torch.Generator().manual_seed(0))
    for kwargs in (dict(do_sample=False), sampled):
        expected = in_memory.generate(ids, max_new_tokens=6, eos_token_id=None, **kwargs)
        kwargs = {**kwargs, "generator": torch.Generator().manual_seed(0)} if kwargs["do_sample"] else kwargs
        assert torch.equal(offloaded.generate(ids, max_new_tokens=6, eos_token_id=None, **kwargs), expected)


def test_speculative_generate_equals_greedy_at_the_target_depth(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """draft_steps/lookahead through the HF generate: greedy's tokens, and what the drafts cost per row."""
    model = load(tiny_hf_export).eval()
    ids = batch(shape=(2, 5))
    plain = model.generate(ids, max_new_tokens=12, eos_token_id=None, num_steps=8)
    out = model.generate(
        ids,
        max_new_tokens=12,
        eos_token_id=None,
        num_steps=8,
        draft_steps=1,
        lookahead=4,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert out.draft_proposed.shape == (2,) and bool((out.draft_accepted <= out.draft_proposed).all())
    assert bool((out.draft_accepted < out.draft_proposed).any()), "the draft never disagreed: the test could not fail"
    options = GenerationOptions(max_new_tokens=12, num_steps=8, draft_steps=1, lookahead=4, state_init="zero")
    expected = engine_generate(load_model(tiny_model_dir), ids, options).speculation
    assert torch.equal(out.core_iterations, expected.core_iterations)
    with pytest.raises(ValueError, match="draft_steps must be an integer in"):
        model.generate(ids, max_new_tokens=2, num_steps=8, draft_steps=8)
    with pytest.raises(ValueError, match="draft_steps run in titan_recur's engine, which cannot serve beam_search"):
        model.generate(ids, max_new_tokens=2, num_beams=2, num_steps=8, draft_steps=2)


def test_assisted_decoding_by_a_shallower_copy_equals_greedy(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """`assistant_model=` the same export at depth 1 drafts; the main model verifies at its own depth: greedy's
    tokens. The assistant runs at its own depth, not at the num_steps given to the main model's generate."""
    model = load(tiny_hf_export).eval()
    assistant = load(tiny_hf_export, num_steps=1).eval()
    ids = batch(shape=(1, 6))
    forwards, core_calls = [], []
    assistant.register_forward_pre_hook(lambda *_: forwards.append(1))
    assistant.model.core.blocks[0].register_forward_pre_hook(lambda *_: core_calls.append(1))
    reference = load_model(tiny_model_dir)
    for num_steps in (None, 6):
        expected = greedy_generate(reference, ids, 16, num_steps=num_steps or EXPORT_MEAN)
        drafts = assistant.generate(ids, max_new_tokens=16, eos_token_id=None)[:, 6:]
        assert not torch.equal(drafts, expected), "the assistant never disagreed: the test could not fail"
        forwards.clear()
        core_calls.clear()
        assisted = model.generate(
            ids, max_new_tokens=16, eos_token_id=None, num_steps=num_steps, assistant_model=assistant
        )
        assert torch.equal(assisted[:, 6:], expected)
        assert len(core_calls) == len(forwards) > 0  # one core iteration per assistant forward


def test_cache_crop_follows_both_transformers_conventions() -> None:
    """transformers 5 crops by -(columns to drop) and crop(0) drops none; 4.57 passes the columns to keep."""
    from titan_recur.hf.modeling_titan_recur import TransformersKVCache

    sizes = dict(n_prelude=1, n_core=1, n_coda=1, n_kv_heads=1, head_dim=2, num_steps=1)
    cache = TransformersKVCache(batch_size=1, capacity=16, **sizes)
    cache.advance(10)
    for argument, length in ((0, 10), (-2, 8), (5, 5), (7, 5)):
        cache.crop(argument)
        assert cache.get_seq_length() == length, argument


@pytest.mark.parametrize(
    "strategy", [dict(), dict(do_sample=True, top_k=0), dict(num_beams=2), dict(num_steps=4, draft_steps=1)]
)
def test_right_padding_warns_once_on_every_path(
    tiny_hf_export: Path,
    strategy: dict,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 0 after a 1 in a row of the attention mask: one warning, as transformers' (engine and transformers paths)."""
    model = load(tiny_hf_export).eval()
    ids = batch(shape=(2, 6))
    right = torch.ones_like(ids)
    right[0, 4:] = 0
    for mask, warnings in ((right, 1), (right.flip(1), 0)):
        caplog.clear()  # pytest captures transformers' own records too
        model.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None, pad_token_id=0, **strategy)
        messages = [r.getMessage() for r in caplog.records]
        assert sum("right-padding was detected" in m for m in messages) == warnings, messages


def test_sdpa_attention_implementation_is_accepted(tiny_hf_export: Path) -> None:
    """`attn_implementation="sdpa"`: what the model runs anyway; it loads and generates the default's tokens."""
    ids = batch(shape=(2, 5))
    common = dict(max_new_tokens=6, eos_token_id=None)
    expected = load(tiny_hf_export).eval().generate(ids, **common)
    sdpa = load(tiny_hf_export, attn_implementation="sdpa").eval()
    assert sdpa.config._attn_implementation == "sdpa"
    assert torch.equal(sdpa.generate(ids, **common), expected)


def test_transformers_sampling_defaults_run_with_the_depth_knobs(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """A generation config with transformers' sampling defaults (top_k 50) runs in the engine with its depth knobs,
    top_k applied (top_k=1: greedy's tokens, with exit and with speculation)."""
    from transformers import GenerationConfig

    model = load(tiny_hf_export).eval()
    ids = batch(shape=(2, 5))
    knobs = dict(num_steps=6, exit_criterion="latent-diff", exit_threshold=0.3)
    config = GenerationConfig(do_sample=True, max_new_tokens=8, eos_token_id=None)
    sampled = model.generate(ids, generation_config=config, seed=7, **knobs)
    options = GenerationOptions(max_new_tokens=8, temperature=1.0, top_k=50, seed=7, state_init="zero", **knobs)
    assert torch.equal(sampled[:, 5:], engine_generate(load_model(tiny_model_dir), ids, options).tokens)
    for extra in (knobs, dict(num_steps=6, draft_steps=2)):
        common = dict(max_new_tokens=8, eos_token_id=None, **extra)
        top_1 = model.generate(ids, do_sample=True, top_k=1, temperature=0.7, **common)
        assert torch.equal(top_1, model.generate(ids, **common))
