"""Preflight: check a run's inputs and print its plan before any accelerator is queued.

``python -m titan_recur.train --config FILE --check [--world-size N]`` resolves the config, opens the
model folder, the tokenizer and every data source (its first document), checks the batch geometry
for N ranks and prints the plan: parameters, shape, tokens per step, steps, training FLOPs in both
conventions, memory per GPU and time at an assumed MFU. Every number comes from the cost model
(training/cost_model.py) and the shapes: no model is built, no process group is needed and nothing is
written. The trainer prints the same plan as its start-up banner.
"""

from __future__ import annotations

import socket
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from titan_recur.config import FINAL_MODEL_FOLDER, ConfigError, JobConfig, grad_accum_steps
from titan_recur.data.loader import all_sources, check_data_config, check_phase_weights, check_source
from titan_recur.data.tokenizer import Tokenizer, check_same_tokenizer, check_vocab, load_tokenizer
from titan_recur.models.args import ModelArgs
from titan_recur.storage.checkpoint import scan_checkpoints
from titan_recur.storage.model_io import check_output_folder, resolve_model_args
from titan_recur.training import cost_model
from titan_recur.training.metrics import format_duration, import_wandb
from titan_recur.utils.exit_codes import EXIT_BAD_INPUT
from titan_recur.utils.limits import check_allocation, check_seq_len

ASSUMED_MFU = 0.4
# The full convention replays the sampler; a plan samples this many draws spread over the run.
PLAN_DRAWS = 2000


@dataclass(frozen=True)
class CheckOptions:
    """The flags of ``--check``: the world size to plan for and the time assumptions."""

    world_size: int = 1
    assume_mfu: float = ASSUMED_MFU
    gpu: str | None = None


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


def check_output_folders(cfg: JobConfig) -> None:
    """The run's output folders, and those above them, must be folders (or not exist yet): else the run fails
    where it first writes there (a trace folder at its traced step)."""
    dump = Path(cfg.job.dump_folder)
    outputs = {"job.dump_folder": dump, "checkpoint.folder": dump / cfg.checkpoint.folder}
    if cfg.profiling.trace_steps:
        outputs["profiling.save_folder"] = dump / cfg.profiling.save_folder
    if cfg.checkpoint.export_final:
        outputs["checkpoint.export_final"] = dump / FINAL_MODEL_FOLDER
    for setting, folder in outputs.items():
        blocking = next((path for path in (folder, *folder.parents) if path.exists() and not path.is_dir()), None)
        if blocking is not None:
            raise ConfigError(f"{blocking} exists and is not a folder ({setting})")


def check_finished_run(cfg: JobConfig, force: bool) -> None:
    """A run with no checkpoint to continue from starts over: where an earlier run finished, it would replace
    that run's final_model/ and config.json and log its steps again, so that takes --force (and replaces only
    a trained model). Continuing from the folder's checkpoints replaces the run's own model: no question."""
    dump = Path(cfg.job.dump_folder)
    final, checkpoints = dump / FINAL_MODEL_FOLDER, dump / cfg.checkpoint.folder
    if not final.is_dir() or (cfg.checkpoint.enable and scan_checkpoints(checkpoints).complete):
        return
    if not force:
        raise ConfigError(
            f"{final} holds a finished run's model and {checkpoints} no checkpoint to continue it from: this run "
            "would start over and replace it; choose another job.dump_folder, or pass --force to replace it"
        )
    check_output_folder(final, force, replaceable_kind="trained", error=ConfigError)


def check_model_fit(cfg: JobConfig, args: ModelArgs, tokenizer: Tokenizer) -> None:
    """The model against the rest of the run: its positions hold a row, its embedding every token id, and a
    data.tokenizer beside the model folder's own means the same ids."""
    check_seq_len(cfg.training.seq_len, args.max_seq_len, flag="training.seq_len")
    check_vocab(tokenizer, args.vocab_size)
    if cfg.data.tokenizer and cfg.model.path:
        check_same_tokenizer(tokenizer, cfg.data.tokenizer, Path(cfg.model.path), "data.tokenizer")


def check_data(cfg: JobConfig, tokenizer: Tokenizer) -> None:
    """The run's data check: every source's first usable document, and a held-out one for validation."""
    check_data_config(cfg.data, tokenizer, cfg.training.seq_len, validation=cfg.validation.enable)


def check_loggers(cfg: JobConfig) -> None:
    """A logger the run is told to use can be imported (W&B is optional)."""
    if cfg.metrics.enable_wandb:
        import_wandb()


def check_inputs(cfg: JobConfig, world_size: int, force: bool = False) -> Inputs:
    """Every check a run runs before it starts (the trainer calls the same functions), each failure one line;
    nothing is built on a device. Not here: what needs the run's node (CUDA, free memory) or its checkpoints."""
    found = Inputs()
    _attempt(found, lambda: check_output_folders(cfg))
    _attempt(found, lambda: check_finished_run(cfg, force))
    found.model_args = _attempt(found, lambda: resolve_model_args(cfg.model))
    folder = tokenizer_folder(cfg)
    if folder is None:
        found.problems.append(
            "set data.tokenizer (a folder with tokenizer files) when training from model.preset or from scratch"
        )
    elif found.model_args is not None or folder != cfg.model.path:  # a missing model folder is one problem
        found.tokenizer = _attempt(found, lambda: load_tokenizer(folder))
    if found.tokenizer is not None and found.model_args is not None:
        _attempt(found, lambda: check_model_fit(cfg, found.model_args, found.tokenizer))
    _attempt(found, lambda: check_loggers(cfg))
    found.grad_accum = _attempt(found, lambda: grad_accum_steps(cfg.training, world_size))
    p = cfg.parallel
    found.mesh = _attempt(found, lambda: cost_model.dp_mesh_shape(world_size, p.dp_replicate, p.dp_shard))
    before = len(found.problems)
    _attempt(found, lambda: check_phase_weights(cfg.data))
    if found.tokenizer is None or len(found.problems) > before:
        return found
    sources = _attempt(found, lambda: all_sources(cfg.data)) or []
    hub = use_cache_only_if_hub_unreachable() if any(source.kind == "hf" for source in sources) else None
    for source in sources:
        name = source.name or source.path
        why = f" ({hub}; local cache only)" if hub and source.kind == "hf" else ""
        tokens = _attempt(
            found,
            lambda source=source: check_source(source, found.tokenizer, cfg.training.seq_len),
            prefix=f"data source {name!r} ({source.kind} {source.path}) cannot be read: ",
        )
        if tokens is not None:
            found.sources.append((name, tokens))
        elif why:
            found.problems[-1] = found.problems[-1].replace(" cannot be read: ", f" cannot be read{why}: ", 1)
    if len(found.problems) == before:  # each source read: the run's own check, held-out documents included
        _attempt(found, lambda: check_data(cfg, found.tokenizer))
    return found


HUB_PROBE_TIMEOUT_S = 5.0


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (one TCP connect to HF_ENDPOINT), or None if it can
    (or if HF_HUB_OFFLINE already says to use the cache)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as err:
        return f"{url.hostname}:{port} is unreachable ({err})"
    return None


def use_cache_only_if_hub_unreachable() -> str | None:
    """Without a reachable Hub, hub sources are read from the local cache only: a missing one fails in
    seconds with one line instead of minutes of retries (huggingface_hub retries each request).
    Returns why the Hub is unreachable, or None."""
    reason = hub_unreachable()
    if reason is not None:
        import datasets.config
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    return reason


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


# ---------------------------------------------------------------------------------------------- plan


def full_flops_estimate(run: cost_model.TrainingRun, steps: int) -> tuple[float, bool]:
    """Full-convention FLOPs of steps 1..steps: exact for short runs, else from PLAN_DRAWS draws spread
    evenly over the run (sampling noise well below 0.1%); True when exact."""
    sampled = max(1, PLAN_DRAWS // run.micro_steps)
    if steps <= sampled:
        return run.cumulative_flops(steps, "full"), True
    chosen = [1 + (2 * i + 1) * steps // (2 * sampled) for i in range(sampled)]
    return sum(run.step_flops(s, "full") for s in chosen) * steps / sampled, False


def plan_lines(
    cfg: JobConfig, args: ModelArgs, world_size: int, options: CheckOptions | None = None, device_type: str = "cuda"
) -> list[str]:
    """The plan, one fact per line: what runs, on how many ranks, for how long, in how much memory."""
    options = options or CheckOptions(world_size=world_size)
    t, r, m = cfg.training, cfg.recurrence, cfg.model
    run = cost_model.config_training_run(cfg, world_size, args)
    accum, tokens_per_step = run.micro_steps, run.tokens_per_step
    replicas, shards = cost_model.dp_mesh_shape(world_size, cfg.parallel.dp_replicate, cfg.parallel.dp_shard)
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
    if t.attention_mask == "document":
        lines.append(f"attention: {cost_model.document_masking_note()}")
    lines.append(
        f"training FLOPs: paper {paper:.4e}, full {full:.4e}"
        + ("" if exact else f" (from {PLAN_DRAWS:,} sampled draws; tools/flops.py replays all)")
    )
    memory = cost_model.memory_estimate(cfg, args, world_size, device_type)
    lines.append(
        f"memory per {'GPU' if device_type != 'cpu' else 'process'}: ~{memory.describe()} at "
        f"{t.local_batch_size} x {t.seq_len} tokens, ac_mode {t.ac_mode}, tensors only"
    )
    peak = cost_model.peak_flops(device_name=options.gpu, override=cfg.metrics.peak_flops)
    if peak is None:
        lines.append("time: unknown peak FLOP/s of this device (set metrics.peak_flops; --check also takes --gpu h100)")
    else:
        seconds = full / (world_size * peak * options.assume_mfu)
        lines.append(
            f"time: ~{format_duration(seconds)} at MFU {options.assume_mfu:g} of {peak / 1e12:,.0f} "
            f"TFLOP/s per GPU (full-convention FLOPs)"
        )
    v = cfg.validation
    lines.append(
        f"validation: every {v.interval} steps, {v.steps} batches per rank, r in {list(v.recurrences)}"
        if v.enable
        else "validation: off (validation.enable = false)"
    )
    return lines


# The estimate is within 10% of the live tensors measured (docs/benchmarks.md); refuse only well above it.
STEP_MEMORY_TOLERANCE = 1.5


def check_step_memory(cfg: JobConfig, args: ModelArgs, world_size: int, device: torch.device) -> None:
    """Refuse a step whose estimated peak is far above the device's free memory: a batch-size typo (1e8)
    would otherwise fill the batch until the step watchdog ends the run as a stall."""
    t = cfg.training
    memory = cost_model.memory_estimate(cfg, args, world_size, device.type)
    check_allocation(
        int(memory.total),
        device,
        f"a training step of {t.local_batch_size} x {t.seq_len} tokens per rank (estimated: {memory.describe()})",
        hint="lower training.local_batch_size (gradient accumulation keeps training.global_batch_size)",
        tolerance=STEP_MEMORY_TOLERANCE,
    )


def run_check(cfg: JobConfig, options: CheckOptions, force: bool = False) -> tuple[list[str], list[str]]:
    """(plan lines, problems): the plan when every check passed, else one line per problem."""
    found = check_inputs(cfg, options.world_size, force)
    if found.problems:
        return [], found.problems
    assert found.model_args is not None and found.tokenizer is not None  # no problems: both were read
    device_type = "cpu" if cfg.training.device == "cpu" else "cuda"  # "auto": the run's GPUs, not this node
    lines = plan_lines(cfg, found.model_args, options.world_size, options, device_type)
    tokenizer_path = tokenizer_folder(cfg)
    lines.insert(
        2, f"tokenizer: {tokenizer_path} ({type(found.tokenizer).__name__}, vocab {found.tokenizer.vocab_size:,})"
    )
    for name, tokens in found.sources:
        lines.append(f"data: {name}: first document read ({tokens:,} tokens)")
    return lines, []


def main_check(cfg: JobConfig, options: CheckOptions, force: bool = False) -> int:
    """``--check``: print the plan (exit 0) or one line per problem on stderr (exit 2); writes nothing."""
    lines, problems = run_check(cfg, options, force)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return EXIT_BAD_INPUT
    print(f"[titan_recur] check passed for {options.world_size} rank(s); the plan:")
    for line in lines:
        print(f"  {line}")
    return 0
