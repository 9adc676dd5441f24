"""Preflight: check a run's inputs and print its plan before any accelerator is queued.

``python -m titan_recur.train --config FILE --check [--world-size N]`` resolves the config, opens the
model folder, the tokenizer and every data source (its first document), checks the batch geometry
for N ranks and prints the plan: parameters, shape, tokens per step, steps, training FLOPs in both
conventions, memory per GPU and time at an assumed MFU. No model is built on a device (a meta-device
build gives the parameter counts), no process group is needed and nothing is written. The trainer
prints the same plan as its start-up banner.

The memory estimate counts tensors (weights, grads, optimizer states, gathered FSDP units and the
activations of one micro-batch under the AC mode) from the shapes, as eager PyTorch saves them for
backward; docs/benchmarks.md compares it with the measured peak. It leaves out the CUDA context,
NCCL buffers, allocator fragmentation and Muon's gathered matrices.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from titan_recur.training import cost_model
from titan_recur.config import ConfigError, JobConfig, grad_accum_steps
from titan_recur.data.loader import all_sources, check_phase_weights, check_source
from titan_recur.training.metrics import format_duration
from titan_recur.models.args import ModelArgs
from titan_recur.storage.model_io import resolve_model_args
from titan_recur.models.model import RecurrentLM
from titan_recur.training.optim import split_params_for_muon
from titan_recur.training.parallelize import dp_mesh_shape
from titan_recur.data.tokenizer import Tokenizer, check_vocab, load_tokenizer

GiB = 2**30
# Exit status of a failed check (the trainer's EXIT_BAD_INPUT).
EXIT_PROBLEMS = 2
ASSUMED_MFU = 0.4
# The full convention replays the sampler; a plan samples this many draws spread over the run.
PLAN_DRAWS = 2000


@dataclass(frozen=True)
class CheckOptions:
    """The flags of ``--check``: the world size to plan for and the time assumptions."""

    world_size: int = 1
    assume_mfu: float = ASSUMED_MFU
    gpu: str | None = None


def split_check_args(argv: Sequence[str]) -> tuple[CheckOptions | None, list[str]]:
    """Pull ``--check [--world-size N] [--assume-mfu F] [--gpu NAME]`` out of the trainer's argv.

    Without --check the other three are refused (they only mean something for a check). The world
    size defaults to torchrun's WORLD_SIZE, else 1.
    """
    values: dict[str, str] = {}
    rest, check, i = [], False, 0
    while i < len(argv):
        token = argv[i]
        name, eq, text = token.partition("=")
        if token == "--check":
            check = True
        elif name in ("--world-size", "--assume-mfu", "--gpu"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"command line: {name} needs a value")
                i, text = i + 1, argv[i + 1]
            values[name] = text
        else:
            rest.append(token)
        i += 1
    if not check:
        if values:
            raise ConfigError(f"command line: {', '.join(values)} only apply with --check")
        return None, rest
    try:
        world = int(values.get("--world-size", os.environ.get("WORLD_SIZE", "1")))
        mfu = float(values.get("--assume-mfu", ASSUMED_MFU))
    except ValueError as err:
        raise ConfigError(f"command line: --world-size takes an integer, --assume-mfu a number ({err})") from None
    if world < 1 or not 0 < mfu <= 1:
        raise ConfigError(f"command line: --world-size must be >= 1 and --assume-mfu in (0, 1], got {world}, {mfu}")
    gpu = values.get("--gpu")
    if gpu is not None and cost_model.peak_flops(device_name=gpu) is None:
        names = ", ".join(name.lower() for name, _ in cost_model.PEAK_BF16_FLOPS)
        raise ConfigError(f"command line: --gpu {gpu!r} is not in the peak table ({names}); set --metrics.peak_flops")
    return CheckOptions(world, mfu, gpu), rest


def tokenizer_folder(cfg: JobConfig) -> str | None:
    """Where the run's tokenizer files are: data.tokenizer, else the model folder."""
    return cfg.data.tokenizer or cfg.model.path


# ---------------------------------------------------------------------------------------------- checks


@dataclass
class Inputs:
    """What the checks found: the model's shape, the tokenizer, the batch geometry, per-source results."""

    model_args: ModelArgs | None = None
    tokenizer: Tokenizer | None = None
    grad_accum: int | None = None
    mesh: tuple[int, int] | None = None
    sources: list[tuple[str, int]] = field(default_factory=list)  # (name, tokens of its first document)
    problems: list[str] = field(default_factory=list)


def check_inputs(cfg: JobConfig, world_size: int) -> Inputs:
    """Every check a run needs before it starts, each failure one line; nothing is built on a device."""
    found = Inputs()
    found.model_args = _attempt(found, lambda: resolve_model_args(cfg.model))
    folder = tokenizer_folder(cfg)
    if folder is None:
        found.problems.append("set data.tokenizer (a folder with tokenizer files) when training from model.preset or from scratch")
    elif found.model_args is not None or folder != cfg.model.path:  # a missing model folder is one problem
        found.tokenizer = _attempt(found, lambda: load_tokenizer(folder))
    if found.tokenizer is not None and found.model_args is not None:
        _attempt(found, lambda: check_vocab(found.tokenizer, found.model_args.vocab_size))
    found.grad_accum = _attempt(found, lambda: grad_accum_steps(cfg.training, world_size))
    p = cfg.parallel
    found.mesh = _attempt(found, lambda: dp_mesh_shape(world_size, p.dp_replicate, p.dp_shard))
    before = len(found.problems)
    _attempt(found, lambda: check_phase_weights(cfg.data))
    if found.tokenizer is None or len(found.problems) > before:
        return found
    for source in _attempt(found, lambda: all_sources(cfg.data)) or []:
        name = source.name or source.path
        tokens = _attempt(found, lambda: check_source(source, found.tokenizer, cfg.training.seq_len),
                          prefix=f"data source {name!r} ({source.kind} {source.path}) cannot be read: ")
        if tokens is not None:
            found.sources.append((name, tokens))
    return found


def _attempt(found: Inputs, check, prefix: str = ""):
    """Run one check; its failure becomes one problem line (hub and network errors come in many types)."""
    try:
        return check()
    except Exception as err:  # noqa: BLE001 - every failure is reported, as one line
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if prefix and not text.startswith("data source"):
            text = f"{prefix}{type(err).__name__}: {text}"
        found.problems.append(text)
        return None


# ---------------------------------------------------------------------------------------------- memory


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
        parts = [("weights", self.weights), ("grads", self.grads), ("optimizer", self.optimizer),
                 ("gathered units", self.gathered), ("activations", self.activations)]
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


def parameter_numels(args: ModelArgs) -> dict[str, int]:
    """Parameters by how they are trained and sharded, from a meta-device build (no memory)."""
    with torch.device("meta"):
        model = RecurrentLM(args)
    muon, adamw = split_params_for_muon(model)
    core = sum(p.numel() for p in model.core.parameters()) if model.core is not None else 0
    blocks = [sum(p.numel() for p in b.parameters()) for b in [*model.prelude, *model.coda]]
    head = 0 if args.tie_embeddings else sum(p.numel() for p in [*model.norm.parameters(), *model.lm_head.parameters()])
    return {
        "total": sum(p.numel() for p in model.parameters()),
        "muon": sum(p.numel() for _, p in muon),
        "adamw": sum(p.numel() for _, p in adamw),
        "core": core,
        "largest_block": max(blocks, default=0),
        "embedding": model.embed_tokens.weight.numel(),
        "head": head,
    }


def block_saved_bytes(args: ModelArgs, c: int) -> float:
    """Bytes per token one transformer block saves for backward, besides its input.

    Counted tensor by tensor as eager PyTorch saves them (tests/test_preflight.py checks the count
    with saved-tensor hooks): RMSNorm keeps an fp32 copy of a low-precision input, its rsqrt and the
    normalised fp32 product; projections keep their inputs; SDPA (flash / memory-efficient) keeps q,
    k, v, its output and the fp32 log-sum-exp per head; SwiGLU keeps gate, up, silu(gate) and the
    product.
    """
    d, f, qd, kvd, heads = args.dim, args.ffn_dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.n_heads
    sdpa = c * (2 * qd + 2 * kvd) + 4 * heads
    mlp = 4 * c * f
    if args.block_type == "llama":
        # input_layernorm on the block input: (fp32 copy if bf16) + rsqrt + normalised + output (the q/k/v input).
        norm1 = (4 * d if c == 2 else 0) + 4 + 4 * d + c * d
        # post_attention_layernorm on h = x + attn, a new tensor: h (or its fp32 copy) + rsqrt + normalised + output.
        norm2 = 4 * d + 4 + 4 * d + c * d
        return norm1 + sdpa + norm2 + mlp
    # OLMo-2: q/k norms over the projections (fp32 input + rsqrt + normalised), post-norms on the
    # attention and MLP outputs (their outputs are added, not saved), h saved by the MLP projections.
    qk_norms = (4 * qd + 4 + 4 * qd) + (4 * kvd + 4 + 4 * kvd)
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
    t, ac = cfg.training, cfg.training.ac_mode
    tokens = t.local_batch_size * t.seq_len
    h = c * args.dim
    block = block_saved_bytes(args, c)
    k = min(cfg.recurrence.backprop_depth, cfg.recurrence.mean_recurrence) if args.is_recurrent else 0
    grads = 4 * h + 3 * c * args.ffn_dim  # dY, dX and the MLP's f-sized grads of the block in backward
    per_block = h if ac != "none" else h + block  # a checkpointed block keeps its input only
    stem = args.n_prelude * per_block + (2 * h if args.is_recurrent else 0)  # + prelude output e, injection A_e e
    if ac == "per_iteration":
        iteration_saved, iteration_recompute = h, args.n_core * (h + block)
    elif ac == "full":
        iteration_saved, iteration_recompute = h + args.n_core * h, h + block
    else:
        iteration_saved, iteration_recompute = h + args.n_core * (h + block), 0
    final_norm = 4 * args.dim + 4 + 4 * args.dim + h  # the coda output (or its fp32 copy), rsqrt, normalised, hidden
    saved = stem + k * iteration_saved + args.n_coda * per_block + final_norm
    peaks = [saved * tokens + loss_bytes(args, tokens, t.loss_chunk_tokens, c)]
    if ac != "none":
        peaks.append((saved - final_norm + h + block + grads) * tokens)  # a prelude/coda block recomputed
    if k:
        peaks.append((stem + k * iteration_saved + iteration_recompute + grads) * tokens)
    return max(peaks)


def memory_estimate(cfg: JobConfig, args: ModelArgs, world_size: int, device_type: str = "cuda") -> MemoryEstimate:
    """Tensor bytes per GPU at the step's peak (see the module docstring for what is left out)."""
    c = compute_bytes(cfg, device_type)
    replicas, shards = dp_mesh_shape(world_size, cfg.parallel.dp_replicate, cfg.parallel.dp_shard)
    numel = parameter_numels(args)
    muon, adamw = (numel["muon"], numel["adamw"]) if cfg.optimizer.name == "muon" else (0, numel["total"])
    gathered = 0.0
    if world_size > 1:
        # Gathered in the compute dtype (fp32 under autocast): the largest unit with its unsharded grads,
        # the unit prefetched next, and the head (or the tied embedding) kept gathered after forward.
        g = 4 if cfg.training.mixed_precision_mode == "autocast" else c
        largest = numel["core"] or max(numel["largest_block"], numel["embedding"])
        kept = numel["head"] if numel["head"] else numel["embedding"]
        gathered = g * (2 * largest + numel["largest_block"] + kept)
    return MemoryEstimate(
        weights=4 * numel["total"] / shards,
        grads=4 * numel["total"] / shards,
        optimizer=4 * (muon + 2 * adamw) / shards,
        gathered=gathered,
        activations=activation_bytes(args, cfg, c),
    )


# ---------------------------------------------------------------------------------------------- plan


def full_flops_estimate(run: cost_model.TrainingRun, steps: int) -> tuple[float, bool]:
    """Full-convention FLOPs of steps 1..steps: exact for short runs, else from PLAN_DRAWS draws spread
    evenly over the run (sampling noise well below 0.1%); True when exact."""
    sampled = max(1, PLAN_DRAWS // run.micro_steps)
    if steps <= sampled:
        return run.cumulative_flops(steps, "full"), True
    chosen = [1 + (2 * i + 1) * steps // (2 * sampled) for i in range(sampled)]
    return sum(run.step_flops(s, "full") for s in chosen) * steps / sampled, False


def plan_lines(cfg: JobConfig, args: ModelArgs, world_size: int, options: CheckOptions | None = None,
               device_type: str = "cuda") -> list[str]:
    """The plan, one fact per line: what runs, on how many ranks, for how long, in how much memory."""
    options = options or CheckOptions(world_size=world_size)
    t, r, m = cfg.training, cfg.recurrence, cfg.model
    run = cost_model.config_training_run(cfg, world_size, args)
    accum, tokens_per_step = run.micro_steps, run.tokens_per_step
    replicas, shards = dp_mesh_shape(world_size, cfg.parallel.dp_replicate, cfg.parallel.dp_shard)
    sequences = tokens_per_step // t.seq_len
    counts = cost_model.param_counts(args)
    paper = run.cumulative_flops(t.steps, "paper")
    full, exact = full_flops_estimate(run, t.steps)
    shape = f"{args.n_prelude},{args.n_core},{args.n_coda}" + (" (recurrent)" if args.is_recurrent else " (static)")
    mesh = f"HSDP {replicas} replicas x {shards} shards" if replicas > 1 else f"FSDP over {shards}"
    mesh = mesh if world_size > 1 else "one process, no FSDP"
    lines = [
        f"run: {cfg.job.description or '(no job.description)'}; dump folder {cfg.job.dump_folder}",
        f"model: {m.path or m.preset or 'from scratch'} shape {shape}, d {args.dim}, vocab {args.vocab_size}; parameters "
        f"{counts.total:,} (non-embedding {counts.non_embedding:,}, core {counts.core:,})",
        f"ranks: {world_size} ({mesh}); batch {sequences} sequences x {t.seq_len} tokens = {tokens_per_step:,} "
        f"tokens/step ({t.local_batch_size} per rank x {accum} micro-step(s))",
        f"steps: {t.steps:,} ({t.steps * tokens_per_step:.3e} tokens); lr warmup {cfg.lr_scheduler.warmup_fraction:g}, "
        f"decay {cfg.lr_scheduler.decay_fraction:g} ({cfg.lr_scheduler.decay_type})",
    ]
    if args.is_recurrent:
        lines.append(
            f"recurrence: {r.curriculum} curriculum of the mean r to {r.mean_recurrence} over {r.warmup_fraction:g} "
            f"of the steps, backprop depth {r.backprop_depth}; each micro-step samples n no-grad + k grad "
            f"iterations, E[n + k] = r{' + 1' if r.mean_offset else ''}"
        )
    lines.append(f"training FLOPs: paper {paper:.4e}, full {full:.4e}"
                 + ("" if exact else f" (from {PLAN_DRAWS:,} sampled draws; tools/flops.py replays all)"))
    memory = memory_estimate(cfg, args, world_size, device_type)
    lines.append(f"memory per {'GPU' if device_type != 'cpu' else 'process'}: ~{memory.describe()} at "
                 f"{t.local_batch_size} x {t.seq_len} tokens, ac_mode {t.ac_mode}, tensors only")
    peak = cost_model.peak_flops(device_name=options.gpu, override=cfg.metrics.peak_flops)
    if peak is None:
        lines.append("time: unknown peak FLOP/s of this device (set metrics.peak_flops; --check also takes --gpu h100)")
    else:
        seconds = full / (world_size * peak * options.assume_mfu)
        lines.append(f"time: ~{format_duration(seconds)} at MFU {options.assume_mfu:g} of {peak / 1e12:,.0f} "
                     f"TFLOP/s per GPU (full-convention FLOPs)")
    v = cfg.validation
    lines.append(f"validation: every {v.interval} steps, {v.steps} batches per rank, r in {list(v.recurrences)}"
                 if v.enable else "validation: off (validation.enable = false)")
    return lines


def run_check(cfg: JobConfig, options: CheckOptions) -> tuple[list[str], list[str]]:
    """(plan lines, problems): the plan when every check passed, else one line per problem."""
    found = check_inputs(cfg, options.world_size)
    if found.problems:
        return [], found.problems
    device_type = "cpu" if cfg.training.device == "cpu" else "cuda"  # "auto": the run's GPUs, not this node
    lines = plan_lines(cfg, found.model_args, options.world_size, options, device_type)
    tokenizer_path = tokenizer_folder(cfg)
    lines.insert(2, f"tokenizer: {tokenizer_path} ({type(found.tokenizer).__name__}, vocab {found.tokenizer.vocab_size:,})")
    for name, tokens in found.sources:
        lines.append(f"data: {name}: first document read ({tokens:,} tokens)")
    return lines, []


def main_check(cfg: JobConfig, options: CheckOptions) -> int:
    """``--check``: print the plan (exit 0) or one line per problem on stderr (exit 2); writes nothing."""
    lines, problems = run_check(cfg, options)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return EXIT_PROBLEMS
    print(f"[titan_recur] check passed for {options.world_size} rank(s); the plan:")
    for line in lines:
        print(f"  {line}")
    return 0
