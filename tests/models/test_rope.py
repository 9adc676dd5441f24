"""RoPE against transformers: inverse frequencies (default, linear, llama3) and the rotation itself."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from titan_recur.models.args import PRESETS, ModelArgs
from titan_recur.models.model import RecurrentLM
from titan_recur.models.rope import apply_rope, rope_cos_sin, rope_inverse_frequencies

LLAMA32 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_config(head_dim: int, theta: float, scaling: dict | None) -> LlamaConfig:
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    params.pop("type", None)
    if scaling and "type" in scaling:
        params["rope_type"] = scaling["type"]
    return LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=params,
    )


def hf_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    config = hf_config(head_dim, theta, scaling)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq


@pytest.mark.parametrize(
    "head_dim,theta,scaling",
    [
        (64, 500000.0, LLAMA32),
        (128, 500000.0, LLAMA31),
        (16, 5000.0, {**LLAMA32, "original_max_position_embeddings": 256}),
    ],
)
def test_llama3_scaling_matches_transformers(head_dim, theta, scaling):
    ours = rope_inverse_frequencies(head_dim, theta, scaling)
    theirs = hf_inv_freq(head_dim, theta, scaling)
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=1e-6)
    # All three bands are exercised: kept (high freq), divided by factor (low freq), blended.
    plain = rope_inverse_frequencies(head_dim, theta, None)
    kept = torch.isclose(ours, plain, rtol=1e-6, atol=0)
    divided = torch.isclose(ours, plain / scaling["factor"], rtol=1e-6, atol=0)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0), (8, 10000.0)])
def test_default_matches_transformers(head_dim, theta):
    theirs = hf_inv_freq(head_dim, theta, None)
    for scaling in (None, {}, {"rope_type": "default"}):
        torch.testing.assert_close(rope_inverse_frequencies(head_dim, theta, scaling), theirs, atol=0, rtol=1e-6)
    expected = torch.tensor([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float32)
    torch.testing.assert_close(rope_inverse_frequencies(head_dim, theta, None), expected, atol=0, rtol=1e-5)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 2.5}])
def test_linear_matches_transformers(scaling):
    ours = rope_inverse_frequencies(64, 10000.0, scaling)
    torch.testing.assert_close(ours, hf_inv_freq(64, 10000.0, scaling), atol=0, rtol=1e-6)
    torch.testing.assert_close(ours, rope_inverse_frequencies(64, 10000.0, None) / scaling["factor"])


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "nonsense"])
def test_unknown_rope_type_raises(rope_type):
    scaling = {"rope_type": rope_type, "factor": 2.0}
    with pytest.raises(ValueError, match=rope_type):
        rope_inverse_frequencies(64, 10000.0, scaling)
    args = ModelArgs(
        vocab_size=11,
        dim=16,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        ffn_dim=24,
        n_prelude=1,
        n_core=1,
        n_coda=1,
        rope_scaling=scaling,
    )
    with pytest.raises(ValueError, match=rope_type):
        RecurrentLM(args)


def test_preset_llama32_rope_is_llama3_scaled():
    args = PRESETS["llama3.2-1b"].model_args(4, 6, 4)
    torch.testing.assert_close(
        rope_inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling),
        hf_inv_freq(64, 500000.0, LLAMA32),
        atol=0,
        rtol=1e-6,
    )


@pytest.mark.parametrize("scaling", [None, LLAMA32])
def test_rotation_matches_transformers(scaling):
    head_dim, theta = 16, 500000.0
    config = hf_config(head_dim, theta, scaling)
    rotary = LlamaRotaryEmbedding(config)
    position_ids = torch.tensor([[0, 1, 2, 3, 7000, 9000], [5, 6, 100, 4000, 20000, 70000]])
    q, k = torch.randn(2, 4, 6, head_dim), torch.randn(2, 2, 6, head_dim)
    cos, sin = rope_cos_sin(position_ids, rope_inverse_frequencies(head_dim, theta, scaling), torch.float32)
    hf_cos, hf_sin = rotary(q, position_ids)
    torch.testing.assert_close(cos, hf_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-5, rtol=0)
    ours = apply_rope(q, k, cos, sin)
    theirs = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # a rotation: norms of each pair are kept
    torch.testing.assert_close(ours[0].norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=1e-5)
    # relative: <R_m q, R_n k> depends on m - n only (same shift on both sides)
    shifted = position_ids + 123
    cos2, sin2 = rope_cos_sin(shifted, rope_inverse_frequencies(head_dim, theta, scaling), torch.float32)
    q1, k1 = apply_rope(q[:, :2], k, cos, sin)
    q2, k2 = apply_rope(q[:, :2], k, cos2, sin2)
    torch.testing.assert_close(q1 @ k1.transpose(-1, -2), q2 @ k2.transpose(-1, -2), atol=1e-3, rtol=1e-4)
    assert math.isfinite(float(cos.sum()))
