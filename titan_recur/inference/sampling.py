"""The token choice of every decoding path: argmax, or a top-k/top-p sample picked by a uniform draw.

The draws are tensors made before decoding, so the choice holds no RNG call: a compiled or captured
decode step can make it, and eager and compiled decoding pick the same tokens from the same seed.
"""

from __future__ import annotations

from typing import cast

import torch

Knob = float | torch.Tensor  # a value, or a 0-dim device tensor a compiled step reads without recompiling


def token_probs(
    logits: torch.Tensor, temperature: Knob, top_p: Knob, top_k: int, nucleus: bool | None = None
) -> torch.Tensor:
    """(..., V) fp32 sampling distribution of logits, as transformers' warpers make it: the softmax at
    ``temperature`` (> 0) of the ``top_k`` largest logits (0: all; ties with the k-th kept), restricted to the
    smallest set of tokens whose mass reaches ``top_p`` (always the most likely token), renormalised by the
    sampler. ``nucleus``: whether the top-p cut applies (None: top_p < 1; given where top_p is a tensor, whose
    value a compiled step must not read on the host)."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if bool(top_p < 1) if nucleus is None else nucleus:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def choose_tokens(
    logits: torch.Tensor,
    temperature: Knob,
    top_p: Knob,
    top_k: int,
    uniforms: torch.Tensor | None,
    *,
    greedy: bool | None = None,
    nucleus: bool | None = None,
) -> torch.Tensor:
    """(B,) next tokens from (B, V) logits: argmax at temperature 0 (``greedy``, None: read from a float
    temperature), else the top-k/top-p sample that the uniform draws (B,) in [0, 1) pick (``sample_by_uniforms``)."""
    if bool(temperature == 0) if greedy is None else greedy:
        return logits.argmax(dim=-1)
    return sample_by_uniforms(token_probs(logits, temperature, top_p, top_k, nucleus), cast(torch.Tensor, uniforms))


def sample_by_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(B,) samples of the (B, V) unnormalised distributions by inverse CDF: the first token whose
    cumulative mass exceeds ``uniforms`` (B,) x total. The draws are tensors made before decoding, so
    the choice has no RNG call inside a compiled or captured step, and eager and compiled decoding
    pick the same tokens from the same seed. A token of mass 0 is never picked (u < 1)."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]
    return (cdf <= target).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


def draw_uniforms(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """fp32 uniforms in [0, 1) for the sampler, from ``generator`` (None: torch's global RNG)."""
    return torch.rand(shape, generator=generator, device=device)
