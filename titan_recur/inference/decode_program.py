"""The decode step: every generated token, compiled or not (docs/generation.md, "The decode step").

One ``DecodeProgram`` decodes every token of every path: plain, adaptive exit, warm start, sampling, and
speculative decoding's drafts and verify. Uncompiled, its pieces run as plain PyTorch (the CPU default);
compiled (``compile``, the GPU default), the same functions are compiled and, on a GPU, captured as one
CUDA graph per token segment. So the code every CPU test runs is the code a GPU runs.

Why static shapes: at depth r a token is P + r x R + C blocks of small kernels; launched one by one from
Python, a GPU runs them at a few percent of its memory bandwidth. Here a token's shapes never change:
attention reads the cache's whole capacity under an additive key mask, and the token, its position, the
mask, the column it writes and the sampler's draw are device tensors updated in place. So its pieces
(enter: embed + prelude; runs of core iterations; an exit check; leave: coda + head + token choice)
compile once, ``fullgraph=True`` (no graph break, hence no host sync inside), per batch bucket, capacity
and options. Adaptive exit cuts a token into segments at its checks: one host sync per check (whether any
row still runs). The prompt is one forward of the model itself (``RecurrentLM.forward``) into the cache.

Why pieces and not one compiled token: a graph that unrolls r iterations compiles for minutes at r = 32;
a captured CUDA graph of the pieces launches as one, whatever r is, and compiles the core iteration once
(``iterations_per_call`` of them per piece: on a CPU, where nothing is captured, more per piece means
fewer calls per token).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from weakref import WeakKeyDictionary

import torch

from titan_recur.inference.exit_criteria import ExitCriterion
from titan_recur.inference.options import ExitRule, ResolvedOptions
from titan_recur.inference.sampling import choose_tokens
from titan_recur.models.args import WARM_START
from titan_recur.models.blocks import AttentionContext
from titan_recur.models.cache import KVCache
from titan_recur.models.model import Decoding, RecurrentCore, RecurrentLM, iteration_contexts, positions_from_mask
from titan_recur.models.rope import rope_cos_sin
from titan_recur.utils.limits import check_allocation

LOG = logging.getLogger(__name__)
# Batch rows a compiled program is built for: a batch is padded up to the next bucket with rows nobody reads.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Cache columns are allocated in multiples of this (capped at max_seq_len), so prompts and token counts
# of similar size share a program.
CAPACITY_STEP = 128
# Programs kept per model (each holds its KV cache); the least recently used one is dropped beyond.
MAX_PROGRAMS = 4
# Options that never reach a token's graph: a program serves every value of these (the sampling values and the
# EOS id are device tensors of the program, set per generation by ``DecodeProgram.use``).
RUN_ONLY_OPTIONS = (
    "max_new_tokens",
    "seed",
    "generator",
    "compile",
    "draft_steps",
    "lookahead",
    "temperature",
    "top_p",
    "eos_id",
)


def batch_bucket(rows: int) -> int:
    """The smallest bucket holding ``rows`` (beyond the largest: the next multiple of it)."""
    largest = BATCH_BUCKETS[-1]
    return next((b for b in BATCH_BUCKETS if b >= rows), -(-rows // largest) * largest)


def capacity_bucket(columns: int, max_seq_len: int) -> int:
    """Cache columns for ``columns`` needed: the next multiple of CAPACITY_STEP, capped at max_seq_len."""
    return max(columns, min(-(-columns // CAPACITY_STEP) * CAPACITY_STEP, max_seq_len))


def decode_compile_options(device: torch.device) -> dict[str, Any]:
    """Inductor options of the compiled pieces.

    A decoded token's piece is a few one-row matmuls, so on a CPU the graph's Python wrapper (one call
    per kernel) costs as much as its work; ``cpp_wrapper`` makes the whole graph one C++ call
    (docs/benchmarks.md, "Generation"). On a GPU the CUDA graph replaces every wrapper call.
    """
    return {"cpp_wrapper": True} if torch.device(device).type == "cpu" else {}


def default_iterations_per_call(device: torch.device) -> int:
    """Core iterations per piece when the options leave it open: 1 on a GPU (the CUDA graph launches the
    token as one whatever the piece count, and one iteration compiles fastest), 8 on a CPU (each call costs
    guards and a wrapper, so fewer calls per token)."""
    return 1 if torch.device(device).type == "cuda" else 8


def _own_copy(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` with a code object of its own. Dynamo keeps a function's graphs on its code object, at most
    ``recompile_limit`` (8) of them, and under fullgraph the one past it is an error; a sweep over depths
    and batch buckets builds more programs than that. A program compiling its own copies holds its own
    graphs, dropped with it."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _compiler(compiled: bool, device: torch.device) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """How a program makes its pieces: compiled (one graph each, its own copy), or the functions themselves."""
    if not compiled:
        return lambda fn: fn
    options = decode_compile_options(device)
    return lambda fn: torch.compile(_own_copy(fn), fullgraph=True, dynamic=False, options=options)


def run_core_piece(
    core: RecurrentCore,
    state: torch.Tensor,
    injected: torch.Tensor,
    contexts: tuple[AttentionContext, ...],
    active: torch.Tensor | None,
) -> None:
    """``len(contexts)`` core iterations of the token, the state updated in place: a piece. Iteration
    indices never enter it, only same-shaped cache views, so one graph serves every run of that length."""
    state.copy_(core.iterate(state, injected, contexts, active))


@dataclass
class AdaptiveExit:
    """A program's adaptive-exit buffers: the rows still iterating, the cache's row mask while the step runs,
    each row's logits of its exit check, and the criterion's memory of the previous check."""

    rule: ExitRule
    criterion: ExitCriterion
    active: torch.Tensor
    write_rows: torch.Tensor
    kept_logits: torch.Tensor

    @classmethod
    def allocate(cls, rule: ExitRule, state: torch.Tensor, vocab_size: int) -> AdaptiveExit:
        rows = state.shape[0]
        flags = functools.partial(torch.zeros, rows, dtype=torch.bool, device=state.device)
        return cls(
            rule=rule,
            criterion=ExitCriterion.create(rule.criterion, rule.threshold, state, vocab_size),
            active=flags(),
            write_rows=flags(),
            kept_logits=state.new_zeros(rows, 1, vocab_size),
        )


class _LastCoreState:
    """``on_hidden_state`` keeping the state after the last core iteration at the last position: the warm
    start of the first decoded token (the hidden states come as embeddings, prelude blocks, iterations)."""

    def __init__(self, index: int) -> None:
        self.index, self.seen = index, 0
        self.state: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor) -> None:
        if self.seen == self.index:
            self.state = hidden[:, -1:]
        self.seen += 1


class DecodeProgram:
    """One (rows, capacity, options) of decoding: its cache, its static buffers, its pieces (compiled or not)
    and, compiled on a GPU, its captured graphs. ``prefill`` starts a generation (``resume`` continues one
    from given tokens), ``step`` decodes one token; ``warmup_seconds`` is what building it took (compiles
    and captures). ``width`` tokens per forward and a ``cache`` of another program serve speculative
    decoding's verify (``VerifyProgram``)."""

    def __init__(
        self,
        model: RecurrentLM,
        opts: ResolvedOptions,
        rows: int,
        capacity: int,
        *,
        compiled: bool,
        width: int = 1,
        cache: KVCache | None = None,
    ) -> None:
        start = time.perf_counter()
        self.model, self.opts, self.rows, self.width = model, opts, rows, width
        args, weight = model.args, model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        self.num_steps = opts.num_steps
        self.cache = cache if cache is not None else model.new_cache(rows, capacity, opts.num_steps, opts.kv_sharing)
        zeros = functools.partial(torch.zeros, device=device)
        self.token = zeros(rows, width, dtype=torch.long)  # the tokens the next forward reads
        self.position = zeros(rows, width, dtype=torch.long)
        self.column = zeros(width, dtype=torch.long)  # the cache columns the next forward writes
        self.next_end = capacity  # on the host: the column after the next forward's last
        self.counter = zeros((), dtype=torch.long)  # new tokens chosen so far: indexes the draws
        self.key_bias = torch.full((rows, 1, width, capacity), -math.inf, dtype=dtype, device=device)
        # What the forward's tokens see of their own columns: each itself and the ones before it.
        self.block_bias = torch.full((width, width), -math.inf, dtype=dtype, device=device).triu(1)
        self.uniforms = zeros(capacity, rows)  # the sampler's draw for each new token
        # What the token's choice is (the graph's: greedy or sampled, top-p cut or not, an EOS or not), and its
        # values as device tensors, so that another temperature, top_p or EOS id compiles nothing new.
        self.greedy, self.nucleus, self.has_eos = opts.temperature == 0, opts.top_p < 1, opts.eos_id is not None
        self.temperature, self.top_p = zeros(()), zeros(())
        self.eos_id = zeros((), dtype=torch.long)
        self.use(opts)
        self.finished = zeros(rows, dtype=torch.bool)
        self.lengths = zeros(rows, dtype=torch.long)
        self.logits = self._logits_buffer()
        self.steps = zeros(rows, dtype=torch.long)  # iterations of the latest forward
        self.head_calls = zeros(rows, dtype=torch.long)
        self.token_steps = zeros(rows, dtype=torch.long)  # the chosen token's: 0 once its row finished
        self.token_head_calls = zeros(rows, dtype=torch.long)
        self.state = zeros(rows, width, args.dim, dtype=dtype)  # the core's state (a static model: the prelude's)
        self.injected = zeros(rows, width, args.dim, dtype=dtype)
        self.warm_start = opts.state_init == WARM_START and model.core is not None
        self.state_init = args.eval_state_init if opts.state_init == WARM_START else opts.state_init
        self.inv_freq = model.rope_inv_freq(device)
        rope = zeros(rows, width, args.head_dim, dtype=dtype)
        self.ctx = AttentionContext(cos=rope, sin=rope.clone(), mask=self.key_bias, cache=self.cache)
        self.contexts = iteration_contexts(self.ctx, 0, self.num_steps) if model.core is not None else ()
        self.exit = None if opts.exit is None else AdaptiveExit.allocate(opts.exit, self.state, args.vocab_size)
        self.compiled = compiled
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._build_segments(compiled)
        if compiled:
            self._warm_up()
        self.warmup_seconds = time.perf_counter() - start

    def use(self, opts: ResolvedOptions) -> None:
        """This generation's sampling values and EOS id (its graph options are the program's)."""
        self.temperature.fill_(opts.temperature if opts.temperature > 0 else 1.0)
        self.top_p.fill_(opts.top_p)
        self.eos_id.fill_(-1 if opts.eos_id is None else opts.eos_id)

    def describe(self) -> str:
        """What the program was built for, in one line."""
        opts = self.opts
        exit_ = f", exit {opts.exit.criterion}" if opts.exit is not None else ""
        if not self.compiled:
            how = "uncompiled"
        else:
            how = f"compiled, {len(self.graphs)} CUDA graph(s)" if self.graphs else "compiled, no CUDA graph"
        width = f", {self.width} tokens per forward" if self.width > 1 else ""
        return (
            f"batch rows {self.rows}, cache capacity {self.cache.capacity}, r = {self.num_steps}, kv {opts.kv_sharing}"
            f"{exit_}{width}, {len(self.segments)} segment(s), {how}"
        )

    def _logits_buffer(self) -> torch.Tensor:
        """What the last piece fills: the chosen token's logits, fp32 (rows, V)."""
        return torch.zeros(self.rows, self.model.args.vocab_size, device=self.token.device)

    def _leave_piece(self) -> Callable[[DecodeProgram], None]:
        return _decode_leave

    # --- building ---------------------------------------------------------------------------------

    def _build_segments(self, compiled: bool) -> None:
        """A token as segments of calls with no host sync inside: fixed depth is one segment; adaptive exit
        ends a segment at every check, then runs the rest of the iterations, then leaves (the last segment,
        which a token whose rows all exited jumps to)."""
        make = _compiler(compiled, self.token.device)
        enter, check, leave, core_piece = (
            make(_decode_enter),
            make(_decode_check),
            make(self._leave_piece()),
            make(run_core_piece),
        )
        per_call = self.opts.iterations_per_call or default_iterations_per_call(self.token.device)
        calls: list[Callable[[], None]] = [functools.partial(enter, self)]
        self.segments: list[list[Callable[[], None]]]
        if self.model.core is None:
            self.segments = [[*calls, functools.partial(leave, self)]]
            return
        runs = functools.partial(self._runs, core_piece, per_call)
        if self.exit is None:
            self.segments = [[*calls, *runs(0, self.num_steps), functools.partial(leave, self)]]
            return
        segments: list[list[Callable[[], None]]] = []
        done = 0
        while done < self.num_steps:
            check_at = self.exit.rule.next_check(done, self.num_steps)
            calls += runs(done, check_at)
            calls.append(functools.partial(self._count, check_at - done))
            if check_at < self.num_steps:  # the first check keeps every row's logits, later ones the active rows'
                calls.append(functools.partial(check, self, not segments))
            segments.append(calls)
            calls, done = [], check_at
        self.segments = [*segments, [functools.partial(leave, self)]]

    def _runs(self, core_piece: Callable[..., None], per_call: int, start: int, stop: int) -> list[Callable[[], None]]:
        """Iterations start .. stop - 1 in pieces of at most ``per_call``."""
        core = cast(RecurrentCore, self.model.core)  # a program runs iterations only where there is a core
        active = None if self.exit is None else self.exit.active
        return [
            functools.partial(
                core_piece, core, self.state, self.injected, self.contexts[i : min(i + per_call, stop)], active
            )
            for i in range(start, stop, per_call)
        ]

    def _count(self, iterations: int) -> None:
        """Adaptive exit: the rows still active ran ``iterations`` more (a captured op, not a compiled one)."""
        self.steps.add_(cast(AdaptiveExit, self.exit).active, alpha=iterations)

    @torch.no_grad()
    def _warm_up(self) -> None:
        """Run every segment once on an empty cache (compiling each piece) and, on a GPU, capture each segment
        as a CUDA graph; a capture that fails leaves the program uncompiled, with one warning. Nothing of it
        survives ``prefill``, which resets every buffer it read."""
        self._pin()
        self.key_bias.fill_(-math.inf)
        if not self._captures():
            for segment in self.segments:
                _run_decode_calls(segment)
            return
        try:
            self.graphs = _capture_graphs(self.segments)
        except RuntimeError as err:
            LOG.warning("CUDA graph capture failed (%s); this program decodes uncompiled", str(err).splitlines()[0])
            self.graphs, self.compiled = [], False
            self._build_segments(compiled=False)

    def _captures(self) -> bool:
        """Whether the compiled segments are captured as CUDA graphs: on a GPU."""
        return self.key_bias.device.type == "cuda"

    # --- running ----------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        uniforms: torch.Tensor | None,
        num_steps: int | None = None,
    ) -> None:
        """Start a generation: the rows' left-padded prompts (B <= rows) in one forward of the model into the
        cache at ``num_steps`` (default the program's), then the first token chosen. Rows past B are padding:
        one token, finished from the start."""
        bsz, width = input_ids.shape
        rows, device = self.rows, input_ids.device
        depth = self.num_steps if num_steps is None else num_steps
        ids = torch.zeros(rows, width, dtype=torch.long, device=device)
        ids[:bsz] = input_ids
        mask = torch.zeros(rows, width, dtype=torch.bool, device=device)
        mask[:bsz], mask[bsz:, -1] = attention_mask.bool(), True
        positions = positions_from_mask(mask)
        keys = torch.zeros(rows, self.cache.capacity, dtype=torch.bool, device=device)
        keys[:, :width] = mask
        self.cache.reset()
        last_state = _LastCoreState(self.model.args.n_prelude + depth)
        logits = self.model(
            ids,
            depth,
            attention_mask=keys,
            state_init=self.state_init,
            on_hidden_state=last_state if self.warm_start else None,
            decoding=Decoding(cache=self.cache, position_ids=positions, head_positions=1),
        )
        self.next_end = width + self.width  # the first step writes the column after the prompt's
        self._pin()
        self.key_bias.fill_(-math.inf).masked_fill_(keys[:, None, None, :], 0.0)
        self.position.copy_(positions[:, -1:])
        self.column.fill_(width - 1)
        self.counter.zero_()
        self.uniforms.zero_()
        if uniforms is not None:
            self.uniforms[: uniforms.shape[0], :bsz] = uniforms
        self.finished.zero_()
        self.finished[bsz:] = True
        self.lengths.zero_()
        if self.warm_start:
            self.state.copy_(cast(torch.Tensor, last_state.state))
        self.steps.fill_(depth if self.model.core is not None else 0)
        self.head_calls.fill_(1)
        _decode_choose(self, logits)

    @torch.no_grad()
    def step(self) -> None:
        """Decode one token: the forward of ``self.token`` and the choice of the next. Adaptive exit reads
        after each check whether a row still runs (the one host sync), else leaves at once."""
        self._pin()  # a cache shared with another program writes here now
        leave = len(self.segments) - 1
        for index in range(leave):
            self._run_segment(index)
            if self.exit is not None and index < leave - 1 and not bool(self.exit.active.any()):
                break
        self._run_segment(leave)
        self.next_end += 1  # the token's choice moved the column on (a verify is resumed before each step)

    @torch.no_grad()
    def resume(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        keys: torch.Tensor,
        uniforms: torch.Tensor | None = None,
    ) -> None:
        """Continue a generation in this program's cache (speculative decoding's drafts and verify): the next
        forward reads ``tokens`` at ``positions`` (B, n <= width) and writes columns start .. start + width - 1;
        row b sees the columns before ``start`` where ``keys[b]`` is True (a hole where not) and ``uniforms``
        (n_tokens, B) are the draws of the next tokens it chooses."""
        bsz, n = tokens.shape
        self.token[:bsz, :n] = tokens
        self.position[:bsz, :n] = positions
        torch.arange(start, start + self.width, out=self.column)
        self.next_end = start + self.width
        self.key_bias.fill_(-math.inf)[:bsz, :, :, :start].masked_fill_(keys[:, None, None, :start], 0.0)
        self.counter.zero_()
        if uniforms is not None:
            self.uniforms[: uniforms.shape[0], :bsz] = uniforms

    def _pin(self) -> None:
        """Point the cache's writes at this program's column; an uncompiled step reads only the columns up to
        the ones it writes (compiled: the whole capacity, for static shapes)."""
        key_length = None if self.compiled else self.next_end
        self.cache.pin(self.column, None if self.exit is None else self.exit.write_rows, key_length)

    def _run_segment(self, index: int) -> None:
        if self.graphs:
            self.graphs[index].replay()
        else:
            _run_decode_calls(self.segments[index])


def _run_decode_calls(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


def _capture_graphs(segments: list[list[Callable[[], None]]]) -> list[torch.cuda.CUDAGraph]:
    """Each segment (already run once, so compiled) captured as a CUDA graph, after a warm-up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for segment in segments:
            _run_decode_calls(segment)
    torch.cuda.current_stream().wait_stream(stream)
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for segment in segments:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            _run_decode_calls(segment)
        graphs.append(graph)
    return graphs


def _decode_enter(p: DecodeProgram) -> None:
    """Embed and prelude of ``p.token``; the core's injection and initial state (a piece)."""
    model = p.model
    # The forward's own columns, written now and seen from now on (each token sees itself and those before).
    p.key_bias.index_copy_(-1, p.column, p.block_bias.expand(p.rows, 1, p.width, p.width))
    if p.exit is not None:  # prelude writes are every row's; the core's only the active rows'
        p.exit.write_rows.fill_(True)
    cos, sin = rope_cos_sin(p.position, p.inv_freq, p.key_bias.dtype)
    p.ctx.cos.copy_(cos)
    p.ctx.sin.copy_(sin)
    x = model.embed_and_prelude(p.token, p.ctx)
    if model.core is None:
        p.state.copy_(x)
        return
    p.injected.copy_(model.core.inject(x))
    if not p.warm_start:
        p.state.copy_(model.core.initial_state(x, p.state_init))
    if p.exit is not None:
        p.exit.active.copy_(~p.finished)
        p.exit.write_rows.copy_(p.exit.active)
        p.steps.zero_()
        p.head_calls.zero_()
        p.exit.criterion.reset(p.state)


def _decode_check(p: DecodeProgram, first: bool) -> None:
    """An exit check (adaptive depth): the criterion of each active row, the logits of the check kept per
    row, and the rows that exit frozen: their state and K/V stay those of their last iteration (a piece)."""
    model, exit_ = p.model, cast(AdaptiveExit, p.exit)
    logits = None
    if exit_.criterion.needs_logits:
        check_logits = model.head(model.coda_and_norm(p.state, p.ctx))
        p.head_calls.add_(exit_.active)
        kept = check_logits if first else torch.where(exit_.active[:, None, None], check_logits, exit_.kept_logits)
        exit_.kept_logits.copy_(kept)
        logits = check_logits[:, -1]
    exit_.active.copy_(exit_.active & ~exit_.criterion.exits(p.state, logits))
    exit_.write_rows.copy_(exit_.active)


def _decode_leave(p: DecodeProgram) -> None:
    """Coda, head and the choice of the next token (a piece)."""
    model = p.model
    if p.exit is None:  # every row ran the fixed depth (a static model: no iteration)
        p.steps.fill_(0 if model.core is None else p.num_steps)
        p.head_calls.fill_(1)
        _decode_choose(p, model.head(model.coda_and_norm(p.state, p.ctx)))
        return
    exit_ = p.exit
    running = ~p.finished
    # Rows without final logits: those still running, or (latent-diff) every row; the coda of a frozen state
    # is the coda of the row's last iteration.
    coda_rows = exit_.active if exit_.criterion.needs_logits else running
    p.head_calls.add_(coda_rows)
    # Slots a running row did not reach hold its last K/V (KVCache.fill_skipped); where no running row
    # stopped short, nothing is copied (steps of n copy nothing).
    slots = p.cache.slots_per_block
    short = (running & (p.steps < slots)).any()
    p.cache.fill_skipped(torch.where(short, p.steps, torch.full_like(p.steps, slots)))
    exit_.write_rows.copy_(coda_rows)
    final = model.head(model.coda_and_norm(p.state, p.ctx))
    needs_logits = exit_.criterion.needs_logits
    _decode_choose(p, torch.where(coda_rows[:, None, None], final, exit_.kept_logits) if needs_logits else final)


def _decode_choose(p: DecodeProgram, logits: torch.Tensor) -> None:
    """The next token from the forward's (rows, 1, V) logits (EOS once finished, lengths counted, each token's
    iterations and head calls, 0 once its row finished); then the write head moves one column on."""
    last = logits[:, -1]
    p.logits.copy_(last.float())
    draw = p.uniforms.index_select(0, p.counter[None])[0]
    token = choose_tokens(last, p.temperature, p.top_p, p.opts.top_k, draw, greedy=p.greedy, nucleus=p.nucleus)
    if p.has_eos:
        token = torch.where(p.finished, p.eos_id, token)
    p.token_steps.copy_(p.steps.masked_fill(p.finished, 0))
    p.token_head_calls.copy_(p.head_calls.masked_fill(p.finished, 0))
    p.lengths.add_(~p.finished)
    if p.has_eos:
        p.finished.copy_(p.finished | (token == p.eos_id))
    p.token.copy_(token[:, None])
    p.position.add_(1)
    p.column.add_(1)
    p.counter.add_(1)


def _verify_leave(p: DecodeProgram) -> None:
    """Coda and head of every position of a verified block: its logits (a piece)."""
    p.logits.copy_(p.model.head(p.model.coda_and_norm(p.state, p.ctx)))


class VerifyProgram(DecodeProgram):
    """Speculative decoding's verify: a block of lookahead + 1 tokens (the last chosen one and its drafts;
    fewer fill the front) at depth r, through the draft program's cache, leaving the logits of every position
    (model dtype) for the acceptance rule."""

    def __init__(self, model: RecurrentLM, opts: ResolvedOptions, draft: DecodeProgram) -> None:
        super().__init__(
            model,
            opts,
            draft.rows,
            draft.cache.capacity,
            compiled=draft.compiled,
            width=opts.lookahead + 1,
            cache=draft.cache,
        )

    def _logits_buffer(self) -> torch.Tensor:
        return self.model.embed_tokens.weight.new_zeros(self.rows, self.width, self.model.args.vocab_size)

    def _leave_piece(self) -> Callable[[DecodeProgram], None]:
        return _verify_leave


@dataclass
class SpeculativePrograms:
    """Speculative decoding: drafts decode token by token at draft_steps and the verify runs a block at
    num_steps, both in one cache (r slots per core block)."""

    draft: DecodeProgram
    verify: VerifyProgram

    @property
    def cache(self) -> KVCache:
        return self.draft.cache

    @property
    def warmup_seconds(self) -> float:
        return self.draft.warmup_seconds + self.verify.warmup_seconds

    def use(self, opts: ResolvedOptions) -> None:
        self.draft.use(opts)  # the drafts' sampling values (their EOS is none: drafts go on past one)

    def describe(self) -> str:
        return f"drafts: {self.draft.describe()}; verify: {self.verify.describe()}"


def speculative_columns(prompt_width: int, opts: ResolvedOptions, batch_size: int) -> int:
    """Cache columns a speculative generation may write: a round writes lookahead + 1 columns and keeps as
    many as its most accepting row, so rows that accepted fewer leave holes. One row has none (its columns
    are its tokens); several rows may spend lookahead + 1 columns per new token."""
    block = opts.lookahead + 1
    if batch_size == 1:
        return prompt_width + opts.max_new_tokens + block - 1
    return prompt_width + (opts.max_new_tokens - 1) * block


_Program = TypeVar("_Program", DecodeProgram, SpeculativePrograms)
_DECODE_PROGRAMS: WeakKeyDictionary[RecurrentLM, OrderedDict[tuple[Any, ...], Any]] = WeakKeyDictionary()


def program_for(model: RecurrentLM, opts: ResolvedOptions, batch_size: int, columns: int) -> DecodeProgram:
    """The model's program for a batch of ``batch_size`` rows needing ``columns`` cache columns at ``opts``,
    built if none fits (logged with its warm-up seconds): one per (rows, graph options), kept while its
    capacity suffices; at most MAX_PROGRAMS per model, the least recently used dropped."""

    def build(rows: int, capacity: int, compiled: bool) -> DecodeProgram:
        return DecodeProgram(model, opts, rows, capacity, compiled=compiled)

    return _cached_program(model, opts, batch_size, columns, None, build)


def speculative_programs_for(
    model: RecurrentLM, opts: ResolvedOptions, batch_size: int, columns: int
) -> SpeculativePrograms:
    """``program_for`` of speculative decoding (``opts.draft_steps`` set): the draft and verify programs."""
    draft_steps = opts.draft_steps
    if draft_steps is None:
        raise ValueError("speculative decoding needs draft_steps")

    def build(rows: int, capacity: int, compiled: bool) -> SpeculativePrograms:
        draft_opts = dataclasses.replace(opts, num_steps=draft_steps, eos_id=None)  # drafts go on past an EOS
        cache = model.new_cache(rows, capacity, opts.num_steps, opts.kv_sharing)
        draft = DecodeProgram(model, draft_opts, rows, capacity, compiled=compiled, cache=cache)
        return SpeculativePrograms(draft, VerifyProgram(model, opts, draft))

    return _cached_program(model, opts, batch_size, columns, (opts.draft_steps, opts.lookahead), build)


def _cached_program(
    model: RecurrentLM,
    opts: ResolvedOptions,
    batch_size: int,
    columns: int,
    kind: Any,
    build: Callable[[int, int, bool], _Program],
) -> _Program:
    """A compiled program pads its batch to a bucket and its columns to a multiple of CAPACITY_STEP, so that
    similar batches share its graphs, and is kept; an uncompiled one is built for the batch as it is (cheap:
    its cache is freed with it, as a generation's own)."""
    device = model.embed_tokens.weight.device
    if not opts.compiled_on(device):
        check_cache_fits(model, opts, batch_size, columns)
        return build(batch_size, columns, False)
    programs = _DECODE_PROGRAMS.setdefault(model, OrderedDict())
    rows = batch_bucket(batch_size)
    graph_options = tuple(getattr(opts, f.name) for f in dataclasses.fields(opts) if f.name not in RUN_ONLY_OPTIONS)
    # Where the weights live: a captured graph reads them there, so a model moved or cast since needs new programs.
    weights = tuple(p.data_ptr() for p in model.parameters())
    for stale in [k for k in programs if k[0] != weights]:
        del programs[stale]
    choice = (opts.temperature == 0, opts.top_p < 1, opts.eos_id is not None)  # the token choice's graph
    key = (weights, rows, model.training, graph_options, choice, kind)
    program = programs.get(key)
    if program is None or program.cache.capacity < columns:
        programs.pop(key, None)  # its cache is freed before the larger one is allocated
        while len(programs) >= MAX_PROGRAMS:  # and the least recently used, to make room
            programs.popitem(last=False)
        capacity = capacity_bucket(columns, model.args.max_seq_len)
        check_cache_fits(model, opts, rows, capacity)
        program = build(rows, capacity, True)
        programs[key] = program
        LOG.info("decode program built in %.1f s: %s", program.warmup_seconds, program.describe())
    programs.move_to_end(key)
    program.use(opts)
    return cast(_Program, program)


def check_cache_fits(model: RecurrentLM, opts: ResolvedOptions, rows: int, capacity: int) -> None:
    """One line before allocating a KV cache the device cannot hold: 64 rows of 2k columns at r = 32 with
    "full" sharing is tens of GiB for a 1B model."""
    weight = model.embed_tokens.weight
    needed = KVCache.planned_bytes(model.args, rows, capacity, opts.num_steps, opts.kv_sharing, weight.element_size())
    check_allocation(
        needed,
        weight.device,
        f"the decode KV cache of {rows} rows x {capacity} columns at r = {opts.num_steps} (kv_sharing {opts.kv_sharing})",
        hint="use fewer rows or new tokens, or kv_sharing 'latest' / 'compress-N'",
    )


def release_programs(model: RecurrentLM) -> None:
    """Free the model's decode programs (their caches and graphs), e.g. before training it again."""
    _DECODE_PROGRAMS.pop(model, None)
