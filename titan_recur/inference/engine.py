"""The generation engine: decoding at any test-time depth (docs/generation.md).

One engine for everything that decodes (the CLI ``python -m titan_recur.generate``, the lm-eval model,
the HF export's ``generate``). It runs the model's own units step by step (``attention_context``,
``embed_and_prelude``, ``RecurrentCore.iteration``, ``coda_and_norm``, ``head``) through a preallocated
``KVCache`` with K/V sharing across iterations, and adds per-token adaptive exit, a warm-started
recurrent state and seeded sampling. Left-padded batches are exact: every row gets the tokens and
per-token iteration counts it gets alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from titan_recur.inference.decode_program import program_for, speculative_columns, speculative_programs_for
from titan_recur.inference.exit_criteria import DEFAULT_EXIT_THRESHOLDS, EXIT_CRITERIA, ExitCriterion
from titan_recur.inference.options import GenerationOptions
from titan_recur.inference.sampling import choose_tokens, draw_uniforms, sample_by_uniforms, token_probs
from titan_recur.models.args import WARM_START
from titan_recur.models.blocks import AttentionContext
from titan_recur.models.cache import KVCache
from titan_recur.models.model import CoreResult, Decoding, RecurrentCore, RecurrentLM, iteration_contexts

# The names other modules import from the engine, which defines them elsewhere.
__all__ = [
    "DEFAULT_EXIT_THRESHOLDS",
    "EXIT_CRITERIA",
    "WARM_START",
    "ExitCriterion",
    "GenerationOptions",
    "choose_tokens",
    "token_probs",
]
# Fast path with an EOS: tokens between two reads of whether every row finished (each read a host sync).
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
    options: GenerationOptions,
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
    """
    opts = options.resolve(model.args)
    assert opts.num_steps is not None  # resolved
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_prompts(attention_mask, opts.max_new_tokens, model.args.max_seq_len)
    generator = opts.generator
    if opts.seed is not None and opts.temperature > 0:
        generator = torch.Generator(input_ids.device).manual_seed(opts.seed)
    if opts.draft_steps is not None:
        if forced_tokens is not None:
            raise ValueError("forced_tokens feeds every token back: there is nothing to draft (drop draft_steps)")
        return _generate_speculative(model, input_ids, attention_mask, opts, generator, stop, return_logits)
    bsz, width = input_ids.shape
    device = input_ids.device
    uniforms = draw_uniforms((opts.max_new_tokens, bsz), generator, device) if opts.temperature > 0 else None
    if opts.compile if opts.compile is not None else device.type == "cuda":
        return _generate_static(model, input_ids, attention_mask, opts, uniforms, stop, forced_tokens, return_logits)
    cache = model.new_cache(bsz, width + opts.max_new_tokens, opts.num_steps, opts.kv_sharing)
    # Which cache columns hold a real token: the prompt's, then each decoded one.
    keys = torch.zeros(bsz, cache.capacity, dtype=torch.bool, device=device)
    keys[:, :width] = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    decoder = _Decoder(model, cache, opts)
    step = decoder.forward(input_ids, positions, keys)
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)
    lengths = torch.zeros(bsz, dtype=torch.long, device=device)
    tokens, steps, head_calls, logits = [], [], [], []
    for t in range(opts.max_new_tokens):
        if return_logits:
            logits.append(step.logits[:, -1].float())
        token = choose_tokens(
            step.logits[:, -1], opts.temperature, opts.top_p, opts.top_k, None if uniforms is None else uniforms[t]
        )
        if opts.eos_id is not None:
            token = torch.where(finished, torch.full_like(token, opts.eos_id), token)
        tokens.append(token)
        steps.append(step.steps.masked_fill(finished, 0))
        head_calls.append(step.head_calls.masked_fill(finished, 0))
        lengths += ~finished
        if opts.eos_id is not None:
            finished |= token == opts.eos_id
        if stop is not None:
            finished |= stop(torch.stack(tokens, dim=1)).to(device)  # the caller's mask may be on another device
        if t == opts.max_new_tokens - 1 or ((opts.eos_id is not None or stop is not None) and bool(finished.all())):
            break
        keys[:, width + t] = True
        positions = positions[:, -1:] + 1
        # A static model has no state to warm-start from.
        warm = step.state[:, -1:] if opts.state_init == WARM_START and step.state is not None else None
        fed = token if forced_tokens is None else forced_tokens[:, t]
        step = decoder.forward(fed[:, None], positions, keys, running=~finished, warm_state=warm)
    return GenerationOutput(
        tokens=torch.stack(tokens, dim=1),
        steps=torch.stack(steps, dim=1),
        head_calls=torch.stack(head_calls, dim=1),
        lengths=lengths,
        kv_cache_bytes=cache.nbytes(),
        logits=torch.stack(logits, dim=1) if return_logits else None,
    )


def _generate_static(
    model: RecurrentLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    opts: GenerationOptions,
    uniforms: torch.Tensor | None,
    stop: Callable[[torch.Tensor], torch.Tensor] | None,
    forced_tokens: torch.Tensor | None,
    return_logits: bool,
) -> GenerationOutput:
    """``generate``'s loop on the fast path (inference/decode_program.py): the prompt prefilled eagerly
    into the program's cache, then one program step per token; the same tokens, depths and logits.

    With an EOS and no ``stop``, whether every row finished is read every FINISH_CHECK_EVERY tokens
    only (a host sync), and the tokens past the last row's end are cut off at the end.
    """
    bsz, width = input_ids.shape
    program = program_for(model, opts, bsz, width + opts.max_new_tokens)

    def prefill(cache: KVCache, ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> _Step:
        return _Decoder(model, cache, opts).forward(ids, positions, keys)

    program.prefill(input_ids, attention_mask, uniforms, prefill)
    watch_finish = opts.eos_id is not None or stop is not None
    tokens, steps, head_calls, logits = [], [], [], []
    for t in range(opts.max_new_tokens):
        tokens.append(program.token[:bsz, 0].clone())
        steps.append(program.token_steps[:bsz].clone())
        head_calls.append(program.token_head_calls[:bsz].clone())
        if return_logits:
            logits.append(program.logits[:bsz].clone())
        if stop is not None:
            program.finished[:bsz] |= stop(torch.stack(tokens, dim=1)).to(program.finished.device)
        check_now = stop is not None or t % FINISH_CHECK_EVERY == FINISH_CHECK_EVERY - 1
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
    opts: GenerationOptions,
    generator: torch.Generator | None,
    stop: Callable[[torch.Tensor], torch.Tensor] | None,
    return_logits: bool,
) -> GenerationOutput:
    """Depth-speculative decoding (docs/generation.md, "Speculative decoding").

    The cache holds every committed token but the last at the target depth. A round feeds the last
    token and ``lookahead`` - 1 drafts at ``draft_steps`` (lookahead draft forwards, one token each),
    and verifies [last, drafts] at ``num_steps`` in one forward over the block, overwriting the drafts'
    columns; each row keeps its accepted prefix (``_accept``), and the next round starts after the
    longest one: a row that kept fewer leaves masked holes (the attention mask hides them and positions
    count real tokens only, as with left padding), so each row computes what it computes alone.
    Drafts and verifies run eagerly or, with ``compile``, as decode programs (``_FastSpeculation``).
    """
    assert opts.num_steps is not None and opts.draft_steps is not None  # resolved, and generate's test for a draft
    bsz, width = input_ids.shape
    device = input_ids.device
    k, r = opts.lookahead, opts.num_steps
    fast = opts.compile if opts.compile is not None else device.type == "cuda"
    runner = (_FastSpeculation if fast else _EagerSpeculation)(model, opts, bsz, width)
    keys = torch.zeros(bsz, runner.cache.capacity, dtype=torch.bool, device=device)
    keys[:, :width] = attention_mask.bool()
    real = attention_mask.long().sum(-1)  # per row: real tokens cached = the next position

    def draws(n: int) -> torch.Tensor | None:
        return draw_uniforms((n, bsz), generator, device) if opts.temperature > 0 else None

    last, prompt_logits = runner.prefill(input_ids, attention_mask, keys, draws(1))
    rows = [_Row(opts, stop, device) for _ in range(bsz)]
    for b in range(bsz):
        rows[b].append([int(last[b])], prompt_logits[b : b + 1] if return_logits else None)
    stats = SpeculationStats(*(torch.zeros(bsz, dtype=torch.long) for _ in range(4)))
    start = width  # the column the round's first forward writes
    while not all(row.finished for row in rows):
        left = max(row.left for row in rows if not row.finished)
        drafts = min(k, left - 1)  # no draft beyond the last token any row may still emit
        keys = _columns(keys, start + drafts + 1)
        draft_tokens, draft_logits = runner.draft(last, real, start, keys, drafts, draws(drafts))
        sampled = opts.temperature > 0
        draft_probs = [
            token_probs(logits, opts.temperature, opts.top_p, opts.top_k) for logits in draft_logits if sampled
        ]
        block = torch.stack([last, *draft_tokens], dim=1)  # (B, drafts + 1)
        keys[:, start : start + drafts + 1] = True
        verify_logits = runner.verify(block, real, start, keys)
        accepted, bonus = _accept(block[:, 1:], draft_probs, verify_logits, opts, generator)
        live = torch.tensor([not row.finished for row in rows])
        kept = int(accepted[live].max())
        for b, row in enumerate(rows):
            if row.finished:
                continue
            n = int(accepted[b])
            stats.drafted[b] += drafts
            stats.rounds[b] += 1
            stats.core_iterations[b] += drafts * opts.draft_steps + r
            new = [*block[b, 1 : n + 1].tolist(), int(bonus[b])]
            stats.accepted[b] += min(n, row.append(new, verify_logits[b, : n + 1] if return_logits else None))
            keys[b, start + n + 1 : start + kept + 1] = False  # this row's rejected drafts: holes
        start += kept + 1
        runner.keep(start)
        keys[:, start:] = False
        real += accepted + 1
        last = bonus
    return _speculative_output(rows, opts, runner.cache, stats, device)


class _EagerSpeculation:
    """Speculative decoding's forwards through the eager path: a cache that grows when holes fill it."""

    def __init__(self, model: RecurrentLM, opts: GenerationOptions, bsz: int, width: int) -> None:
        self.opts = opts
        k, r = opts.lookahead, cast(int, opts.num_steps)  # resolved
        self.cache = model.new_cache(bsz, width + opts.max_new_tokens + k + 1, r, opts.kv_sharing)
        self.decoder = _Decoder(model, self.cache, opts)

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys: torch.Tensor, draws: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt at the target depth: the first token (B,) and its logits (B, V)."""
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = self.decoder.forward(input_ids, positions, keys).logits[:, -1]
        return self._choose(logits, draws, 0), logits

    def draft(
        self,
        last: torch.Tensor,
        real: torch.Tensor,
        start: int,
        keys: torch.Tensor,
        drafts: int,
        draws: torch.Tensor | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``drafts`` tokens (B,) after ``last`` at draft_steps, written from column ``start``, and their logits (B, V)."""
        tokens, logits, fed = [], [], last
        for i in range(drafts):
            keys[:, start + i] = True
            step = self.decoder.forward(fed[:, None], (real + i)[:, None], keys, num_steps=self.opts.draft_steps)
            fed = self._choose(step.logits[:, -1], draws, i)
            tokens.append(fed)
            logits.append(step.logits[:, -1])
        return tokens, logits

    def verify(self, block: torch.Tensor, real: torch.Tensor, start: int, keys: torch.Tensor) -> torch.Tensor:
        """The target's logits (B, n, V) at every position of ``block`` (B, n), written from column ``start``."""
        self.cache.crop(start)  # the drafts' columns are overwritten at the target depth
        n = block.shape[1]
        positions = real[:, None] + torch.arange(n, device=block.device)
        return self.decoder.forward(block, positions, keys, num_steps=self.opts.num_steps, head_positions=n).logits

    def keep(self, length: int) -> None:
        """The next round writes from column ``length``."""
        self.cache.crop(length)

    def _choose(self, logits: torch.Tensor, draws: torch.Tensor | None, index: int) -> torch.Tensor:
        opts = self.opts
        return choose_tokens(logits, opts.temperature, opts.top_p, opts.top_k, None if draws is None else draws[index])


class _FastSpeculation:
    """Speculative decoding's forwards on the fast path: drafts as steps of a decode program at
    draft_steps, the verify as one forward of a VerifyProgram, in a cache with room for every hole."""

    def __init__(self, model: RecurrentLM, opts: GenerationOptions, bsz: int, width: int) -> None:
        self.model, self.opts, self.bsz = model, opts, bsz
        self.programs = speculative_programs_for(model, opts, bsz, speculative_columns(width, opts, bsz))
        self.cache = self.programs.cache

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys: torch.Tensor, draws: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt at the target depth (eagerly, into the programs' cache): the first token and its logits."""

        def forward(cache: KVCache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> _Step:
            return _Decoder(self.model, cache, self.opts).forward(ids, positions, mask)

        draft = self.programs.draft
        draft.prefill(input_ids, attention_mask, draws, forward)
        return draft.token[: self.bsz, 0].clone(), draft.logits[: self.bsz].clone()

    def draft(
        self,
        last: torch.Tensor,
        real: torch.Tensor,
        start: int,
        keys: torch.Tensor,
        drafts: int,
        draws: torch.Tensor | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        program, bsz = self.programs.draft, self.bsz
        program.resume(last[:, None], real[:, None], start, keys, draws)
        tokens, logits = [], []
        for _ in range(drafts):
            program.step()
            tokens.append(program.token[:bsz, 0].clone())
            if self.opts.temperature > 0:  # only sampling's acceptance reads the drafts' logits
                logits.append(program.logits[:bsz].clone())
        return tokens, logits

    def verify(self, block: torch.Tensor, real: torch.Tensor, start: int, keys: torch.Tensor) -> torch.Tensor:
        program, n = self.programs.verify, block.shape[1]
        program.resume(block, real[:, None] + torch.arange(n, device=block.device), start, keys)
        program.step()
        return program.logits[: self.bsz, :n].clone()

    def keep(self, length: int) -> None:
        """Nothing to crop: the programs' key masks hide every column not kept."""


class _Row:
    """One row's emitted tokens in speculative decoding, finished at EOS, a stop, or max_new_tokens."""

    def __init__(
        self, opts: GenerationOptions, stop: Callable[[torch.Tensor], torch.Tensor] | None, device: torch.device
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


def _columns(keys: torch.Tensor, needed: int) -> torch.Tensor:
    """The key mask widened to ``needed`` columns (the cache grows alike when holes use up its capacity)."""
    return keys if keys.shape[1] >= needed else F.pad(keys, (0, max(needed, 2 * keys.shape[1]) - keys.shape[1]))


def _accept(
    drafts: torch.Tensor,
    draft_probs: list[torch.Tensor],
    target_logits: torch.Tensor,
    opts: GenerationOptions,
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
    rows: list[_Row], opts: GenerationOptions, cache: KVCache, stats: SpeculationStats, device: torch.device
) -> GenerationOutput:
    """The rows' tokens as a GenerationOutput: (B, longest) padded after a row's end with eos_id (else 0);
    every emitted token is decided at num_steps (its ``steps``); the cost is in ``speculation``."""
    assert opts.num_steps is not None  # resolved
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


@dataclass
class _Step:
    logits: torch.Tensor  # (B, n, V) next-token logits at the step's last n positions
    state: torch.Tensor | None  # (B, T, d) the core's final state (None: a static model)
    steps: torch.Tensor  # (B,) iterations run at the last position
    head_calls: torch.Tensor  # (B,) coda + head evaluations


class _Decoder:
    """One forward of new tokens through the cache (``RecurrentLM.forward`` with a ``Decoding``): the
    prompt, a decoded token, or a block of drafted tokens to verify."""

    def __init__(self, model: RecurrentLM, cache: KVCache, opts: GenerationOptions) -> None:
        self.model, self.cache, self.opts = model, cache, opts
        self.prompt_init = model.args.eval_state_init if opts.state_init == WARM_START else opts.state_init

    def iterate(
        self,
        start: int,
        stop: int,
        state: torch.Tensor,
        injected: torch.Tensor,
        ctx: AttentionContext,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Core iterations start .. stop - 1 (0-based)."""
        core = cast(RecurrentCore, self.model.core)  # the core loops, which call this, run only where there is one
        return core.iterate(state, injected, iteration_contexts(ctx, start, stop), active)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keys: torch.Tensor,
        *,
        running: torch.Tensor | None = None,
        warm_state: torch.Tensor | None = None,
        num_steps: int | None = None,
        head_positions: int = 1,
    ) -> _Step:
        """running: rows still generating (None: a forward that never exits early, as the prompt's).
        num_steps: the depth (default the options'); head_positions: logits of the last this many positions."""
        bsz, device = input_ids.shape[0], input_ids.device
        depth = cast(int, self.opts.num_steps if num_steps is None else num_steps)  # the options are resolved
        loop: _FixedDepth | _AdaptiveDepth
        if running is None or self.opts.exit_criterion is None:
            loop = _FixedDepth(self, depth, bsz, device)
        else:
            loop = _AdaptiveDepth(self, running)
        decoding = Decoding(
            cache=self.cache,
            position_ids=position_ids,
            initial_state=warm_state,
            core_loop=loop if self.model.core is not None else None,
            head_positions=head_positions,
        )
        logits = self.model(input_ids, attention_mask=keys, state_init=self.prompt_init, decoding=decoding)
        if self.model.core is None:
            loop.steps.zero_()
        return _Step(logits=logits, state=loop.state, steps=loop.steps, head_calls=loop.head_calls)


class _FixedDepth:
    """A forward's core at a fixed depth (every row runs it)."""

    def __init__(self, decoder: _Decoder, depth: int, bsz: int, device: torch.device) -> None:
        self.decoder, self.depth = decoder, depth
        self.steps = torch.full((bsz,), depth, dtype=torch.long, device=device)
        self.head_calls = torch.ones_like(self.steps)
        self.state: torch.Tensor | None = None

    def __call__(
        self, core: torch.nn.Module, state: torch.Tensor, injected: torch.Tensor, ctx: AttentionContext
    ) -> CoreResult:
        self.state = self.decoder.iterate(0, self.depth, state, injected, ctx)
        return CoreResult(self.state)


class _AdaptiveDepth:
    """Up to r iterations; a row that exits is frozen: its state and K/V stay those of its last iteration."""

    def __init__(self, decoder: _Decoder, running: torch.Tensor) -> None:
        self.decoder, self.running = decoder, running
        self.steps = torch.zeros_like(running, dtype=torch.long)
        self.head_calls = torch.zeros_like(self.steps)
        self.state: torch.Tensor | None = None

    def __call__(
        self, core: torch.nn.Module, state: torch.Tensor, injected: torch.Tensor, ctx: AttentionContext
    ) -> CoreResult:
        decoder, running = self.decoder, self.running
        opts, model, cache = decoder.opts, decoder.model, decoder.cache
        num_steps = cast(int, opts.num_steps)  # resolved
        # This loop runs only with an exit criterion, whose threshold resolve filled in.
        criterion = ExitCriterion.create(
            cast(str, opts.exit_criterion), cast(float, opts.exit_threshold), state, model.args.vocab_size
        )
        active = running.clone()
        logits = None
        done = 0
        while done < num_steps:
            # The iterations up to the next check run with the same rows active: one run.
            check = opts.next_check(done)
            with cache.writes_only(active):
                state = decoder.iterate(done, check, state, injected, ctx, active)
                self.steps += active * (check - done)
                done = check
                if done == num_steps:
                    break
                check_logits = None
                if criterion.needs_logits:
                    check_logits = model.head(model.coda_and_norm(state, ctx)[:, -1:])
                    self.head_calls += active
                    logits = (
                        check_logits if logits is None else torch.where(active[:, None, None], check_logits, logits)
                    )
            active = active & ~criterion.exits(state, None if check_logits is None else check_logits[:, -1])
            if not bool(active.any()):
                break
        # Rows without final logits: those still running, or (latent-diff) every row; the coda of a
        # frozen state is the coda of the row's last iteration.
        needs_final = active if criterion.needs_logits else running
        self.head_calls += needs_final
        if bool((running & (self.steps < cache.slots_per_block)).any()):
            cache.fill_skipped(self.steps)
        self.state = state
        return CoreResult(state, logits=logits, coda_rows=needs_final)
