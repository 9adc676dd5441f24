"""The depth-recurrent LM (SPEC §1): embed -> prelude -> recurrent core (looped) -> coda -> norm -> head.

Single-device code. Parallelism, compile and activation checkpointing are applied from outside by
`titan_recur.parallelize`; the only hook it uses here is `RecurrentCore.checkpoint_iterations`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from titan_recur.models.args import ModelArgs
from titan_recur.models.blocks import AttentionContext, KVCache, RMSNorm, TransformerBlock
from titan_recur.models.rope import rope_cos_sin, rope_inverse_frequencies

NumSteps = int | tuple[int, int] | None


class RecurrentCore(nn.Module):
    """The loop owner: adapter A, the R core blocks, the state init and the loop.

    It is one module so that FSDP can shard it as one unit: one all-gather per step however many
    times the loop runs.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.adapter = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.blocks = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_core))
        # Set by the parallelize recipe: recompute each grad-carrying iteration in backward.
        self.checkpoint_iterations = False

    def forward(
        self, embedded: torch.Tensor, ctx: AttentionContext, num_steps: tuple[int, int], state_init: str
    ) -> torch.Tensor:
        """n iterations without grad, then k with grad (truncated backprop through depth).

        A [s; e] = A_s s + A_e e, and A_e e is the same in every iteration: it is computed once, with
        grad, so the k grad iterations still send gradients to A_e and the prelude through it.
        """
        n_no_grad, n_grad = num_steps
        injected = F.linear(embedded, self.adapter.weight[:, self.args.dim :])
        state = self.initial_state(embedded, state_init)
        with torch.no_grad():
            for i in range(n_no_grad):
                state = self._iterate(state, injected, ctx, i)
        for i in range(n_no_grad, n_no_grad + n_grad):
            if self.checkpoint_iterations and torch.is_grad_enabled():
                state = checkpoint(self._iterate, state, injected, ctx, i, use_reentrant=False)
            else:
                state = self._iterate(state, injected, ctx, i)
        return state

    def _iterate(self, state: torch.Tensor, injected: torch.Tensor, ctx: AttentionContext, i: int) -> torch.Tensor:
        x = F.linear(state, self.adapter.weight[:, : self.args.dim]) + injected
        for j, block in enumerate(self.blocks):
            # The slot name is only used with a KV cache; "" keeps compiled blocks free of per-call constants.
            x = block(x, ctx, f"core.{j}.{i}" if ctx.cache is not None else "")
        return x

    def initial_state(self, embedded: torch.Tensor, state_init: str) -> torch.Tensor:
        if state_init == "zero":
            return torch.zeros_like(embedded)
        if state_init == "embed":
            return embedded
        std = self.args.effective_state_std
        state = torch.empty_like(embedded)
        return nn.init.trunc_normal_(state, std=std, a=-3 * std, b=3 * std)

    def init_weights(self, std: float) -> None:
        for block in self.blocks:
            block.init_weights(std)
        if self.args.adapter_init == "identity":
            init_identity_adapter(self.adapter.weight)
        else:
            self.adapter.reset_parameters()


@torch.no_grad()
def init_identity_adapter(weight: torch.Tensor) -> None:
    """A = [0 | I]: ignore the state, pass the prelude output through (the conversion's exactness init)."""
    dim = weight.shape[0]
    weight.zero_()
    weight[:, dim:].copy_(torch.eye(dim, dtype=weight.dtype, device=weight.device))


class RecurrentLM(nn.Module):
    """Depth-recurrent LM; with ``n_core == 0`` it is the plain static source model (baselines)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.prelude = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_prelude))
        self.core = RecurrentCore(args) if args.is_recurrent else None
        self.coda = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_coda))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer(
            "inv_freq", rope_inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        num_steps: NumSteps = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        state_init: str | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V).

        num_steps: (n, k) = n iterations without grad then k with grad (training); an int r = r
        iterations, all without grad (evaluation); None = ``args.mean_recurrence`` without grad.
        attention_mask: (B, past + T) with 1 for real tokens (left padding); positions then count
        real tokens only, so a padded row computes exactly what it computes alone.
        """
        ctx = self._attention_context(input_ids, attention_mask, position_ids, cache)
        x = self.embed_tokens(input_ids)
        for i, block in enumerate(self.prelude):
            x = block(x, ctx, f"prelude.{i}" if cache is not None else "")
        if self.core is not None:
            x = self.core(x, ctx, resolve_num_steps(num_steps, self.args), state_init or self.args.state_init)
        for i, block in enumerate(self.coda):
            x = block(x, ctx, f"coda.{i}" if cache is not None else "")
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self.lm_head(self.norm(x))

    def _attention_context(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: KVCache | None,
    ) -> AttentionContext:
        bsz, seqlen = input_ids.shape
        past = cache.length if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, past + seqlen, device=input_ids.device).expand(bsz, -1)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, self.embed_tokens.weight.dtype)
        mask = None
        if attention_mask is not None or past > 0:
            mask = build_attention_mask(attention_mask, bsz, seqlen, past, input_ids.device)
        return AttentionContext(cos=cos, sin=sin, mask=mask, cache=cache)

    def init_weights(self, std: float = 0.02) -> None:
        """Random init for from-scratch runs and tests (conversions load weights instead)."""
        nn.init.normal_(self.embed_tokens.weight, std=std)
        for block in [*self.prelude, *self.coda]:
            block.init_weights(std)
        if self.core is not None:
            self.core.init_weights(std)
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            nn.init.trunc_normal_(self.lm_head.weight, std=std, a=-3 * std, b=3 * std)
        self.reset_rope_buffer()

    def _apply(self, fn, recurse=True):
        # Moving off the meta device (to_empty) makes new Parameters per module, which would untie the
        # head from the embedding: tie them again. And .to(dtype) casts float buffers too; RoPE
        # frequencies rounded to bf16 are off by ~1 rad per 1000 positions: recompute them in fp32.
        super()._apply(fn, recurse)
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_rope_buffer()
        return self

    def reset_rope_buffer(self) -> None:
        """Recompute the (non-persistent) RoPE table, e.g. after materialising from the meta device."""
        device = self.embed_tokens.weight.device
        self.inv_freq = rope_inverse_frequencies(self.args.head_dim, self.args.rope_theta, self.args.rope_scaling).to(
            device
        )


def resolve_num_steps(num_steps: NumSteps, args: ModelArgs) -> tuple[int, int]:
    """Normalise num_steps to (n_no_grad, k_grad); an int is an all-no-grad evaluation depth."""
    if num_steps is None:
        num_steps = args.mean_recurrence
    if isinstance(num_steps, int):
        num_steps = (num_steps, 0)
    n, k = (int(v) for v in num_steps)
    if n < 0 or k < 0 or n + k < 1:
        raise ValueError(f"num_steps must give at least one iteration and no negative counts, got {num_steps}")
    return n, k


def build_attention_mask(
    attention_mask: torch.Tensor | None, bsz: int, seqlen: int, past: int, device: torch.device
) -> torch.Tensor:
    """Boolean (B, 1, T, past + T): causal, padding keys hidden, each query always sees itself.

    Letting a padding query see itself keeps its softmax finite; no real token ever attends to it.
    """
    total = past + seqlen
    query_pos = torch.arange(past, total, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    mask = (key_pos <= query_pos).expand(bsz, 1, seqlen, total)
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :total]
    return mask | (key_pos == query_pos)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token loss over valid (non-ignored) labels, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=ignore_index)
