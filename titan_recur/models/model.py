"""The depth-recurrent LM (docs/method.md): embed -> prelude -> recurrent core (looped) -> coda -> norm -> head.

Single-device code, free of parallelism. `titan_recur.training.parallelize` applies activation checkpointing,
compile and FSDP from outside, to the units this file exposes: `RecurrentLM.blocks()` (every
transformer block) and `RecurrentCore.iteration` (one pass through the core, the unit of the loop).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from titan_recur.models.args import DEFAULT_BACKPROP_DEPTH, ModelArgs
from titan_recur.models.blocks import AttentionContext, RMSNorm, TransformerBlock
from titan_recur.models.cache import KVCache
from titan_recur.models.loss import head_loss
from titan_recur.models.rope import rope_cos_sin, rope_inverse_frequencies

NumSteps = int | tuple[int, int] | None


class CoreIteration(nn.Module):
    """One pass through the core: s <- Core(A [s; e]), given the injection of ``RecurrentCore.inject``.

    It owns no parameters: it applies the adapter and blocks that `RecurrentCore` owns, so their
    names, their checkpoint keys and their FSDP unit stay the core's. It reads them from the core at
    every call, so a module that replaces one (a LoRA around the adapter) is the one applied. It is a
    module so that the parallelize recipe can checkpoint and compile one iteration like any block,
    and the generation engine can run iterations one at a time.
    """

    def __init__(self, core: RecurrentCore) -> None:
        super().__init__()
        # A tuple is not registered as a submodule (see the class docstring).
        self._owner = (core,)

    def forward(self, state: torch.Tensor, injected: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        core = self._owner[0]
        x = core.adapt(state, injected)
        for block in core.blocks:
            x = block(x, ctx)
        return x


class RecurrentCore(nn.Module):
    """The loop owner: adapter A, the R core blocks, the state init and the loop.

    It is one module so that FSDP can shard it as one unit: one all-gather per step however many
    times the loop runs.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.adapter = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.blocks = nn.ModuleList(TransformerBlock(args, ("core", j)) for j in range(args.n_core))
        self.iteration = CoreIteration(self)

    def forward(
        self,
        embedded: torch.Tensor,
        ctx: AttentionContext,
        num_steps: tuple[int, int],
        state_init: str,
        on_state: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """n iterations without grad, then k with grad (truncated backprop through depth).

        on_state: if given, called with the state after each iteration.
        """
        n_no_grad, n_grad = num_steps
        injected = self.inject(embedded)
        state = self.initial_state(embedded, state_init)
        with torch.no_grad():
            state = self.iterate(state, injected, iteration_contexts(ctx, 0, n_no_grad), on_state=on_state)
        return self.iterate(state, injected, iteration_contexts(ctx, n_no_grad, n_no_grad + n_grad), on_state=on_state)

    def iterate(
        self,
        state: torch.Tensor,
        injected: torch.Tensor,
        contexts: Sequence[AttentionContext],
        active: torch.Tensor | None = None,
        on_state: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """The loop over core iterations: one per context (``iteration_contexts``), in order; rows not
        ``active`` (B,) keep their state (None: all run).

        The unit the generation engine compiles: iteration indices never enter it, only contexts whose
        cache views have the same shapes, so one graph serves every run of ``len(contexts)`` iterations.
        """
        record = on_state or _ignore
        for ctx in contexts:
            new_state = self.iteration(state, injected, ctx)
            state = new_state if active is None else torch.where(active[:, None, None], new_state, state)
            record(state)
        return state

    def inject(self, embedded: torch.Tensor) -> torch.Tensor:
        """What every iteration adds for e: A_e e, the same in every iteration, so computed once per forward.

        A [s; e] = A_s s + A_e e saves one d x d product per token per iteration; the k grad
        iterations still send gradients to A_e and the prelude through this one product. The split
        reads the adapter's weight, which nothing that wraps or hooks the adapter module would see (a
        LoRA, an offload or quantisation hook): then e itself is returned and every iteration applies
        the module to [s; e] (see ``adapt``).
        """
        if not self.adapter_is_plain():
            return embedded
        return F.linear(embedded, self.adapter.weight[:, self.args.dim :])

    def adapt(self, state: torch.Tensor, injected: torch.Tensor) -> torch.Tensor:
        """A [s; e] of one iteration, given ``inject(e)``."""
        if not self.adapter_is_plain():
            return self.adapter(torch.cat([state, injected], dim=-1))
        return F.linear(state, self.adapter.weight[:, : self.args.dim]) + injected

    def adapter_is_plain(self) -> bool:
        """Whether the adapter is a bare nn.Linear that no hook or wrapper sees, so its weight may be split."""
        adapter = self.adapter
        hooked = adapter._forward_hooks or adapter._forward_pre_hooks or "forward" in adapter.__dict__
        return type(adapter) is nn.Linear and not hooked

    def initial_state(self, embedded: torch.Tensor, state_init: str) -> torch.Tensor:
        if state_init == "zero":
            return torch.zeros_like(embedded)
        if state_init == "embed":
            return embedded
        std = self.args.effective_state_std
        state = torch.empty_like(embedded)
        return nn.init.trunc_normal_(state, std=std, a=-3 * std, b=3 * std)

    def init_weights(self, std: float) -> None:
        for block in self.blocks:  # TransformerBlocks, or wrappers that forward attribute access to them
            cast(TransformerBlock, block).init_weights(std)
        if self.args.adapter_init == "identity":
            init_identity_adapter(self.adapter.weight)
        else:
            self.adapter.reset_parameters()


def iteration_contexts(ctx: AttentionContext, start: int, stop: int) -> tuple[AttentionContext, ...]:
    """The contexts of core iterations start .. stop - 1 (0-based): each sees its iteration's cache slots."""
    return tuple(ctx.at_iteration(i) for i in range(start, stop))


@dataclass
class Decoding:
    """The inputs of a forward through a KV cache (the generation engine's prompt, HF's generate).

    cache: the KV cache the forward reads and extends by its T positions (None: no cache).
    position_ids: (B, T) RoPE positions (default: from the attention mask, else past + arange(T)).
    head_positions: logits of the last this many positions only (None: every position).
    """

    cache: KVCache | None = None
    position_ids: torch.Tensor | None = None
    head_positions: int | None = None


@torch.no_grad()
def init_identity_adapter(weight: torch.Tensor) -> None:
    """A = [0 | I]: ignore the state, pass the prelude output through (the conversion's exactness init)."""
    dim = weight.shape[0]
    weight.zero_()
    weight[:, dim:].copy_(torch.eye(dim, dtype=weight.dtype, device=weight.device))


class LMHead(nn.Linear):
    """The output projection. Given labels, its forward returns the summed next-token loss instead of the
    logits (chunked when loss_chunk_tokens > 0), so the loss runs inside the head's own forward: a sharded
    head is then gathered, resharded and reduce-scattered on FSDP's schedule, like every other unit."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)

    def forward(
        self, hidden: torch.Tensor, labels: torch.Tensor | None = None, loss_chunk_tokens: int = 0
    ) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        return head_loss(hidden, self.weight, labels, loss_chunk_tokens)


class RecurrentLM(nn.Module):
    """Depth-recurrent LM; with ``n_core == 0`` it is the plain static source model (baselines).

    Tied embeddings are structural: the model then has no ``lm_head`` and projects with the
    embedding matrix, so no materialisation, cast or wrapper can untie them.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.prelude = nn.ModuleList(TransformerBlock(args, ("prelude", i)) for i in range(args.n_prelude))
        self.core = RecurrentCore(args) if args.is_recurrent else None
        self.coda = nn.ModuleList(TransformerBlock(args, ("coda", i)) for i in range(args.n_coda))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else LMHead(args.dim, args.vocab_size)
        # RoPE frequencies per device. Not a buffer: .to(dtype) would round them (bf16 is ~1 rad off per
        # 1000 positions) and to_empty would wipe them; they are a pure function of the config.
        self._rope_inv_freq: dict[torch.device, torch.Tensor] = {}
        self.rope_inv_freq(torch.device("cpu"))  # an unsupported rope scaling fails here, not mid-forward

    def forward(
        self,
        input_ids: torch.Tensor | None,
        num_steps: NumSteps = None,
        *,
        attention_mask: torch.Tensor | None = None,
        state_init: str | None = None,
        labels: torch.Tensor | None = None,
        loss_chunk_tokens: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        on_hidden_state: Callable[[torch.Tensor], None] | None = None,
        decoding: Decoding | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V), or with ``labels`` the summed next-token loss (fp32 scalar).

        The one place that composes the order: embed -> prelude -> core iterations -> coda -> norm -> head,
        for training, evaluation and a prompt's forward into a cache (``decoding``); a decoded token's step
        (inference/decode_program.py) runs the same pieces on static buffers.

        num_steps: (n, k) = n iterations without grad then k with grad (training); an int r = r
        iterations, all without grad (evaluation) unless the model is in train mode with grad enabled,
        where the last min(r, DEFAULT_BACKPROP_DEPTH) carry grad (same values, and every part trains);
        None = ``args.mean_recurrence``, as an int.
        attention_mask: (B, past + T) with 1 for real tokens (left padding); positions then count
        real tokens only, so a padded row computes exactly what it computes alone.
        state_init: None = the training init in train mode, the deterministic eval init in eval mode.
        labels: (B, T) next-token targets aligned with the positions (already shifted, IGNORE_INDEX
        for no loss); the loss is computed here, inside the model's forward, so that a sharded head
        is gathered for it. loss_chunk_tokens > 0 computes it chunk by chunk, never holding the full
        logits (``head_loss``).
        inputs_embeds: (B, T, d) embeddings in place of ``input_ids`` (give exactly one).
        on_hidden_state: if given, called with each hidden state (B, T, d) in order: the embeddings, each
        prelude block's output, the state after each core iteration, each coda block's output and the
        final norm's output (what the head reads), 2 + P + r + C calls. A callable, not a list, so that
        hooks that move a module's arguments between devices (accelerate's) pass it through unchanged.
        decoding: the KV cache, positions and head positions of a forward through a cache (``Decoding``).
        document_ids: (B, T) the document of each token of packed rows (non-decreasing along a row): a token
        then attends only to its own document, whose RoPE positions start at 0, so each document computes
        what it computes alone (training.attention_mask = "document"; not with a cache or positions).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        decoding = decoding or Decoding()
        tokens = cast(torch.Tensor, input_ids if inputs_embeds is None else inputs_embeds)  # exactly one is given
        ctx = self.attention_context(tokens, attention_mask, decoding.position_ids, decoding.cache, document_ids)
        x = self.embed_and_prelude(input_ids, ctx, inputs_embeds, on_hidden_state)
        if self.core is not None:
            depth = DEFAULT_BACKPROP_DEPTH if self.training and torch.is_grad_enabled() else None
            steps = resolve_num_steps(num_steps, self.args, backprop_depth=depth)
            x = self.core(x, ctx, steps, self.resolve_state_init(state_init), on_hidden_state)
        hidden = self.coda_and_norm(x, ctx, on_hidden_state)
        if decoding.cache is not None:
            decoding.cache.advance(tokens.shape[1])
        if labels is not None:
            return self.loss(hidden, labels, loss_chunk_tokens)
        head_from = 0 if decoding.head_positions is None else hidden.shape[1] - decoding.head_positions
        return self.head(hidden[:, head_from:])

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, loss_chunk_tokens: int) -> torch.Tensor:
        """The summed next-token loss of final-norm hidden states (chunked when loss_chunk_tokens > 0).

        An untied head computes it in its own forward (``LMHead``); a tied one is the root's embedding."""
        if self.lm_head is None:
            return head_loss(hidden, self.embed_tokens.weight, labels, loss_chunk_tokens)
        return self.lm_head(hidden, labels, loss_chunk_tokens)

    def embed_and_prelude(
        self,
        input_ids: torch.Tensor | None,
        ctx: AttentionContext,
        inputs_embeds: torch.Tensor | None = None,
        on_hidden_state: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        record = on_hidden_state or _ignore
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        record(x)
        for block in self.prelude:
            x = block(x, ctx)
            record(x)
        return x

    def coda_and_norm(
        self, x: torch.Tensor, ctx: AttentionContext, on_hidden_state: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """The coda blocks and the final norm: the hidden states the head reads."""
        record = on_hidden_state or _ignore
        for block in self.coda:
            x = block(x, ctx)
            record(x)
        x = self.norm(x)
        record(x)
        return x

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final-norm hidden states: the LM head, or the embedding matrix when tied."""
        return self.lm_head(hidden) if self.lm_head is not None else F.linear(hidden, self.embed_tokens.weight)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def new_cache(self, batch_size: int, capacity: int, num_steps: int, kv_sharing: str = "full") -> KVCache:
        """An empty KV cache for this model, in its parameters' dtype and on their device."""
        weight = self.embed_tokens.weight
        return KVCache.for_args(
            self.args, batch_size, capacity, num_steps, kv_sharing, dtype=weight.dtype, device=weight.device
        )

    def resolve_state_init(self, state_init: str | None) -> str:
        if state_init is not None:
            return state_init
        return self.args.state_init if self.training else self.args.eval_state_init

    def attention_context(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: KVCache | None,
        document_ids: torch.Tensor | None = None,
    ) -> AttentionContext:
        """RoPE tables, mask and cache of a forward; reads only the (B, T) shape and device of ``input_ids``
        (token ids, or embeddings). Built once per forward: every block and core iteration shares it."""
        bsz, seqlen = input_ids.shape[:2]
        past = cache.length if cache is not None else 0
        if document_ids is not None:
            if cache is not None or position_ids is not None:
                raise ValueError("document_ids are for whole packed rows: not with a KV cache or position_ids")
            position_ids = document_positions(document_ids)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past:]
            else:
                position_ids = torch.arange(past, past + seqlen, device=input_ids.device).expand(bsz, -1)
        cos, sin = rope_cos_sin(position_ids, self.rope_inv_freq(input_ids.device), self.embed_tokens.weight.dtype)
        mask = None
        if attention_mask is not None or cache is not None or document_ids is not None:
            key_length = cache.begin(seqlen) if cache is not None else past + seqlen
            mask = build_attention_mask(attention_mask, bsz, seqlen, past, input_ids.device, key_length, document_ids)
            if cache is not None:  # additive once per step, rather than converted from bool by every attention call
                mask = torch.zeros(mask.shape, dtype=cos.dtype, device=mask.device).masked_fill_(~mask, -math.inf)
        return AttentionContext(cos=cos, sin=sin, mask=mask, cache=cache)

    def rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        """The fp32 RoPE inverse frequencies on ``device`` (computed once per device)."""
        device = torch.device(device)
        if device not in self._rope_inv_freq:
            a = self.args
            self._rope_inv_freq[device] = rope_inverse_frequencies(a.head_dim, a.rope_theta, a.rope_scaling).to(device)
        return self._rope_inv_freq[device]

    def parameters_by_role(self) -> dict[str, list[tuple[str, nn.Parameter]]]:
        """Named parameters grouped by what they are, for optimizers that treat them differently.

        "hidden_matrix": every 2-D weight of the blocks and the adapter (Muon's share); "embedding";
        "head" (absent when tied: the head is the embedding); "vector": norm weights and biases.
        """
        roles: dict[str, list[tuple[str, nn.Parameter]]] = {
            "hidden_matrix": [],
            "embedding": [],
            "head": [],
            "vector": [],
        }
        for name, param in self.named_parameters():
            if name.startswith("embed_tokens."):
                roles["embedding"].append((name, param))
            elif name.startswith("lm_head."):
                roles["head"].append((name, param))
            else:
                roles["hidden_matrix" if param.ndim == 2 else "vector"].append((name, param))
        return roles

    def blocks(self) -> list[nn.Module]:
        """Every transformer block, in order: prelude, core (once each), coda."""
        core = list(self.core.blocks) if self.core is not None else []
        return [*self.prelude, *core, *self.coda]

    def block_stacks(self) -> list[nn.ModuleList]:
        """The prelude and the coda: the stacks of blocks that run once per forward.

        Each of their blocks is a unit of its own for checkpointing, compile and sharding; the core,
        which runs r times, is one unit (see ``core.iteration``).
        """
        return [self.prelude, self.coda]

    def once_blocks(self) -> list[nn.Module]:
        """The blocks of ``block_stacks``, in forward order."""
        return [block for stack in self.block_stacks() for block in stack]

    def init_weights(self, std: float = 0.02) -> None:
        """Random init for from-scratch runs and tests (conversions load weights instead)."""
        nn.init.normal_(self.embed_tokens.weight, std=std)
        for block in self.once_blocks():  # TransformerBlocks, or wrappers that forward attribute access to them
            cast(TransformerBlock, block).init_weights(std)
        if self.core is not None:
            self.core.init_weights(std)
        self.norm.reset_parameters()
        if self.lm_head is not None:
            nn.init.trunc_normal_(self.lm_head.weight, std=std, a=-3 * std, b=3 * std)


def _ignore(hidden_state: torch.Tensor) -> None:
    """The hidden-state callback when none is given."""


def resolve_num_steps(num_steps: NumSteps, args: ModelArgs, backprop_depth: int | None = None) -> tuple[int, int]:
    """Normalise num_steps to (n_no_grad, k_grad).

    An int r (None: ``args.mean_recurrence``) is an all-no-grad evaluation depth, or, given a
    ``backprop_depth`` d (a training forward), the same r iterations with the last min(r, d) carrying grad.
    """
    if num_steps is None:
        num_steps = args.mean_recurrence
    if isinstance(num_steps, int):
        k = min(num_steps, backprop_depth) if backprop_depth is not None else 0
        num_steps = (num_steps - k, k)
    n, k = (int(v) for v in num_steps)
    if n < 0 or k < 0 or n + k < 1:
        raise ValueError(f"num_steps must give at least one iteration and no negative counts, got {num_steps}")
    return n, k


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions (B, L) of a (B, L) mask of real tokens: each real token's count of real tokens before it
    (left padding gets 0), so a padded row computes what it computes alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_attention_mask(
    attention_mask: torch.Tensor | None,
    bsz: int,
    seqlen: int,
    past: int,
    device: torch.device,
    key_length: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean (B, 1, T, key_length): causal, padding keys hidden, each query always sees itself.

    key_length (default past + T) may exceed past + T (a preallocated cache's buffer): the causal
    condition hides the columns not yet written. Letting a padding query see itself keeps its softmax
    finite; no real token ever attends to it. document_ids (B, T), without a past: keys of other
    documents hidden too (block-diagonal causal).
    """
    total = past + seqlen if key_length is None else key_length
    query_pos = torch.arange(past, past + seqlen, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    mask = (key_pos <= query_pos).expand(bsz, 1, seqlen, total)
    if attention_mask is not None:
        keys = attention_mask.bool()[:, :total]
        mask = mask & F.pad(keys, (0, total - keys.shape[1]))[:, None, None, :]
    if document_ids is not None:
        mask = mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    return mask | (key_pos == query_pos)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) RoPE positions that restart at 0 where a row's document id changes."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0), value=True)
    return index - torch.where(starts, index, 0).cummax(dim=-1).values
