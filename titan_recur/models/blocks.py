"""Transformer blocks of the source models, unchanged: each family's decoder layer (models/families.py):
Llama-style pre-norm (Llama, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms, Mistral) and OLMo-2's
post-norm with q/k norms.

Submodule names follow HF's (self_attn.q_proj, mlp.gate_proj, input_layernorm, ...) so a converted
checkpoint is the source checkpoint with renumbered layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from titan_recur.models.args import ModelArgs
from titan_recur.models.cache import BlockSlot, IterationView, KVCache
from titan_recur.models.families import family_named
from titan_recur.models.rope import apply_rope


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as both source families do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


@dataclass
class AttentionContext:
    """Per-forward inputs shared by every block and every iteration: RoPE tables, mask, KV cache.

    Inside core iteration i the cache is the KV cache's view of iteration i (``at_iteration``), so the
    iteration index never reaches a block, nor a compiled graph (training passes no cache).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    # (B, 1, T, S) mask: boolean (True = attend) or additive; None means plain causal attention without a cache.
    mask: torch.Tensor | None = None
    cache: KVCache | IterationView | None = None

    def at_iteration(self, iteration: int) -> AttentionContext:
        """The context of core iteration ``iteration`` (itself when no cache needs to know it)."""
        if self.cache is None:
            return self
        # The forward's context holds the KVCache itself; only the contexts made here hold views.
        return dataclasses.replace(self, cache=cast(KVCache, self.cache).iteration_view(iteration))


class Attention(nn.Module):
    """GQA causal self-attention with RoPE; the family may bias q/k/v and RMSNorm the projected q and k,
    over the whole projection (OLMo-2) or per head (Qwen3)."""

    def __init__(self, args: ModelArgs, slot: BlockSlot) -> None:
        super().__init__()
        family = family_named(args.block_type)
        self.slot = slot
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        qkv_bias = args.attention_bias or family.qkv_bias
        self.q_proj = nn.Linear(args.dim, q_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(args.dim, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(args.dim, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(q_dim, args.dim, bias=args.attention_bias)
        self.qk_norm = family.qk_norm
        if self.qk_norm != "none":
            per_head = self.qk_norm == "per_head"
            self.q_norm = RMSNorm(args.head_dim if per_head else q_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim if per_head else kv_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, ctx.cos, ctx.sin)
        groups = self.n_heads // self.n_kv_heads
        mask = ctx.mask
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.slot, k, v)
            if mask is not None and mask.shape[-1] > k.shape[-2]:  # a cache read short of its capacity
                mask = mask[..., : k.shape[-2]]
        if ctx.cache is not None and groups > 1:  # decoding: every kernel reads the cache once
            out = folded_gqa_attention(q, k, v, mask, groups)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=groups > 1)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))


def folded_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, groups: int
) -> torch.Tensor:
    """Grouped-query attention over a KV cache with each group folded into the query length: queries (B, H, T, D)
    become (B, H_kv, G x T, D) against the cache's own keys (B, H_kv, S, D). SDPA's ``enable_gqa`` with a mask
    may take a kernel that repeats K/V per call (the whole cache, every block, every token); folded, every
    kernel reads the cache once. Query head h uses K/V head h // G, as ``enable_gqa`` does."""
    bsz, n_heads, seqlen, head_dim = q.shape
    folded = q.reshape(bsz, n_heads // groups, groups * seqlen, head_dim)
    if mask is not None:  # (B, 1, T, S): the same for every head of a group
        mask = mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * seqlen, -1)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask)
    return out.reshape(bsz, n_heads, seqlen, head_dim)


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """One source-model layer: pre-norm (Llama-style) or OLMo-2's reordered post-norm, as the family says."""

    def __init__(self, args: ModelArgs, slot: BlockSlot) -> None:
        super().__init__()
        self.pre_norm = family_named(args.block_type).pre_norm
        self.self_attn = Attention(args, slot)
        self.mlp = FeedForward(args)
        if self.pre_norm:
            self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
            self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        else:
            self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
            self.post_feedforward_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        if self.pre_norm:
            h = x + self.self_attn(self.input_layernorm(x), ctx)
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(self.self_attn(x, ctx))
        return h + self.post_feedforward_layernorm(self.mlp(h))

    def init_weights(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
