"""The generation engine: ``generate`` at any test-time depth (docs/generation.md).

One engine for everything that decodes (the CLI ``python -m titan_recur.generate``, the lm-eval model, the
HF export's ``generate``). The prompt is one forward of the model into a preallocated ``KVCache`` (K/V
shared across iterations as ``kv_sharing`` says); every new token is one step of a ``DecodeProgram``
(inference/decode_program.py), compiled or not: per-token adaptive exit, a warm-started recurrent state,
seeded sampling and speculative decoding all run there. Left-padded batches are exact: every row gets
the tokens and per-token iteration counts it gets alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_recur.inference.decode_program import (
    DecodeProgram,
    program_for,
    speculative_columns,
    speculative_programs_for,
)
from titan_recur.inference.options import GenerationOptions, ResolvedOptions
from titan_recur.inference.sampling import draw_uniforms, sample_by_uniforms, token_probs
from titan_recur.models.cache import KVCache
from titan_recur.models.model import RecurrentLM

# With an EOS on a GPU: tokens between two reads of whether every row finished (each read a host sync).
FINISH_CHECK_EVERY = 8


@dataclass
class GenerationOutput:
    """tokens (B, N): the new tokens (rows that finished early continue with eos_id); steps (B, N):
    core iterations each token's forward ran (0 once its row had finished); head_calls (B, N):
    coda + head evaluations per token (1, plus one per check for the logit-based exit criteria);
    lengths (B,): tokens each row generated before it finished (its EOS, or the token completing a
    stop sequence, included); kv_cache_bytes: the allocated K/V buffers; logits (B, N, V) fp32 when
    asked for; speculation: what speculative decoding drafted, accepted and spent (None otherwise)."""

    tokens: torch.Tensor
    steps: torch.Tensor
    head_calls: torch.Tensor
    lengths: torch.Tensor
    kv_cache_bytes: int
    logits: torch.Tensor | None = None
    speculation: SpeculationStats | None = None


def check_prompts(attention_mask: torch.Tensor, max_new_tokens: int, max_seq_len: int) -> None:
    """Every row has a real token, and the longest fits max_seq_len with the new tokens."""
    lengths = attention_mask.long().sum(-1).tolist() if attention_mask.numel() else [0] * attention_mask.shape[0]
    empty = [row for row, n in enumerate(lengths) if n == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty: generation needs at least one token to condition on")
    longest = max(lengths)
    if longest + max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's max_seq_len ({max_seq_len})"
        )


@torch.no_grad()
def generate(
    model: RecurrentLM,
    input_ids: torch.Tensor,
    options: GenerationOptions | ResolvedOptions,
    *,
    attention_mask: torch.Tensor | None = None,
    stop: Callable[[torch.Tensor], torch.Tensor] | None = None,
    forced_tokens: torch.Tensor | None = None,
    return_logits: bool = False,
) -> GenerationOutput:
    """Up to ``options.max_new_tokens`` new tokens per (left-padded) row of ``input_ids``.

    Rows emitting ``eos_id`` are finished and continue with it; ``stop(new_tokens)`` -> (B,) bool marks
    more rows finished (e.g. a stop string was generated); decoding ends once every row is.
    forced_tokens (B, max_new_tokens): feed these back instead of the chosen tokens (teacher forcing:
    the logits and depths of a given continuation, decoded token by token through the cache).
    On a GPU, whether every row finished is read every FINISH_CHECK_EVERY tokens only when no ``stop``
    is given (a host sync), and the tokens past the last row's end are cut off at the end.
    """
    opts = options.resolve(model.args)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_prompts(attention_mask, opts.max_new_tokens, model.args.max_seq_len)
    generator = opts.generator
    if opts.seed is not None and opts.temperature > 0:
        generator = torch.Generator(input_ids.device).manual_seed(opts.seed)
    if opts.draft_steps is not None:
        if forced_tokens is not None:
            raise ValueError("forced_tokens feeds every token back: there is nothing to draft (drop draft_steps)")
        return _generate_speculative(
            model, input_ids, attention_mask, opts, opts.draft_steps, generator, stop, return_logits
        )
    bsz, width = input_ids.shape
    uniforms = draw_uniforms((opts.max_new_tokens, bsz), generator, input_ids.device) if opts.temperature > 0 else None
    program = program_for(model, opts, bsz, width + opts.max_new_tokens)
    program.prefill(input_ids, attention_mask, uniforms)
    watch_finish = opts.eos_id is not None or stop is not None
    check_every = FINISH_CHECK_EVERY if input_ids.device.type == "cuda" and stop is None else 1
    tokens, steps, head_calls, logits = [], [], [], []
    for t in range(opts.max_new_tokens):
        tokens.append(program.token[:bsz, 0].clone())
        steps.append(program.token_steps[:bsz].clone())
        head_calls.append(program.token_head_calls[:bsz].clone())
        if return_logits:
            logits.append(program.logits[:bsz].clone())
        if stop is not None:  # the caller's mask may be on another device
            program.finished[:bsz] |= stop(torch.stack(tokens, dim=1)).to(program.finished.device)
        check_now = t % check_every == check_every - 1
        if t == opts.max_new_tokens - 1 or (watch_finish and check_now and bool(program.finished.all())):
            break
        if forced_tokens is not None:
            program.token[:bsz, 0] = forced_tokens[:, t]
        program.step()
    lengths = program.lengths[:bsz].clone()
    emitted = int(lengths.max()) if watch_finish else len(tokens)
    return GenerationOutput(
        tokens=torch.stack(tokens[:emitted], dim=1),
        steps=torch.stack(steps[:emitted], dim=1),
        head_calls=torch.stack(head_calls[:emitted], dim=1),
        lengths=lengths,
        kv_cache_bytes=program.cache.nbytes(),
        logits=torch.stack(logits[:emitted], dim=1) if return_logits else None,
    )


@dataclass
class SpeculationStats:
    """Per row: drafted tokens, drafted tokens accepted, verify rounds, and core iterations run (a draft
    forward counts draft_steps, a verify forward num_steps, whatever the number of positions it covers)."""

    drafted: torch.Tensor
    accepted: torch.Tensor
    rounds: torch.Tensor
    core_iterations: torch.Tensor

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over the batch."""
        drafted = int(self.drafted.sum())
        return int(self.accepted.sum()) / drafted if drafted else 0.0


def _generate_speculative(
    model: RecurrentLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    opts: ResolvedOptions,
    draft_steps: int,
    generator: torch.Generator | None,
    stop: Callable[[torch.Tensor], torch.Tensor] | None,
    return_logits: bool,
) -> GenerationOutput:
    """Depth-speculative decoding (docs/generation.md, "Speculative decoding").

    The cache holds every committed token but the last at the target depth. A round feeds the last
    token and ``lookahead`` - 1 drafts at ``draft_steps`` (lookahead steps of the draft program, one token
    each), and verifies [last, drafts] at ``num_steps`` in one forward of the verify program over the block,
    overwriting the drafts' columns; each row keeps its accepted prefix (``_accept``), and the next round
    starts after the longest one: a row that kept fewer leaves masked holes (the attention mask hides them
    and positions count real tokens only, as with left padding), so each row computes what it computes alone.
    """
    bsz, width = input_ids.shape
    device = input_ids.device
    k, r = opts.lookahead, opts.num_steps
    programs = speculative_programs_for(model, opts, bsz, speculative_columns(width, opts, bsz))
    draft_program, verify_program = programs.draft, programs.verify
    keys = torch.zeros(bsz, programs.cache.capacity, dtype=torch.bool, device=device)
    keys[:, :width] = attention_mask.bool()
    real = attention_mask.long().sum(-1)  # per row: real tokens cached = the next position

    def draws(n: int) -> torch.Tensor | None:
        return draw_uniforms((n, bsz), generator, device) if opts.temperature > 0 else None

    draft_program.prefill(input_ids, attention_mask, draws(1), num_steps=r)  # the prompt at the target depth
    last = draft_program.token[:bsz, 0].clone()
    rows = [_Row(opts, stop, device) for _ in range(bsz)]
    for b in range(bsz):
        rows[b].append([int(last[b])], draft_program.logits[b : b + 1] if return_logits else None)
    stats = SpeculationStats(*(torch.zeros(bsz, dtype=torch.long) for _ in range(4)))
    start = width  # the column the round's first forward writes
    while not all(row.finished for row in rows):
        left = max(row.left for row in rows if not row.finished)
        drafts = min(k, left - 1)  # no draft beyond the last token any row may still emit
        draft_tokens, draft_probs = _draft(draft_program, opts, last, real, start, keys, drafts, draws(drafts))
        block = torch.stack([last, *draft_tokens], dim=1)  # (B, drafts + 1)
        keys[:, start : start + drafts + 1] = True
        n = block.shape[1]
        verify_program.resume(block, real[:, None] + torch.arange(n, device=device), start, keys)
        verify_program.step()
        verify_logits = verify_program.logits[:bsz, :n].clone()
        accepted, bonus = _accept(block[:, 1:], draft_probs, verify_logits, opts, generator)
        live = torch.tensor([not row.finished for row in rows])
        kept = int(accepted[live].max())
        for b, row in enumerate(rows):
            if row.finished:
                continue
            n = int(accepted[b])
            stats.drafted[b] += drafts
            stats.rounds[b] += 1
            stats.core_iterations[b] += drafts * draft_steps + r
            new = [*block[b, 1 : n + 1].tolist(), int(bonus[b])]
            stats.accepted[b] += min(n, row.append(new, verify_logits[b, : n + 1] if return_logits else None))
            keys[b, start + n + 1 : start + kept + 1] = False  # this row's rejected drafts: holes
        start += kept + 1
        keys[:, start:] = False
        real += accepted + 1
        last = bonus
    return _speculative_output(rows, opts, programs.cache, stats, device)


def _draft(
    program: DecodeProgram,
    opts: ResolvedOptions,
    last: torch.Tensor,
    real: torch.Tensor,
    start: int,
    keys: torch.Tensor,
    drafts: int,
    draws: torch.Tensor | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``drafts`` tokens (B,) after ``last`` at draft_steps, written from column ``start``, and (sampling only,
    whose acceptance reads them) their sampling distributions (B, V)."""
    bsz = last.shape[0]
    program.resume(last[:, None], real[:, None], start, keys, draws)
    tokens, probs = [], []
    for _ in range(drafts):
        program.step()
        tokens.append(program.token[:bsz, 0].clone())
        if opts.temperature > 0:
            probs.append(token_probs(program.logits[:bsz], opts.temperature, opts.top_p, opts.top_k))
    return tokens, probs


class _Row:
    """One row's emitted tokens in speculative decoding, finished at EOS, a stop, or max_new_tokens."""

    def __init__(
        self, opts: ResolvedOptions, stop: Callable[[torch.Tensor], torch.Tensor] | None, device: torch.device
    ) -> None:
        self.opts, self.stop, self.device = opts, stop, device
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []
        self.finished = False

    @property
    def left(self) -> int:
        return self.opts.max_new_tokens - len(self.tokens)

    def append(self, tokens: list[int], logits: torch.Tensor | None) -> int:
        """Emit tokens in order until the row finishes; returns how many were emitted."""
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            if logits is not None:
                self.logits.append(logits[i].float())
            self.finished = (
                self.left == 0
                or token == self.opts.eos_id
                or (self.stop is not None and bool(self.stop(torch.tensor([self.tokens], device=self.device))[0]))
            )
            if self.finished:
                return i + 1
        return len(tokens)


def _accept(
    drafts: torch.Tensor,
    draft_probs: list[torch.Tensor],
    target_logits: torch.Tensor,
    opts: ResolvedOptions,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) drafts accepted and (B,) the verifier's next token, given drafts (B, n) and the target's logits
    (B, n + 1, V) at [last, drafts].

    Greedy: the longest prefix equal to the target's argmax, then its argmax. Sampling (the standard
    rule, Leviathan et al. 2023 / Chen et al. 2023): draft i is kept with probability min(1, p_i / q_i);
    at the first rejection the token is drawn from norm(max(p - q, 0)), after all n from p_n; the
    tokens are then distributed as sampling from p at every position.
    """
    n = drafts.shape[1]
    if opts.temperature == 0:
        target = target_logits.argmax(dim=-1)
        accepted = (drafts == target[:, :n]).long().cumprod(dim=1).sum(dim=1)
        return accepted, target.gather(1, accepted[:, None])[:, 0]
    p = token_probs(target_logits, opts.temperature, opts.top_p, opts.top_k)
    p = p / p.sum(dim=-1, keepdim=True)
    q = torch.stack(draft_probs, dim=1) if n else p[:, :0]
    q = q / q.sum(dim=-1, keepdim=True)
    p_draft = p[:, :n].gather(2, drafts[..., None])[..., 0]
    q_draft = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(p_draft.shape, generator=generator, device=p.device)
    accepted = (u * q_draft < p_draft).long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(p.shape[0], device=p.device)
    residual = p[rows, accepted] - F.pad(q, (0, 0, 0, 1))[rows, accepted]  # after all n: q is 0, p_n is left
    residual = residual.clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, accepted])
    return accepted, sample_by_uniforms(residual, draw_uniforms((p.shape[0],), generator, p.device))


def _speculative_output(
    rows: list[_Row], opts: ResolvedOptions, cache: KVCache, stats: SpeculationStats, device: torch.device
) -> GenerationOutput:
    """The rows' tokens as a GenerationOutput: (B, longest) padded after a row's end with eos_id (else 0);
    every emitted token is decided at num_steps (its ``steps``); the cost is in ``speculation``."""
    longest = max(len(row.tokens) for row in rows)
    pad = opts.eos_id if opts.eos_id is not None else 0
    tokens = torch.tensor([row.tokens + [pad] * (longest - len(row.tokens)) for row in rows], device=device)
    lengths = torch.tensor([len(row.tokens) for row in rows], device=device)
    emitted = torch.arange(longest, device=device)[None, :] < lengths[:, None]
    logits = None
    if rows[0].logits:  # asked for: a row's last logits repeat after its end
        logits = torch.stack([torch.stack(row.logits + row.logits[-1:] * (longest - len(row.logits))) for row in rows])
    return GenerationOutput(
        tokens=tokens,
        steps=emitted.long() * opts.num_steps,
        head_calls=emitted.long(),
        lengths=lengths,
        kv_cache_bytes=cache.nbytes(),
        logits=logits,
        speculation=stats,
    )


def greedy_generate(
    model: RecurrentLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    num_steps: int | None = None,
    eos_id: int | None = None,
    state_init: str = "zero",
    stop: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The new greedy tokens (B, N) at exactly ``num_steps`` iterations, exact KV cache (see ``generate``)."""
    options = GenerationOptions(
        max_new_tokens=max_new_tokens, num_steps=num_steps, eos_id=eos_id, state_init=state_init
    )
    return generate(model, input_ids, options, attention_mask=attention_mask, stop=stop).tokens


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token lists, left-padded to the longest: the engine's batch layout."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return input_ids, attention_mask
