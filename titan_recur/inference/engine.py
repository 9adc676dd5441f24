"""The generation engine: decoding at any test-time depth (docs/generation.md).

One engine for everything that decodes (the CLI ``python -m titan_recur.generate``, the lm-eval model,
the HF export's ``generate``). It runs the model's own units step by step (``attention_context``,
``embed_and_prelude``, ``RecurrentCore.iteration``, ``coda_and_norm``, ``head``) through a preallocated
``KVCache`` with K/V sharing across iterations, and adds per-token adaptive exit, a warm-started
recurrent state and seeded sampling. Left-padded batches are exact: every row gets the tokens and
per-token iteration counts it gets alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_recur.models.args import STATE_INITS, ModelArgs
from titan_recur.models.blocks import AttentionContext
from titan_recur.models.cache import IterationView, KVCache, core_slots_per_block
from titan_recur.models.model import RecurrentLM

EXIT_CRITERIA = ("kl", "latent-diff", "entropy-diff", "argmax")
# Huginn's defaults (KL and entropy change in nats, relative latent change, argmax stable for 5 checks).
DEFAULT_EXIT_THRESHOLDS = {"kl": 1e-3, "latent-diff": 0.03, "entropy-diff": 1e-3, "argmax": 5.0}
# state_init of a decoded token that starts from the previous token's final state (continuous compute).
WARM_START = "previous"


@dataclass
class GenerationOptions:
    """What to generate and at which depth; ``resolve`` fills the defaults and checks every knob.

    num_steps: r, the core iterations per token (max_steps when exiting early); None = the model's
    mean_recurrence. kv_sharing: "full" | "latest" | "compress-N" (models/cache.py).
    exit_criterion: None (always r) or one of EXIT_CRITERIA; exit_threshold (None = Huginn's default),
    min_steps, check_every: a token may stop after iteration i when i >= min_steps, (i - min_steps) is
    a multiple of check_every, and its criterion, compared with the previous check, is below the
    threshold ("argmax": unchanged for >= threshold checks). The prompt always runs r iterations.
    state_init: a STATE_INITS name, or "previous" (decoded tokens start from the previous token's
    final state; the prompt from the deterministic eval init); None = the eval init.
    temperature 0 is greedy; otherwise sampling with top_p from a generator seeded by ``seed``.
    compile: run decoded tokens' core iterations through ``torch.compile``, ``iterations_per_call`` of
    them per compiled call (the run of iterations up to the next exit check, split into pieces of at
    most that many): one graph per piece length, for every token (the key length is symbolic; see
    ``decode_compile_options``). More per call means fewer calls' fixed cost per token, and a longer
    first compile (the graph unrolls them).
    """

    max_new_tokens: int = 32
    num_steps: int | None = None
    kv_sharing: str = "full"
    exit_criterion: str | None = None
    exit_threshold: float | None = None
    min_steps: int = 1
    check_every: int = 1
    state_init: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos_id: int | None = None
    compile: bool = False
    iterations_per_call: int = 8

    def resolve(self, args: ModelArgs) -> "GenerationOptions":
        """A copy with the model's defaults filled in; a one-line ValueError for any bad knob."""
        num_steps = args.mean_recurrence if self.num_steps is None else self.num_steps
        threshold = self.exit_threshold
        if self.exit_criterion is not None and threshold is None:
            threshold = DEFAULT_EXIT_THRESHOLDS.get(self.exit_criterion)
        resolved = dataclasses.replace(
            self, num_steps=num_steps, exit_threshold=threshold, state_init=self.state_init or args.eval_state_init
        )
        resolved._check(args)
        return resolved

    def _check(self, args: ModelArgs) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_int(self.num_steps) or self.num_steps < 1:
            raise ValueError(f"num_steps must be an integer >= 1, got {self.num_steps!r}")
        core_slots_per_block(self.kv_sharing, self.num_steps)
        if self.exit_criterion is not None and self.exit_criterion not in EXIT_CRITERIA:
            raise ValueError(f"exit_criterion must be one of {', '.join(EXIT_CRITERIA)}, got {self.exit_criterion!r}")
        if self.exit_criterion is None and self.exit_threshold is not None:
            raise ValueError("exit_threshold needs an exit_criterion")
        if self.exit_threshold is not None and not self.exit_threshold > 0:
            raise ValueError(f"exit_threshold must be > 0, got {self.exit_threshold!r}")
        if self.exit_criterion is not None and not args.is_recurrent:
            raise ValueError("exit_criterion needs a recurrent model; a static model has no iterations to exit from")
        if not _is_int(self.min_steps) or not 1 <= self.min_steps <= self.num_steps:
            raise ValueError(
                f"min_steps must be an integer in [1, max_steps = num_steps = {self.num_steps}], got {self.min_steps!r}"
            )
        if not _is_int(self.check_every) or self.check_every < 1:
            raise ValueError(f"check_every must be an integer >= 1, got {self.check_every!r}")
        if not _is_int(self.iterations_per_call) or self.iterations_per_call < 1:
            raise ValueError(f"iterations_per_call must be an integer >= 1, got {self.iterations_per_call!r}")
        if self.state_init not in (*STATE_INITS, WARM_START):
            raise ValueError(f"state_init must be one of {', '.join((*STATE_INITS, WARM_START))}, got {self.state_init!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def is_check(self, iteration: int) -> bool:
        """Whether a token may exit after ``iteration`` (1-based) core iterations."""
        return iteration >= self.min_steps and (iteration - self.min_steps) % self.check_every == 0

    def next_check(self, done: int) -> int:
        """The iteration count after ``done`` at which the next exit check falls, or num_steps if none does."""
        return next((i for i in range(done + 1, self.num_steps) if self.is_check(i)), self.num_steps)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class GenerationOutput:
    """tokens (B, N): the new tokens (rows that finished early continue with eos_id); steps (B, N):
    core iterations each token's forward ran (0 once its row had finished); head_calls (B, N):
    coda + head evaluations per token (1, plus one per check for the logit-based exit criteria);
    lengths (B,): tokens each row generated before it finished (its EOS, or the token completing a
    stop sequence, included); kv_cache_bytes: the allocated K/V buffers; logits (B, N, V) fp32 when
    asked for."""

    tokens: torch.Tensor
    steps: torch.Tensor
    head_calls: torch.Tensor
    lengths: torch.Tensor
    kv_cache_bytes: int
    logits: torch.Tensor | None = None


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
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_prompts(attention_mask, opts.max_new_tokens, model.args.max_seq_len)
    bsz, width = input_ids.shape
    device = input_ids.device
    cache = KVCache.for_model(model, bsz, width + opts.max_new_tokens, opts.num_steps, opts.kv_sharing)
    # Which cache columns hold a real token: the prompt's, then each decoded one.
    keys = torch.zeros(bsz, cache.capacity, dtype=torch.bool, device=device)
    keys[:, :width] = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    decoder = _Decoder(model, cache, opts)
    generator = torch.Generator(device).manual_seed(opts.seed) if opts.temperature > 0 else None
    step = decoder.forward(input_ids, positions, keys, running=None, warm_state=None)
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)
    lengths = torch.zeros(bsz, dtype=torch.long, device=device)
    tokens, steps, head_calls, logits = [], [], [], []
    for t in range(opts.max_new_tokens):
        if return_logits:
            logits.append(step.logits.float())
        token = choose_tokens(step.logits, opts.temperature, opts.top_p, generator)
        if opts.eos_id is not None:
            token = torch.where(finished, torch.full_like(token, opts.eos_id), token)
        tokens.append(token)
        steps.append(step.steps.masked_fill(finished, 0))
        head_calls.append(step.head_calls.masked_fill(finished, 0))
        lengths += ~finished
        if opts.eos_id is not None:
            finished |= token == opts.eos_id
        if stop is not None:
            finished |= stop(torch.stack(tokens, dim=1))
        if t == opts.max_new_tokens - 1 or ((opts.eos_id is not None or stop is not None) and bool(finished.all())):
            break
        keys[:, width + t] = True
        positions = positions[:, -1:] + 1
        # Contiguous: the prompt's last state is a strided slice, which a compiled step would recompile for.
        warm = step.state[:, -1:].contiguous() if opts.state_init == WARM_START else None
        fed = token if forced_tokens is None else forced_tokens[:, t]
        step = decoder.forward(fed[:, None], positions, keys, running=~finished, warm_state=warm)
    return GenerationOutput(
        tokens=torch.stack(tokens, dim=1), steps=torch.stack(steps, dim=1), head_calls=torch.stack(head_calls, dim=1),
        lengths=lengths, kv_cache_bytes=cache.nbytes(), logits=torch.stack(logits, dim=1) if return_logits else None,
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
    options = GenerationOptions(max_new_tokens=max_new_tokens, num_steps=num_steps, eos_id=eos_id,
                                state_init=state_init)
    return generate(model, input_ids, options, attention_mask=attention_mask, stop=stop).tokens


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token lists, left-padded to the longest: the engine's batch layout."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return input_ids, attention_mask


def choose_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """(B,) next tokens from (B, V) logits: argmax at temperature 0, else a top-p sample."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
        sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def decode_compile_options(device: torch.device) -> dict[str, bool]:
    """Inductor options of the compiled decode iteration.

    A decoded token's iteration is a few one-row matmuls, so on a CPU the graph's Python wrapper (one
    call per kernel) costs as much as its work; ``cpp_wrapper`` makes the whole graph one C++ call
    (docs/benchmarks.md, "Generation"). On a GPU the default wrapper is kept: not measured there yet.
    """
    return {"cpp_wrapper": True} if torch.device(device).type == "cpu" else {}


def run_core_iterations(
    core: torch.nn.Module,
    state: torch.Tensor,
    injected: torch.Tensor,
    ctx: AttentionContext,
    views: tuple[IterationView, ...],
    active: torch.Tensor | None,
) -> torch.Tensor:
    """One core iteration per cache view, in order; rows not ``active`` keep their state (None: all run).

    The unit the engine compiles: iteration indices never enter it, only same-shaped views, so one
    graph serves every run of ``len(views)`` iterations of every token.
    """
    for view in views:
        new_state = core.iteration(state, injected, dataclasses.replace(ctx, cache=view))
        state = new_state if active is None else torch.where(active[:, None, None], new_state, state)
    return state


@dataclass
class _Step:
    logits: torch.Tensor  # (B, V) next-token logits at the step's last position
    state: torch.Tensor  # (B, T, d) the core's final state
    steps: torch.Tensor  # (B,) iterations run at the last position
    head_calls: torch.Tensor  # (B,) coda + head evaluations


class _Decoder:
    """One forward of new tokens through the cache: the prompt (r iterations) or one decoded token."""

    def __init__(self, model: RecurrentLM, cache: KVCache, opts: GenerationOptions) -> None:
        self.model, self.cache, self.opts = model, cache, opts
        self.prompt_init = model.args.eval_state_init if opts.state_init == WARM_START else opts.state_init
        self.compiled_iterations = None
        if opts.compile and model.core is not None:
            device = model.embed_tokens.weight.device
            self.compiled_iterations = torch.compile(
                run_core_iterations, dynamic=True, options=decode_compile_options(device)
            )

    def iterate(
        self,
        start: int,
        stop: int,
        state: torch.Tensor,
        injected: torch.Tensor,
        ctx: AttentionContext,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Core iterations start .. stop - 1 (0-based); a decoded token's go through the compiled unit,
        ``iterations_per_call`` at a time, when compiling (the prompt's shapes are its own: eager)."""
        views = tuple(self.cache.iteration_view(i) for i in range(start, stop))
        if self.compiled_iterations is None or state.shape[1] > 1:
            return run_core_iterations(self.model.core, state, injected, ctx, views, active)
        per_call = self.opts.iterations_per_call
        for first in range(0, len(views), per_call):
            state = self.compiled_iterations(
                self.model.core, state, injected, ctx, views[first : first + per_call], active
            )
        return state

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keys: torch.Tensor,
        running: torch.Tensor | None,
        warm_state: torch.Tensor | None,
    ) -> _Step:
        """running: rows still generating (None for the prompt, which never exits early)."""
        model, cache = self.model, self.cache
        ctx = model.attention_context(input_ids, keys, position_ids, cache)
        # Additive once per step, rather than converted from bool by every attention call.
        mask = torch.zeros(ctx.mask.shape, dtype=ctx.cos.dtype, device=ctx.mask.device).masked_fill_(~ctx.mask, -math.inf)
        ctx = dataclasses.replace(ctx, mask=mask)
        cache.write_rows = None
        embedded = model.embed_and_prelude(input_ids, ctx)
        bsz = input_ids.shape[0]
        if model.core is None:
            step = self._final(embedded, ctx, torch.zeros(bsz, dtype=torch.long, device=embedded.device))
        else:
            injected = model.core.inject(embedded)
            state = warm_state if warm_state is not None else model.core.initial_state(embedded, self.prompt_init)
            if running is None or self.opts.exit_criterion is None:
                step = self._fixed_depth(state, injected, ctx)
            else:
                step = self._adaptive_depth(state, injected, ctx, running)
        cache.write_rows = None
        cache.length += input_ids.shape[1]
        return step

    def _fixed_depth(self, state: torch.Tensor, injected: torch.Tensor, ctx: AttentionContext) -> _Step:
        state = self.iterate(0, self.opts.num_steps, state, injected, ctx)
        steps = torch.full((state.shape[0],), self.opts.num_steps, dtype=torch.long, device=state.device)
        return self._final(state, ctx, steps)

    def _final(self, state: torch.Tensor, ctx: AttentionContext, steps: torch.Tensor) -> _Step:
        logits = self.model.head(self.model.coda_and_norm(state, ctx)[:, -1])
        return _Step(logits=logits, state=state, steps=steps, head_calls=torch.ones_like(steps))

    def _adaptive_depth(
        self, state: torch.Tensor, injected: torch.Tensor, ctx: AttentionContext, running: torch.Tensor
    ) -> _Step:
        """Up to r iterations; a row that exits is frozen: its state and K/V stay those of its last iteration."""
        opts, model, cache = self.opts, self.model, self.cache
        criterion = ExitCriterion(opts.exit_criterion, opts.exit_threshold, state, model.args.vocab_size)
        active = running.clone()
        steps = torch.zeros_like(running, dtype=torch.long)
        head_calls = torch.zeros_like(steps)
        logits = None
        done = 0
        while done < opts.num_steps:
            # The iterations up to the next check run with the same rows active: one run.
            check = opts.next_check(done)
            cache.write_rows = active
            state = self.iterate(done, check, state, injected, ctx, active)
            steps += active * (check - done)
            done = check
            if done == opts.num_steps:
                break
            check_logits = None
            if criterion.needs_logits:
                check_logits = model.head(model.coda_and_norm(state, ctx)[:, -1])
                head_calls += active
                logits = check_logits if logits is None else torch.where(active[:, None], check_logits, logits)
            active = active & ~criterion.exits(state, check_logits)
            if not bool(active.any()):
                break
        # Rows without final logits: those still running, or (latent-diff) every row; the coda of a
        # frozen state is the coda of the row's last iteration.
        needs_final = active if criterion.needs_logits else running
        if bool(needs_final.any()):
            cache.write_rows = needs_final
            final = model.head(model.coda_and_norm(state, ctx)[:, -1])
            head_calls += needs_final
            logits = final if logits is None else torch.where(needs_final[:, None], final, logits)
        if bool((running & (steps < cache.slots_per_block)).any()):
            cache.fill_skipped(steps)
        return _Step(logits=logits, state=state, steps=steps, head_calls=head_calls)


class ExitCriterion:
    """Per-row exit test of adaptive depth: each check compares with the previous check (Huginn's rules).

    kl: KL(p_prev || p_i) of the next-token distributions (p_prev uniform before the first check);
    latent-diff: ||s_i - s_prev|| / ||s_i|| (s_prev = the initial state before the first check);
    entropy-diff: |H(p_i) - H(p_prev)| (no exit at the first check); argmax: number of consecutive
    checks at which the argmax did not change. A row exits when its value is below the threshold
    (argmax: reaches it). All but latent-diff need the logits of the check: one coda + head call.
    """

    def __init__(self, name: str, threshold: float, initial_state: torch.Tensor, vocab_size: int) -> None:
        self.name, self.threshold = name, threshold
        self.needs_logits = name != "latent-diff"
        bsz, device = initial_state.shape[0], initial_state.device
        if name == "latent-diff":
            self.previous = initial_state[:, -1].float()
        elif name == "kl":
            self.previous = torch.full((bsz, vocab_size), -math.log(vocab_size), device=device)
        elif name == "entropy-diff":
            self.previous = torch.full((bsz,), math.inf, device=device)
        else:
            self.previous = torch.full((bsz,), -1, dtype=torch.long, device=device)
            self.stable = torch.zeros(bsz, dtype=torch.long, device=device)

    def exits(self, state: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """(B,) bool: rows whose criterion is met at this check."""
        if self.name == "latent-diff":
            latent = state[:, -1].float()
            value = (latent - self.previous).norm(dim=-1) / latent.norm(dim=-1)
            self.previous = latent
            return value < self.threshold
        if self.name == "argmax":
            argmax = logits.argmax(dim=-1)
            self.stable = torch.where(argmax == self.previous, self.stable + 1, torch.zeros_like(self.stable))
            self.previous = argmax
            return self.stable >= self.threshold
        log_probs = F.log_softmax(logits.float(), dim=-1)
        if self.name == "kl":
            value = (self.previous.exp() * (self.previous - log_probs)).sum(dim=-1)
            self.previous = log_probs
        else:
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
            value = (entropy - self.previous).abs()
            self.previous = entropy
        return value < self.threshold
