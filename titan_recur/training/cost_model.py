"""The cost model of a depth-recurrent LM, analytically from ModelArgs and the config (docs/method.md §4).

One place for what a run costs: parameter counts (and the Muon/AdamW split), the activation-
checkpointing rule (parallelize applies it, the FLOP and memory estimates count it), the data-parallel
mesh shape, the memory per GPU at a step's peak, and FLOPs and MFU. The trainer's metrics, the
preflight, tools/flops.py and the benchmarks all ask this module.

TorchTitan's 6 * N FLOPs/token counts each parameter once, which is wrong for a looped model. Two
conventions are provided instead:

- "full": the model FLOPs of the micro-steps actually run. Matmuls only, 2 FLOPs per
  multiply-accumulate: the block projections, the adapter, the LM head and the attention score
  and value matmuls (per block per iteration). Norms, RoPE, activations, residuals, biases,
  softmax and the loss are excluded, and the embedding lookup costs nothing. Backward is twice the
  forward for everything that receives gradients; the n no-grad iterations are forward only.
  Activation-checkpointing recompute is reported separately and is not model FLOPs (MFU uses
  ``FlopBreakdown.total``).
- "paper": the reference's 6 * tokens * [N_prelude + N_coda + N_core*min(r, d) + N_core*max(r - d, 0)/3]
  with r the scheduled integer mean and d the backprop depth: non-embedding parameters only, no
  attention, adapter or head, the sampler's spread and +1 ignored. A static model is 6 * tokens * N.

Optimizer steps are numbered 1..S as in the trainer (titan_recur.training.trainer), whose step number seeds the
sampler and indexes the curriculum: cumulative FLOPs "after S steps" sum steps 1..S, and the full
convention replays the trainer's draws exactly. That also reproduces the reference's 9.664e19 for
TinyLlama 4,8,4 at step 20,000 (its histogram counts the 20,000 steps completed).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from titan_recur.config import AC_MODES, grad_accum_steps
from titan_recur.models.args import DEFAULT_BACKPROP_DEPTH, PRESETS, ModelArgs
from titan_recur.models.families import family_named
from titan_recur.models.model import resolve_num_steps
from titan_recur.storage.model_io import resolve_model_args
from titan_recur.training.recurrence import RecurrenceSchedule
from titan_recur.utils.progress import progress

if TYPE_CHECKING:
    from titan_recur.config import JobConfig

CONVENTIONS = ("paper", "full")
# A full-convention replay of more sampler draws than this shows a progress bar (about 5 s of draws).
REPLAY_BAR_DRAWS = 20_000
GiB = 2**30

# Dense bf16 peak FLOP/s per torch device, matched as a case-insensitive substring of
# torch.cuda.get_device_name(); first match wins, so specific names precede general ones.
# An MI250X/MI250 module shows up as two devices (one per GCD): the entries are per GCD.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("MI355X", 2.5e15),
    ("MI325X", 1307e12),
    ("MI300X", 1307e12),
    ("MI300A", 980.6e12),
    ("MI250X", 191.5e12),
    ("MI250", 181e12),
)


# ---------------------------------------------------------------------------------------------
# Parameters


def _block_matmul_params(args: ModelArgs) -> int:
    """Weights of one block's matmuls: q, k, v, o and the three SwiGLU matrices."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return 2 * args.dim * q_dim + 2 * args.dim * kv_dim + 3 * args.dim * args.ffn_dim


def block_params(args: ModelArgs) -> int:
    """All parameters of one transformer block: matmuls, biases and norms (the family's q/k norms included)."""
    family = family_named(args.block_type)
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    count = _block_matmul_params(args) + 2 * args.dim
    if args.attention_bias or family.qkv_bias:
        count += q_dim + 2 * kv_dim
    if args.attention_bias:
        count += args.dim
    if args.mlp_bias:
        count += 2 * args.ffn_dim + args.dim
    count += {"none": 0, "full": q_dim + kv_dim, "per_head": 2 * args.head_dim}[family.qk_norm]
    return count


@dataclass(frozen=True)
class ParamCounts:
    """Parameters per part; ``core`` counts the R core blocks once, ``head`` is 0 when tied."""

    embedding: int
    prelude: int
    core: int
    adapter: int
    coda: int
    final_norm: int
    head: int

    @property
    def non_embedding(self) -> int:
        """The paper's N: every block plus the final norm; no embedding, head or adapter."""
        return self.prelude + self.core + self.coda + self.final_norm

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


def param_counts(args: ModelArgs) -> ParamCounts:
    """Parameter counts per part, from the shape alone (no model is built)."""
    per_block = block_params(args)
    return ParamCounts(
        embedding=args.vocab_size * args.dim,
        prelude=args.n_prelude * per_block,
        core=args.n_core * per_block,
        adapter=2 * args.dim * args.dim if args.is_recurrent else 0,
        coda=args.n_coda * per_block,
        final_norm=args.dim,
        head=0 if args.tie_embeddings else args.vocab_size * args.dim,
    )


def muon_params(args: ModelArgs) -> int:
    """Parameters Muon trains (optim.split_params_for_muon): the blocks' 2-D weights and the adapter."""
    blocks = args.n_prelude + args.n_core + args.n_coda
    return blocks * _block_matmul_params(args) + (2 * args.dim * args.dim if args.is_recurrent else 0)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing: the one rule parallelize applies and the FLOP and memory estimates count


@dataclass(frozen=True)
class CheckpointPlan:
    """What an ac_mode wraps in activation checkpointing.

    ``blocks``: every prelude and coda block. ``core``: "iteration" (A_s s and the R blocks of one
    core iteration as one region), "block" (each core block), or None.
    """

    blocks: bool
    core: str | None


def checkpoint_plan(ac_mode: str) -> CheckpointPlan:
    if ac_mode not in AC_MODES:
        raise ValueError(f"ac_mode must be one of {AC_MODES}, got {ac_mode!r}")
    core = {"none": None, "per_iteration": "iteration", "full": "block"}[ac_mode]
    return CheckpointPlan(blocks=ac_mode != "none", core=core)


def dp_mesh_shape(world_size: int, dp_replicate: int, dp_shard: int) -> tuple[int, int]:
    """(replicas, shards) of the data-parallel mesh; dp_shard=-1 takes the rest of the world."""
    if dp_shard == -1:
        if world_size % dp_replicate:
            raise ValueError(f"world size {world_size} is not divisible by parallel.dp_replicate={dp_replicate}")
        dp_shard = world_size // dp_replicate
    if dp_replicate * dp_shard != world_size:
        raise ValueError(
            f"parallel.dp_replicate ({dp_replicate}) x parallel.dp_shard ({dp_shard}) = "
            f"{dp_replicate * dp_shard} does not match the world size {world_size}"
        )
    return dp_replicate, dp_shard


# ---------------------------------------------------------------------------------------------
# Full convention: model FLOPs per token


@dataclass(frozen=True)
class FlopBreakdown:
    """FLOPs per token of one micro-step. ``total`` = forward + backward: the model FLOPs behind MFU.

    ``recompute`` is the extra forward that activation checkpointing runs in backward; ``executed``
    adds it for the FLOPs the hardware actually performs.
    """

    forward: float
    backward: float
    recompute: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward

    @property
    def executed(self) -> float:
        return self.total + self.recompute

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total, "executed": self.executed}


def attention_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Forward score + value matmuls of one block, over the full T x T square.

    That is what FlopCounterMode counts for SDPA; causal kernels skip about half of it. Backward is
    2x (four matmuls); FlopCounterMode's flash/efficient backward formula adds the recompute of the
    scores (2.5x), which is not model FLOPs.
    """
    return 4 * seq_len * args.n_heads * args.head_dim


def document_masking_note() -> str:
    """What the FLOP counts mean under training.attention_mask = "document" (they do not change)."""
    return (
        "document masking on (training.attention_mask = 'document'): each packed document attends only to itself, "
        "RoPE positions restart per document; attention FLOPs are still counted over the full T x T square: "
        "documents of lengths L_i need only sum(L_i^2) of it in principle, but the dense SDPA mask computes all of it"
    )


def _block_flops(args: ModelArgs, seq_len: int) -> float:
    return 2 * _block_matmul_params(args) + attention_flops_per_token(args, seq_len)


def training_flops_per_token(
    args: ModelArgs, num_steps: tuple[int, int], seq_len: int, ac_mode: str = "none"
) -> FlopBreakdown:
    """FLOPs per token of a training micro-step with n no-grad then k grad core iterations.

    Gradients reach the head, the coda, the k grad iterations and, through the injection e, the
    prelude (when k >= 1). The adapter A [s; e] = A_s s + A_e e runs A_s s per iteration and the
    injection A_e e once per micro-step (it is the same for every iteration). ac_mode follows the
    parallelize recipe: prelude/coda blocks are recomputed, plus per grad iteration A_s s and the R
    blocks ("per_iteration") or the R blocks ("full").
    That recompute is exact for eager checkpointing without early stop; torch's default early stop
    skips each region's final down_proj, and compiled regions recompute what the partitioner picks.
    """
    plan = checkpoint_plan(ac_mode)
    # A static model has no loop: its (n, k) is ignored.
    n, k = resolve_num_steps(num_steps, args) if args.is_recurrent else (0, 0)
    block = _block_flops(args, seq_len)
    adapter_half = 2 * args.dim * args.dim
    injection = adapter_half if args.is_recurrent else 0.0
    iteration = adapter_half + args.n_core * block
    head = 2 * args.dim * args.vocab_size
    prelude, coda = args.n_prelude * block, args.n_coda * block
    # The prelude and the injection get gradients only if some iteration carries grad.
    prelude_grad = prelude + injection if (k > 0 or not args.is_recurrent) else 0.0
    forward = prelude + injection + (n + k) * iteration + coda + head
    backward = 2 * (prelude_grad + k * iteration + coda + head)
    if k > 0:  # the state entering the first grad iteration carries no grad: A_s gets only its weight grad
        backward -= adapter_half
    recompute = 0.0
    if plan.blocks:
        core_recompute = iteration if plan.core == "iteration" else args.n_core * block
        recompute = prelude_grad - injection * (k > 0) + k * core_recompute + coda
    return FlopBreakdown(forward, backward, recompute)


def eval_flops_per_token(args: ModelArgs, num_iterations: int, seq_len: int) -> float:
    """Forward FLOPs per token at r iterations (no gradients), e.g. validation at test recurrence r."""
    return training_flops_per_token(args, (num_iterations, 0), seq_len).forward


# ---------------------------------------------------------------------------------------------
# Paper convention


def paper_flops_per_token(args: ModelArgs, mean: int, backprop_depth: int = DEFAULT_BACKPROP_DEPTH) -> float:
    """6 * [N_prelude + N_coda + N_core*min(r, d) + N_core*max(r - d, 0)/3]; static models: 6 * N.

    The final norm is counted with the coda, so that a static model (R = 0) gives the reference's
    static 6 * N_nonembedding; the reference's recurrent count leaves those d parameters out.
    """
    counts = param_counts(args)
    grad_iterations = min(mean, backprop_depth)
    no_grad_iterations = max(mean - backprop_depth, 0)
    effective: float = counts.prelude + counts.coda + counts.final_norm
    effective += counts.core * grad_iterations + counts.core * no_grad_iterations / 3
    return 6 * effective


# ---------------------------------------------------------------------------------------------
# Memory per GPU at the peak of a training step (the preflight's estimate; docs/benchmarks.md checks it)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU (per process on CPU) at the peak of a training step."""

    weights: float
    grads: float
    optimizer: float
    gathered: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.gathered + self.activations

    def describe(self) -> str:
        parts = [
            ("weights", self.weights),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("gathered units", self.gathered),
            ("activations", self.activations),
        ]
        listed = ", ".join(f"{name} {format_bytes(value)}" for name, value in parts if value)
        return f"{format_bytes(self.total)} ({listed})"


def format_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def compute_bytes(cfg: JobConfig, device_type: str) -> int:
    """Bytes per element of the activations: 2 under bf16 mixed precision, 4 in fp32 (and always on CPU
    in "fsdp" mode, where FSDP2 casts nothing)."""
    t = cfg.training
    if t.mixed_precision_param == "float32" or (device_type == "cpu" and t.mixed_precision_mode == "fsdp"):
        return 4
    return 2


def block_saved_bytes(args: ModelArgs, c: int) -> float:
    """Bytes per token one transformer block saves for backward, besides its input.

    Counted tensor by tensor as eager PyTorch saves them (tests/training/test_preflight.py checks the count
    with saved-tensor hooks): RMSNorm keeps an fp32 copy of a low-precision input, its rsqrt and the
    normalised fp32 product; projections keep their inputs; SDPA (flash / memory-efficient) keeps q,
    k, v, its output and the fp32 log-sum-exp per head; SwiGLU keeps gate, up, silu(gate) and the
    product.
    """
    d, f, qd, kvd, heads = (
        args.dim,
        args.ffn_dim,
        args.n_heads * args.head_dim,
        args.n_kv_heads * args.head_dim,
        args.n_heads,
    )
    family = family_named(args.block_type)
    sdpa = c * (2 * qd + 2 * kvd) + 4 * heads
    mlp = 4 * c * f
    # q/k norms over the projections: the fp32 input (the projection's output), the rsqrt (one per row of
    # the norm: a token, or a token's head) and the normalised product, for q and for k.
    rsqrts = {"none": 0, "full": 2, "per_head": heads + args.n_kv_heads}[family.qk_norm]
    qk_norms = 0 if family.qk_norm == "none" else 8 * qd + 8 * kvd + 4 * rsqrts
    if family.pre_norm:
        # input_layernorm on the block input: (fp32 copy if bf16) + rsqrt + normalised + output (the q/k/v input).
        norm1 = (4 * d if c == 2 else 0) + 4 + 4 * d + c * d
        # post_attention_layernorm on h = x + attn, a new tensor: h (or its fp32 copy) + rsqrt + normalised + output.
        norm2 = 4 * d + 4 + 4 * d + c * d
        return norm1 + qk_norms + sdpa + norm2 + mlp
    # OLMo-2: post-norms on the attention and MLP outputs (their outputs are added, not saved), h saved by
    # the MLP projections.
    post_norms = 2 * (4 * d + 4 + 4 * d)
    return qk_norms + sdpa + post_norms + c * d + mlp


def loss_bytes(args: ModelArgs, tokens: int, chunk_tokens: int, c: int) -> float:
    """Peak bytes of the head + loss in backward, beyond the hidden states the forward saved.

    Chunked (models/loss.py): the input grad and an fp32 weight-grad buffer, plus per chunk the
    recomputed logits, their softmax and grad, or the chunk's (vocab x d) weight-grad product.
    Unchunked: the saved fp32 log-softmax over every token, its grad and the logits' grad.
    """
    vocab, d = args.vocab_size, args.dim
    if chunk_tokens <= 0:
        return vocab * tokens * (12 if c == 4 else 14)
    t = min(chunk_tokens, tokens)
    chunk = max(vocab * t * (8 if c == 4 else 10), c * vocab * t + vocab * d * (c if c == 4 else c + 4))
    return c * d * tokens + 4 * vocab * d + chunk


def activation_bytes(args: ModelArgs, cfg: JobConfig, c: int) -> float:
    """Peak activation bytes of one micro-batch: what the forward saves plus the largest backward region.

    The grad iterations are counted at their maximum, k = recurrence.backprop_depth (n costs nothing:
    no-grad iterations save nothing).
    """
    t, plan = cfg.training, checkpoint_plan(cfg.training.ac_mode)
    tokens = t.local_batch_size * t.seq_len
    h = c * args.dim
    block = block_saved_bytes(args, c)
    k = min(cfg.recurrence.backprop_depth, cfg.recurrence.mean_recurrence) if args.is_recurrent else 0
    grads = 4 * h + 3 * c * args.ffn_dim  # dY, dX and the MLP's f-sized grads of the block in backward
    per_block = h if plan.blocks else h + block  # a checkpointed block keeps its input only
    stem = args.n_prelude * per_block + (2 * h if args.is_recurrent else 0)  # + prelude output e, injection A_e e
    iteration_saved: float
    iteration_recompute: float
    if plan.core == "iteration":
        iteration_saved, iteration_recompute = h, args.n_core * (h + block)
    elif plan.core == "block":
        iteration_saved, iteration_recompute = h + args.n_core * h, h + block
    else:
        iteration_saved, iteration_recompute = h + args.n_core * (h + block), 0
    final_norm = 4 * args.dim + 4 + 4 * args.dim + h  # the coda output (or its fp32 copy), rsqrt, normalised, hidden
    saved = stem + k * iteration_saved + args.n_coda * per_block + final_norm
    peaks = [saved * tokens + loss_bytes(args, tokens, t.loss_chunk_tokens, c)]
    if plan.blocks:
        peaks.append((saved - final_norm + h + block + grads) * tokens)  # a prelude/coda block recomputed
    if k:
        peaks.append((stem + k * iteration_saved + iteration_recompute + grads) * tokens)
    return max(peaks)


def memory_estimate(cfg: JobConfig, args: ModelArgs, world_size: int, device_type: str = "cuda") -> MemoryEstimate:
    """Tensor bytes per GPU at the step's peak (see the module docstring for what is left out)."""
    c = compute_bytes(cfg, device_type)
    _, shards = dp_mesh_shape(world_size, cfg.parallel.dp_replicate, cfg.parallel.dp_shard)
    counts = param_counts(args)
    muon = muon_params(args) if cfg.optimizer.name == "muon" else 0
    adamw = counts.total - muon
    gathered = 0.0
    if world_size > 1:
        # Gathered in the compute dtype (fp32 under autocast): the largest FSDP unit with its unsharded
        # grads, the unit prefetched next, and the head (or the tied embedding) kept gathered after forward.
        g = 4 if cfg.training.mixed_precision_mode == "autocast" else c
        block = block_params(args) if args.n_prelude + args.n_coda else 0
        largest = counts.core + counts.adapter or max(block, counts.embedding)
        kept = counts.head + counts.final_norm if counts.head else counts.embedding
        gathered = g * (2 * largest + block + kept)
    return MemoryEstimate(
        weights=4 * counts.total / shards,
        grads=4 * counts.total / shards,
        optimizer=4 * (muon + 2 * adamw) / shards,
        gathered=gathered,
        activations=activation_bytes(args, cfg, c),
    )


# ---------------------------------------------------------------------------------------------
# Cumulative training FLOPs and compute matching


class TrainingRun:
    """A model trained under a recurrence schedule: FLOPs per step and cumulative, in both conventions.

    The "full" convention draws (n, k) for every micro-step from the schedule's sampler with the
    trainer's (step, micro_step) seeds. Cumulative sums are cached, so repeated queries are cheap.
    A static model needs no schedule.
    """

    def __init__(
        self,
        args: ModelArgs,
        schedule: RecurrenceSchedule | None,
        tokens_per_step: int,
        seq_len: int,
        micro_steps: int = 1,
    ) -> None:
        if args.is_recurrent and schedule is None:
            raise ValueError("a recurrent model needs a recurrence schedule")
        if micro_steps < 1 or tokens_per_step < 1 or seq_len < 1:
            raise ValueError("tokens_per_step, seq_len and micro_steps must be >= 1")
        self.args = args
        self.schedule = schedule
        self.tokens_per_step = tokens_per_step
        self.seq_len = seq_len
        self.micro_steps = micro_steps
        self._per_token: dict[tuple[int, int], float] = {}
        # _cumulative[c][s] = FLOPs of steps 1..s.
        self._cumulative: dict[str, list[float]] = {c: [0.0] for c in CONVENTIONS}

    def step_flops(self, step: int, convention: str) -> float:
        """FLOPs of optimizer step ``step`` (1-based, all its micro-steps)."""
        schedule = cast(RecurrenceSchedule, self.schedule)  # used only when the model is recurrent: then given
        if convention == "paper":
            if not self.args.is_recurrent:
                return self.tokens_per_step * paper_flops_per_token(self.args, 1)
            mean, depth = schedule.mean(step), schedule.backprop_depth(step)
            return self.tokens_per_step * paper_flops_per_token(self.args, mean, depth)
        if convention != "full":
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
        if not self.args.is_recurrent:
            return self.tokens_per_step * self._full_per_token((0, 0))
        tokens = self.tokens_per_step / self.micro_steps
        return sum((tokens * self._full_per_token(schedule.sample(step, m)) for m in range(self.micro_steps)), 0.0)

    def cumulative_flops(self, steps: int, convention: str) -> float:
        """FLOPs after ``steps`` optimizer steps (steps 1..steps)."""
        return self._cumulative_upto(steps, convention)[steps]

    def steps_for_flops(self, flops: float, convention: str) -> float:
        """The (fractional) number of steps whose cumulative FLOPs equal ``flops``."""
        if flops <= 0:
            return 0.0
        if not self.args.is_recurrent:
            return flops / self.step_flops(1, convention)
        cumulative = self._cumulative_upto(0, convention)
        while cumulative[-1] < flops:
            self._cumulative_upto(2 * len(cumulative), convention)
        steps = bisect.bisect_left(cumulative, flops) - 1
        return steps + (flops - cumulative[steps]) / (cumulative[steps + 1] - cumulative[steps])

    def _cumulative_upto(self, steps: int, convention: str) -> list[float]:
        if convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        cumulative = self._cumulative[convention]
        remaining = range(len(cumulative), steps + 1)
        todo: Iterable[int] = remaining
        if convention == "full" and self.args.is_recurrent and len(remaining) * self.micro_steps > REPLAY_BAR_DRAWS:
            todo = progress(remaining, desc=f"replaying the sampler ({self.micro_steps} draws/step)", unit="step")
        for step in todo:
            cumulative.append(cumulative[-1] + self.step_flops(step, convention))
        return cumulative

    def _full_per_token(self, num_steps: tuple[int, int]) -> float:
        if num_steps not in self._per_token:
            self._per_token[num_steps] = training_flops_per_token(self.args, num_steps, self.seq_len).total
        return self._per_token[num_steps]


def config_training_run(cfg: JobConfig, world_size: int = 1, args: ModelArgs | None = None) -> TrainingRun:
    """The FLOP account of a train config (or a run's saved config.json) on world_size data-parallel ranks.

    The one place a config's FLOPs are derived (tools/flops.py, preflight and the comparison use it).
    The architecture is ``args`` if given (e.g. a run's exported final_model), else the model folder,
    else model.preset + shape (a config whose folder is not converted yet). Schedule and batch are the
    trainer's: ``RecurrenceSchedule.from_config`` and ``grad_accum_steps``.
    """
    m, t = cfg.model, cfg.training
    if args is None:
        if m.path and m.preset and not Path(m.path).is_dir():
            args = PRESETS[m.preset].model_args(*m.shape)  # not converted yet: FLOPs need the shape only
        else:
            args = resolve_model_args(m)
    micro_steps = grad_accum_steps(t, world_size)
    tokens_per_step = micro_steps * t.local_batch_size * world_size * t.seq_len
    schedule = RecurrenceSchedule.from_config(cfg.recurrence, t.steps)
    return TrainingRun(args, schedule, tokens_per_step, t.seq_len, micro_steps)


# ---------------------------------------------------------------------------------------------
# MFU


def peak_flops(device_name: str | None = None, override: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of a device: ``override`` if given, else a table lookup.

    With no name, the current CUDA/ROCm device is asked. None (never a guess) on CPU or for a device
    missing from PEAK_BF16_FLOPS: pass ``override`` there.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s override must be > 0, got {override}")
        return float(override)
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    name = device_name.lower()
    return next((peak for key, peak in PEAK_BF16_FLOPS if key.lower() in name), None)


def mfu(flops_per_sec: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation per device, or None when the peak is unknown."""
    return None if peak is None else flops_per_sec / peak
