"""Attention's decoding path (titan_recur/models/blocks.py): grouped query heads folded into the query length."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from titan_recur.models.blocks import folded_gqa_attention


@pytest.mark.parametrize(("heads", "kv_heads", "seqlen"), [(8, 2, 1), (8, 2, 5), (6, 3, 4), (4, 1, 1)])
def test_folded_gqa_attention_equals_sdpa_with_enable_gqa(heads: int, kv_heads: int, seqlen: int) -> None:
    """Each query head h against K/V head h // G under the step's additive mask (a cache's whole capacity, the
    columns not yet written hidden): the folded kernel computes what SDPA's enable_gqa computes."""
    g = torch.Generator().manual_seed(0)
    bsz, capacity, head_dim = 3, 11, 16
    q = torch.randn(bsz, heads, seqlen, head_dim, generator=g)
    k, v = (torch.randn(bsz, kv_heads, capacity, head_dim, generator=g) for _ in range(2))
    visible = torch.rand(bsz, 1, seqlen, capacity, generator=g) < 0.6
    visible[..., 0] = True  # every query sees a key
    mask = torch.zeros(visible.shape).masked_fill_(~visible, -math.inf)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    folded = folded_gqa_attention(q, k, v, mask, heads // kv_heads)
    torch.testing.assert_close(folded, expected, atol=1e-6, rtol=1e-6)
