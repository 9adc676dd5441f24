"""Job config: nested dataclasses loaded from TOML and overridden by ``--section.key value`` flags.

Precedence is defaults < config file < command line. Values are type-checked strictly (a bool is
not an int, a TOML int is not a bool) so that a typo or a wrong type stops the job at startup with
one line naming the key, where it came from and what was expected.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import sys
import textwrap
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, cast, get_args, get_origin, get_type_hints

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from titan_recur.models.args import (
    DEFAULT_BACKPROP_DEPTH,
    DEFAULT_SEED,
    DEFAULT_SIGMA,
    PRESETS,
    BackpropCurriculum,
    MeanCurriculum,
)
from titan_recur.utils.limits import MAX_RECURRENCE
from titan_recur.utils.resources import find_config

# Activation checkpointing modes of the parallelize recipe (their FLOP cost is in titan_recur.training.cost_model).
ACMode = Literal["none", "full", "per_iteration"]
AC_MODES: tuple[str, ...] = get_args(ACMode)
# Fingerprint fields whose change on resume is safe by design (titan_recur.training.fingerprint; docs/checkpointing.md).
AllowedChange = Literal["steps", "seq_len", "global_batch_size", "recurrence", "data"]
ALLOWED_CHANGES: tuple[str, ...] = get_args(AllowedChange)
# How a data source's records become tokens and labels (titan_recur.data.loader; docs/data.md).
DataFormat = Literal["text", "prompt_completion"]
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
NSDtype = Literal["auto", "bfloat16", "float32"]
# What a data source is: text files, records (jsonl, parquet, a hub dataset) or token ids (tokenized).
SourceKind = Literal["text", "jsonl", "parquet", "hf", "tokenized"]
SOURCE_KINDS: tuple[str, ...] = get_args(SourceKind)
TEXT_SOURCE_KINDS = tuple(k for k in SOURCE_KINDS if k != "tokenized")  # what a tokenizer reads
RECORD_SOURCE_KINDS = tuple(k for k in TEXT_SOURCE_KINDS if k != "text")  # sources with named fields
# How a text file splits into documents.
SampleBy = Literal["paragraph", "document", "line"]
SAMPLE_BY: tuple[str, ...] = get_args(SampleBy)
# How mixed precision applies (titan_recur.training.parallelize).
MixedPrecisionMode = Literal["fsdp", "autocast"]
MIXED_PRECISION_MODES: tuple[str, ...] = get_args(MixedPrecisionMode)
# The learning rate's decay (titan_recur.training.optim).
DecayType = Literal["cosine", "linear"]
DECAY_TYPES: tuple[str, ...] = get_args(DecayType)

_CLI = "command line"
# The run's model export at the end of training, under job.dump_folder.
FINAL_MODEL_FOLDER = "final_model"
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


class ConfigError(ValueError):
    """A bad config file, key or value; the message is a single line meant for the user."""


def opt(default: Any, help: str) -> Any:
    """A config field carrying its --help text; mutable defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class Job:
    """Run bookkeeping."""

    dump_folder: str = opt("./outputs", "Root folder for checkpoints, logs and the resolved config.")
    description: str = opt("", "Free-text description of the run, stored with its outputs.")
    seed: int = opt(0, "Seed for parameter init and data order.")
    deterministic: bool = opt(False, "Use deterministic algorithms (for bit-exact resume tests); slower.")
    print_config: bool = opt(False, "Print the resolved config at startup.")


@dataclass
class Model:
    """What to train: a converted model folder, a preset architecture without weights, or an architecture
    of its own (model.dim, n_layers, n_heads, ffn_dim, vocab_size) trained from scratch."""

    path: str | None = opt(
        None,
        "Converted model folder written by tools/convert_hf.py (config.json + model.safetensors + tokenizer files).",
    )
    preset: str | None = opt(
        None,
        "Source-model preset, e.g. 'tinyllama-1.1b', built from model.shape without weights "
        "(meta-device counts, random init).",
    )
    shape: list[int] = opt(
        [],
        "Prelude,core,coda layer counts (P,R,C) for model.preset. Set with model.path too, preset + shape "
        "name the folder's architecture (tools/flops.py uses them before conversion; the trainer checks them).",
    )
    init: Literal["load", "random"] = opt(
        "load", "'load' weights from model.path, or 'random' init (from scratch / debug)."
    )
    dim: int | None = opt(
        None,
        "Pretraining from scratch (no path, no preset, init 'random'): the width of a Llama-family model of its "
        "own; with n_layers, n_heads, ffn_dim and vocab_size. RoPE theta 10000, max_seq_len 4096, untied; "
        "BOS/EOS from the tokenizer. Its final model exports (tools/export_hf.py) as a plain HF Llama folder.",
    )
    n_layers: int | None = opt(
        None, "From scratch: the number of blocks (model.shape splits them; default all static)."
    )
    n_heads: int | None = opt(None, "From scratch: attention heads (head_dim = dim / n_heads).")
    n_kv_heads: int | None = opt(None, "From scratch: key/value heads (GQA); none = n_heads.")
    ffn_dim: int | None = opt(None, "From scratch: the SwiGLU hidden width.")
    vocab_size: int | None = opt(None, "From scratch: the embedding rows; at least the tokenizer's vocabulary.")


@dataclass
class Training:
    """Step count, batch geometry, precision and memory options."""

    steps: int = opt(50000, "Number of optimizer steps.")
    local_batch_size: int = opt(16, "Sequences per rank per micro-step.")
    global_batch_size: int | None = opt(
        None,
        "Sequences per optimizer step; none = local_batch_size * dp world size (no accumulation). "
        "Must be a multiple of local_batch_size * dp.",
    )
    seq_len: int = opt(1024, "Tokens per training sequence.")
    max_norm: float = opt(1.0, "Gradient-norm clipping threshold.")
    mixed_precision_param: Literal["bfloat16", "float32"] = opt(
        "bfloat16", "Parameter dtype for FSDP compute; ignored on CPU, which always uses float32."
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = opt("float32", "Gradient reduce-scatter dtype.")
    mixed_precision_mode: MixedPrecisionMode = opt(
        "fsdp",
        "How mixed_precision_param applies. 'fsdp': FSDP2 casts the parameters, so the whole residual stream "
        "runs in it (skipped on CPU). 'autocast': fp32 parameters and torch.autocast(mixed_precision_param) "
        "around the forward, as the reference does: matmuls in bf16, the prelude's residual stream and the "
        "norms in fp32, closer logits; all-gathers move fp32, 2x the bytes (also on CPU). See docs/benchmarks.md.",
    )
    compile: bool = opt(
        False, "torch.compile each prelude/coda block and the whole core iteration (the loop stays eager)."
    )
    loss_chunk_tokens: int = opt(
        1024,
        "Compute the head matmul and the loss this many tokens at a time, recomputed in backward, so the "
        "full (tokens x vocab) logits are never held (4 GiB fp32 at vocab 128k and 8k tokens); 0 = unchunked.",
    )
    ac_mode: ACMode = opt(
        "per_iteration",
        "Activation checkpointing: 'full' = every block incl. each core iteration; 'per_iteration' = "
        "each grad-carrying core iteration plus prelude/coda blocks; 'none' = off.",
    )
    skip_nonfinite: bool = opt(
        False, "Skip optimizer steps whose loss or grad norm is not finite (or is a loss spike); else stop."
    )
    max_skipped_steps: int = opt(10, "Abort the run once more than this many steps were skipped.")
    loss_spike_factor: float = opt(
        0.0,
        "Treat a step whose loss exceeds this multiple of the median loss of the previous loss_spike_window "
        "steps like a non-finite one (not applied; skipped or stopped, see skip_nonfinite); 0 = off.",
    )
    loss_spike_window: int = opt(50, "Steps of loss history the spike guard takes the median of (it acts once full).")
    step_timeout_s: float = opt(
        300.0,
        "End the job (exit 4) with one line when a step, with the validation and checkpoint save at its end, "
        "takes longer than this on any rank; the first step of a launch gets 3x (compilation); 0 = off.",
    )
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "'auto' = cuda when available, else cpu.")


@dataclass
class Recurrence:
    """Sampling of the number of core iterations per step, and truncated backprop through them."""

    mean_recurrence: int = opt(32, "R_max: the target mean iteration count the curriculum reaches.")
    backprop_depth: int = opt(DEFAULT_BACKPROP_DEPTH, "Number of final core iterations that carry gradients.")
    curriculum: MeanCurriculum = opt(
        "1-sqrt", "Shape of the ramp of the mean recurrence from start to mean_recurrence."
    )
    warmup_fraction: float = opt(0.75, "Fraction of training steps over which the mean recurrence ramps up.")
    start: int = opt(1, "Mean recurrence at step 0 of the curriculum.")
    sigma: float = opt(DEFAULT_SIGMA, "Std of the log-normal Poisson sampler of iteration counts.")
    seed: int = opt(DEFAULT_SEED, "Seed of the iteration-count sampler (identical on every rank).")
    mean_offset: bool = opt(True, "Offset the sampler so that E[n + k] = r + 1, as the reference does.")
    backprop_curriculum: bool = opt(False, "Ramp backprop_depth up from backprop_start too.")
    backprop_curriculum_kind: BackpropCurriculum = opt(
        "interpolate",
        "Backprop-depth ramp, read at update u (1-based) over W = backprop_warmup_fraction * steps: "
        "'interpolate' = ceil(start + (backprop_depth - start) u / W), the reference's (from 2 at u = 1 "
        "with start 1); 'linear' = max(start, ceil(backprop_depth u / W)).",
    )
    backprop_start: int = opt(1, "Backprop depth the ramp starts from (update 0) when backprop_curriculum is on.")
    backprop_warmup_fraction: float = opt(0.25, "Fraction of steps over which the backprop depth ramps up.")


@dataclass
class Optimizer:
    """Muon for the 2-D block and adapter matrices, AdamW for the rest (or AdamW everywhere)."""

    name: Literal["muon", "adamw"] = opt(
        "muon", "'muon': Muon for block+adapter matrices, AdamW for the rest; 'adamw': AdamW everywhere."
    )
    lr: float = opt(1e-3, "Muon learning rate.")
    momentum: float = opt(0.95, "Muon momentum.")
    nesterov: bool = opt(True, "Use Nesterov momentum in Muon.")
    ns_steps: int = opt(5, "Newton-Schulz iterations of Muon's orthogonalisation.")
    ns_dtype: NSDtype = opt(
        "auto",
        "Dtype of Newton-Schulz: 'auto' = bfloat16 on GPUs (torch.optim.Muon's and the reference's), float32 on "
        "CPU (a bf16 matmul without AVX512-BF16/AMX runs ~50x slower there).",
    )
    weight_decay: float = opt(1e-4, "Muon decoupled weight decay.")
    fuse_qkv: bool = opt(
        False,
        "Orthogonalise q,k,v as one matrix and gate+up as one, like the reference's recurrent models (its "
        "static baselines keep HF's separate matrices: false).",
    )
    adamw_lr: float = opt(5e-5, "AdamW learning rate.")
    adamw_betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas.")
    adamw_eps: float = opt(1e-10, "AdamW epsilon; 1e-10 is the reference's (its Muon package's aux-Adam default).")
    adamw_weight_decay: float = opt(1e-4, "AdamW decoupled weight decay.")


@dataclass
class LRScheduler:
    """Warmup, constant, then decay (warmup-stable-decay)."""

    warmup_fraction: float = opt(0.005, "Fraction of steps of linear warmup.")
    decay_fraction: float = opt(0.75, "Fraction of steps at the end that decay the learning rate.")
    decay_type: DecayType = opt("cosine", "Shape of the decay.")
    min_lr_factor: float = opt(0.001, "Warmup starts at and decay ends at min_lr_factor * lr.")


@dataclass
class Parallel:
    """Data-parallel mesh: HSDP replicas x FSDP shards."""

    dp_replicate: int = opt(1, "Number of HSDP replicas.")
    dp_shard: int = opt(-1, "FSDP shard group size; -1 = the rest of the world.")
    timeout_s: float = opt(
        600.0,
        "Process-group timeout: a collective (a step's reduction, a checkpoint save, validation) waiting longer "
        "than this for another rank fails, and the job exits 4 (torch's default is 30 min).",
    )


@dataclass
class Checkpoint:
    """Distributed checkpoints for resume, and the final export."""

    enable: bool = opt(True, "Save checkpoints.")
    folder: str = opt("checkpoints", "Checkpoint folder under job.dump_folder.")
    interval: int = opt(500, "Save every this many steps.")
    keep_latest_k: int = opt(3, "Keep only the latest k checkpoints; 0 = keep all.")
    load_step: int = opt(-1, "Step to resume from; -1 = the latest complete checkpoint.")
    initial_load_path: str | None = opt(None, "Checkpoint to start from when the run has none of its own.")
    async_mode: Literal["disabled", "async"] = opt("disabled", "Save checkpoints in the background.")
    export_final: bool = opt(True, "Export the final model when training ends.")
    verify: bool = opt(
        True,
        "Check every file of the checkpoint to resume from against the checksums of its manifest.json; false "
        "checks sizes only (and loads a checkpoint without a manifest).",
    )
    fallback_on_corruption: bool = opt(
        False,
        "When the latest checkpoint fails verification, resume from the newest one that passes (the corrupt "
        "ones are moved to abandoned/); false stops with an error naming it.",
    )
    allow_changes: list[AllowedChange] = opt(
        [],
        "Settings that may differ from the checkpoint's on resume (steps, seq_len, global_batch_size, recurrence, "
        "data); any other change is refused. docs/checkpointing.md says what each change does.",
    )


@dataclass
class DataSource:
    """One dataset in the training mixture."""

    name: str = opt("", "Label for logs.")
    path: str = opt("", "Local file or glob, or a Hugging Face hub dataset id.")
    kind: SourceKind = opt("text", "Format of the source.")
    text_field: str = opt("text", "Column or key holding the text.")
    hf_config: str | None = opt(None, "Hugging Face dataset config name.")
    revision: str | None = opt(None, "kind 'hf' only: the dataset's git revision (branch, tag or commit); none = main.")
    data_files: list[str] = opt(
        [], "kind 'hf' only: files (or globs) of the dataset to read, relative to it; none = the config's files."
    )
    split: str = opt("train", "Dataset split.")
    weight: float = opt(1.0, "Relative sampling weight in the mixture.")
    format: DataFormat = opt(
        "text",
        "'text': documents (text_field), loss on every token. 'prompt_completion': records of a prompt and a "
        "completion (kinds jsonl, parquet, hf), packed as [BOS] prompt completion EOS with the loss on the "
        "completion and EOS only (the prompt's tokens get the ignore label), as in SFT.",
    )
    prompt_field: str = opt("prompt", "format 'prompt_completion': the field holding the prompt (no loss).")
    completion_field: str = opt("completion", "format 'prompt_completion': the field holding the completion.")
    sample_by: SampleBy = opt(
        "paragraph",
        "kind 'text' only: one document per blank-line-separated paragraph, per file, or per line.",
    )
    shuffle_buffer: int = opt(
        0,
        "Documents (pre-tokenized: rows) read at a time and shuffled by a permutation seeded by job.seed, the "
        "source, the reader and the position (exact on resume); 0 reads the source in file order.",
    )


@dataclass
class DataPhase:
    """A mixture that takes over from start_step on."""

    start_step: int = opt(0, "First step of this phase.")
    sources: list[DataSource] = opt([], "The mixture of this phase.")


@dataclass
class Data:
    """Training data sources and tokenizer."""

    sources: list[DataSource] = opt([], "Training mixture.")
    phases: list[DataPhase] = opt([], "Mixtures that take over during training.")
    tokenizer: str | None = opt(None, "Folder with tokenizer files; none = model.path.")
    num_workers: int = opt(0, "DataLoader worker processes per rank.")
    validation_fraction: float = opt(
        0.0,
        "Fraction of the documents held out for validation, by content hash: the validation split is the "
        "documents of the final mixture whose hash falls below it, so each held-out document costs reading "
        "about 1 / fraction documents (1,000 at 0.001).",
    )
    validation_sources: list[DataSource] = opt(
        [],
        "A validation split of its own (a file, or a hub split such as split = 'validation'), read whole "
        "instead of the hash split: no reading cost beyond its own documents; set validation_fraction = 0.",
    )
    reshard: Literal["error", "restart"] = opt(
        "error",
        "Resuming with another data geometry (dp ranks, workers, batch): 'error' refuses; 'restart' "
        "restarts every source at a new epoch from the resumed step (the position cannot be resharded).",
    )


@dataclass
class Validation:
    """Periodic held-out loss at several recurrences."""

    enable: bool = opt(False, "Run validation.")
    interval: int = opt(500, "Validate every this many steps.")
    steps: int = opt(10, "Batches per validation.")
    recurrences: list[int] = opt([1, 2, 4, 8, 16, 32], "Iteration counts to evaluate at.")


@dataclass
class Metrics:
    """Logging of loss, throughput and MFU."""

    log_freq: int = opt(10, "Log every this many steps.")
    enable_tensorboard: bool = opt(True, "Write TensorBoard event files.")
    peak_flops: float | None = opt(
        None, "Per-device peak FLOP/s for MFU; none = look up the device (MFU is null on CPU unless given)."
    )
    jsonl: bool = opt(True, "Write metrics as JSON lines.")
    enable_wandb: bool = opt(
        False,
        "Also log every record to Weights & Biases (pip install 'titan_recur[wandb]'). The run id is kept in "
        "<dump_folder>/wandb_run_id, so a resumed run continues the same W&B run.",
    )
    wandb_project: str = opt("titan_recur", "W&B project.")
    wandb_entity: str | None = opt(None, "W&B entity (user or team); none = your default entity.")
    wandb_run_name: str | None = opt(None, "W&B run name; none = the dump folder's name.")
    wandb_tags: list[str] = opt([], "W&B run tags.")
    wandb_mode: Literal["online", "offline"] | None = opt(
        None,
        "'offline' writes the run under <dump_folder>/wandb only (upload later with `wandb sync`); "
        "none = wandb's default (the WANDB_MODE environment variable, else online).",
    )


@dataclass
class Profiling:
    """torch.profiler traces and memory snapshots of chosen steps, under the dump folder (docs/benchmarks.md)."""

    trace_steps: list[int] = opt(
        [],
        "Steps to trace with torch.profiler (CPU and CUDA operators, shapes; forward, backward and optimizer "
        "labelled): one Chrome/Perfetto trace per rank in job.dump_folder/save_folder/step-N/; [] = off.",
    )
    memory_snapshot: bool = opt(
        False,
        "With each trace, its memory: the CUDA allocator's snapshot (a pickle for pytorch.org/memory_viz) on "
        "GPU, a table of the operators by CPU memory allocated on CPU.",
    )
    save_folder: str = opt(
        "profile", "Folder for the traces, relative to job.dump_folder; never the checkpoint folder or final_model/."
    )


@dataclass
class Debug:
    """Fault injection, to exercise the trainer's guards end to end (tests and drills, not training)."""

    inject_nan_at_step: int = opt(0, "Make the loss of this step NaN (the non-finite guard); 0 = off.")
    inject_spike_at_step: int = opt(0, "Multiply the loss of this step by 1000 (the loss-spike guard); 0 = off.")


@dataclass
class JobConfig:
    """Everything a training run needs; one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    recurrence: Recurrence = field(default_factory=Recurrence)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallel: Parallel = field(default_factory=Parallel)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)


# ---------------------------------------------------------------------------------------------
# Types


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    if get_origin(tp) in (Union, types.UnionType):
        args = get_args(tp)
        if len(args) == 2 and type(None) in args:
            return next(a for a in args if a is not type(None)), True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _strip_optional(tp)
    if optional:
        return f"{_type_name(inner)} | None"
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list and dataclasses.is_dataclass(args[0]):
        return "array of tables"
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if dataclasses.is_dataclass(tp):
        return "table"
    return tp.__name__


def _is_table_list(tp: Any) -> bool:
    return get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0])


def _suggest(name: str, choices: Sequence[str]) -> str | None:
    """Closest spelling, else a choice that ends with the name (``steps`` -> ``training.steps``)."""
    close = difflib.get_close_matches(name, choices, n=1)
    return close[0] if close else next((c for c in choices if c.endswith("." + name)), None)


# ---------------------------------------------------------------------------------------------
# Values from TOML / JSON / dicts


def _render(path: tuple[str | int, ...]) -> str:
    """("data", "phases", 1, "sources", 0) -> "[data.phases][1].sources[0]"."""
    n = next((i for i, p in enumerate(path) if isinstance(p, int)), len(path))
    out = f"[{'.'.join(cast('tuple[str, ...]', path[:n]))}]"  # the keys before the first index
    for p in path[n:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _where(path: tuple[str | int, ...]) -> str:
    """Location of a value: "[training] steps", "[validation.recurrences][2]", "[training]"."""
    if len(path) >= 2 and isinstance(path[-1], str):
        return f"{_render(path[:-1])} {path[-1]}"
    return _render(path)


def _from_value(value: Any, tp: Any, source: str, path: tuple[str | int, ...]) -> Any:
    """Check a parsed TOML/JSON value against ``tp``, converting arrays to lists/tuples/dataclasses."""
    inner, optional = _strip_optional(tp)
    origin, args = get_origin(inner), get_args(inner)
    if optional and value is None:
        return None
    if dataclasses.is_dataclass(inner) and isinstance(value, dict):
        return _build(cast(type, inner), value, source, path)  # a type hint: a dataclass type
    if origin is list and isinstance(value, (list, tuple)):
        return [_from_value(v, args[0], source, path + (i,)) for i, v in enumerate(value)]
    if origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        return tuple(_from_value(v, t, source, path + (i,)) for i, (v, t) in enumerate(zip(value, args, strict=True)))
    if origin is Literal and any(type(value) is type(a) and value == a for a in args):
        return value
    if inner is float and type(value) in (int, float):
        return float(value)
    if inner in (int, str, bool) and type(value) is inner:
        return value
    raise ConfigError(f"{source}: {_where(path)} expects {_type_name(tp)}, got {value!r}")


def _build(cls: type, values: dict[str, Any], source: str, path: tuple[str | int, ...]) -> Any:
    hints = _hints(cls)
    for key in values:
        if key not in hints:
            hint = _suggest(key, list(hints))
            what = f"unknown section {key!r}" if not path else f"{_render(path)} unknown key {key!r}"
            raise ConfigError(f"{source}: {what}" + (f" (did you mean {hint!r}?)" if hint else ""))
    return cls(**{k: _from_value(v, hints[k], source, path + (k,)) for k, v in values.items()})


def config_from_dict(values: dict[str, Any], source: str = "dict") -> JobConfig:
    """JobConfig from nested dicts (parsed TOML, a saved ``config_to_dict``); no cross-field checks."""
    return _build(JobConfig, values, source, ())


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain JSON-able nested dict (tuples become lists) for saving the resolved config with a run."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_to_json(cfg: JobConfig) -> str:
    """The resolved config as the run saves it (config.json) and ``--print-config`` shows it; ``--config`` reads it."""
    return json.dumps(config_to_dict(cfg), indent=2) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line


class _Entry:
    """The type of ``--ARRAY.N`` (an entry of an array of tables): its one value, none, drops the entry."""


_DROP = object()  # the parsed value of ``--ARRAY.N none``


def _options() -> dict[str, Any]:
    """``"section.key"`` -> type, for every settable option."""
    return {f"{section}.{key}": tp for section, cls in _hints(JobConfig).items() for key, tp in _hints(cls).items()}


def _from_text(text: str, tp: Any) -> Any:
    """Parse a command-line string as ``tp``; raises ValueError when it doesn't fit."""
    inner, optional = _strip_optional(tp)
    origin, args = get_origin(inner), get_args(inner)
    if optional and text.lower() == "none":
        return None
    if origin is list:
        return [_from_text(t.strip(), args[0]) for t in text.split(",")] if text.strip() else []
    if origin is tuple:
        parts = text.split(",")
        if len(parts) != len(args):
            raise ValueError(text)
        return tuple(_from_text(p.strip(), t) for p, t in zip(parts, args, strict=True))
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ValueError(text)
    if inner is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(text)
        return text.lower() in _TRUE
    if inner in (int, float, str):
        return inner(text)
    raise ValueError(text)


def _unknown_option(name: str, choices: Sequence[str]) -> ConfigError:
    hint = _suggest(name, choices)
    return ConfigError(f"{_CLI}: unknown option --{name}" + (f" (did you mean --{hint}?)" if hint else ""))


def _option_type(name: str, options: dict[str, Any]) -> Any:
    """Type of ``section.key``, or of a field inside arrays of tables: ``data.phases.1.sources.0.path``."""
    parts = name.split(".")
    head = ".".join(parts[:2])
    if head not in options:
        raise _unknown_option(name, list(options))
    tp, prefix, rest = options[head], head, parts[2:]
    while rest:
        if not _is_table_list(tp):
            raise _unknown_option(name, list(options))
        index, *rest = rest
        if not index.isdigit():
            raise ConfigError(f"{_CLI}: --{name}: expected an entry number after --{prefix}, got {index!r}")
        prefix += f".{index}"
        if not rest:
            return _Entry
        cls = get_args(tp)[0]
        key, *rest = rest
        if key not in _hints(cls):
            raise _unknown_option(name, [f"{prefix}.{k}" for k in _hints(cls)])
        tp, prefix = _hints(cls)[key], f"{prefix}.{key}"
    return tp


def _assign(cfg: JobConfig, name: str, value: Any) -> None:
    """Set option ``name`` (see _option_type); entry number len(array) appends a table of defaults.

    ``value`` _DROP removes the entry ``name`` names; the entries after it move up by one.
    """
    parts = name.split(".")
    obj = getattr(cfg, parts[0])
    for depth, (key, index) in enumerate(
        zip(parts[1::2], map(int, parts[2::2]), strict=False)
    ):  # the last key has no index
        entries = getattr(obj, key)
        array = ".".join(parts[: 2 * depth + 2])
        if value is _DROP and 2 * depth + 3 == len(parts):
            if index >= len(entries):
                numbers = f" (0..{len(entries) - 1})" if entries else ""
                raise ConfigError(f"{_CLI}: --{name}: {array} has {len(entries)} entries{numbers}; nothing to drop")
            del entries[index]
            return
        if index > len(entries):
            raise ConfigError(
                f"{_CLI}: --{name}: {array} has {len(entries)} entries; use an entry number up to "
                f"{len(entries)} (that one appends a new entry)"
            )
        if index == len(entries):
            table: type = type(obj)
            entries.append(get_args(_hints(table)[key])[0]())
        obj = entries[index]
    setattr(obj, parts[-1], value)


def _parse_overrides(argv: Sequence[str]) -> list[tuple[str, Any]]:
    """``--a.b v`` / ``--a.b=v`` tokens -> [("a.b", value)]; a bare boolean flag means true.

    Fields inside arrays of tables take the entry number: ``--data.sources.0.path v``.
    """
    options, out, i = _options(), [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"{_CLI}: unexpected argument {token!r} (options are --section.key value)")
        name, eq, text = token[2:].partition("=")
        tp = _option_type(name, options)
        if _is_table_list(tp):
            raise ConfigError(
                f"{_CLI}: --{name} is an array of tables; set a field of entry N as --{name}.N.key "
                f"(e.g. --{name}.0.path) or [[{name}]] in the config file"
            )
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if tp is bool and (nxt is None or nxt.startswith("--")):
                text = "true"
            elif nxt is None:
                what = "none, to drop the entry" if tp is _Entry else _type_name(tp)
                raise ConfigError(f"{_CLI}: --{name} needs a value ({what})")
            else:
                text, i = nxt, i + 1
        if tp is _Entry:
            if text.lower() != "none":
                array = name.rpartition(".")[0]
                raise ConfigError(
                    f"{_CLI}: --{name} is an entry of {array}; the only value it takes is none (drop it); "
                    f"set its fields as --{name}.key"
                )
            out.append((name, _DROP))
            i += 1
            continue
        try:
            out.append((name, _from_text(text, tp)))
        except ValueError:
            raise ConfigError(f"{_CLI}: --{name} expects {_type_name(tp)}, got {text!r}") from None
        i += 1
    return out


def _split_config_arg(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Pull ``--config FILE`` / ``--config=FILE`` out of argv; the rest are overrides."""
    path, rest, i = None, [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--config" or token.startswith("--config="):
            if path is not None:
                raise ConfigError(f"{_CLI}: --config given more than once")
            if token == "--config":
                if i + 1 >= len(argv):
                    raise ConfigError(f"{_CLI}: --config needs a file")
                i += 1
                path = argv[i]
            else:
                path = token.partition("=")[2]
        else:
            rest.append(token)
        i += 1
    return path, rest


def _field_help(cls: type, table: str, indent: str, cli: bool) -> list[str]:
    """Help lines for each field of ``cls`` (the TOML table ``table``); arrays of tables are file-only."""
    lines, defaults, pad = [], cls(), indent + "    "
    for f in dataclasses.fields(cls):
        tp, default, doc = _hints(cls)[f.name], getattr(defaults, f.name), f.metadata["help"]
        if _is_table_list(tp):
            lines.append(f"{indent}[[{table}.{f.name}]] (array of tables; default {default!r})")
            doc += " Each table has:"
        else:
            name = f"--{table}.{f.name}" if cli else f.name
            lines.append(f"{indent}{name} ({_type_name(tp)}; default {default!r})")
        lines.append(textwrap.fill(doc, 100, initial_indent=pad, subsequent_indent=pad))
        if _is_table_list(tp):
            lines += _field_help(get_args(tp)[0], f"{table}.{f.name}", indent + "      ", cli=False)
    return lines


def format_help(prog: str = "train") -> str:
    """Every option, grouped by section, with its doc, type and default."""
    lines = [
        f"usage: {prog} [--config FILE] [--section.key VALUE | --section.key=VALUE ...]",
        f"       {prog} --config FILE --check [--world-size N] [--assume-mfu F] [--gpu NAME] [overrides ...]",
        "",
        "Defaults < config file < command line. Lists are comma-separated (1,2,4); 'none' sets an",
        "optional value to None; booleans take true/false/1/0/yes/no, and a bare flag means true.",
        "A field of an array of tables takes the entry number: --data.sources.0.path FILE (the next",
        "number appends an entry); --data.sources.1 none drops entry 1 (one the config inherited, say),",
        "and the entries after it move up by one for the overrides that follow.",
        "",
        "  --config FILE",
        '      TOML job config (or a saved config.json). A file may start with extends = "base.toml" (or a',
        "      list of files, relative to it): its tables merge over theirs, arrays replace theirs.",
        "  --print-config",
        "      Print the resolved config (defaults < file < command line, values checked) as JSON and",
        "      exit, before any model, tokenizer or data file is opened; --config reads the output back.",
        "  -h, --help",
        "      Show this help and exit.",
        "",
        "Preflight, before you queue: --check opens the model folder, the tokenizer and every data source,",
        "checks the batch geometry for --world-size N ranks (default: torchrun's WORLD_SIZE, else 1) and",
        "prints the plan (parameters, tokens, steps, training FLOPs, memory per GPU, time at --assume-mfu",
        "F of --gpu NAME's peak, e.g. h100), then exits: 0 when every check passed, 2 otherwise. No",
        "accelerator, process group or file write is needed.",
    ]
    for section, cls in _hints(JobConfig).items():
        lines += ["", f"[{section}] {cls.__doc__}"]
        lines += _field_help(cls, section, "  ", cli=True)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Cross-field checks

_AT_LEAST = {
    "training.steps": 1,
    "training.local_batch_size": 1,
    "training.seq_len": 1,
    "training.max_skipped_steps": 0,
    "training.loss_spike_window": 3,
    "training.step_timeout_s": 0,
    "debug.inject_nan_at_step": 0,
    "debug.inject_spike_at_step": 0,
    "training.loss_chunk_tokens": 0,
    "recurrence.start": 1,
    "recurrence.backprop_depth": 1,
    "recurrence.backprop_start": 1,
    "recurrence.sigma": 0,
    "optimizer.ns_steps": 1,
    "optimizer.weight_decay": 0,
    "optimizer.adamw_weight_decay": 0,
    "parallel.dp_replicate": 1,
    "checkpoint.interval": 1,
    "checkpoint.keep_latest_k": 0,
    "checkpoint.load_step": -1,
    "data.num_workers": 0,
    "validation.interval": 1,
    "validation.steps": 1,
    "metrics.log_freq": 1,
}
_POSITIVE = ("training.max_norm", "optimizer.lr", "optimizer.adamw_lr", "optimizer.adamw_eps", "parallel.timeout_s")
_FRACTIONS = (
    "recurrence.warmup_fraction",
    "recurrence.backprop_warmup_fraction",
    "lr_scheduler.warmup_fraction",
    "lr_scheduler.decay_fraction",
    "lr_scheduler.min_lr_factor",
)


def _get(cfg: JobConfig, name: str) -> Any:
    section, key = name.split(".")
    return getattr(getattr(cfg, section), key)


def _require(ok: Any, message: str) -> None:
    if not ok:
        raise ConfigError(f"invalid config: {message}")


_ARCHITECTURE = ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size")


def _validate_model(m: Model) -> None:
    if any(getattr(m, f) is not None for f in (*_ARCHITECTURE, "n_kv_heads")):
        return _validate_architecture(m)
    _require(
        m.path or m.preset,
        "set model.path (a converted model folder), model.preset, or an architecture "
        "to train from scratch (model.dim, n_layers, n_heads, ffn_dim, vocab_size)",
    )
    if not m.preset:
        _require(not m.shape, "model.shape only applies with model.preset")
        return
    hint = _suggest(m.preset, list(PRESETS))
    known = f" (did you mean {hint!r}?)" if hint else f"; known: {', '.join(PRESETS)}"
    _require(m.preset in PRESETS, f"unknown model.preset {m.preset!r}{known}")
    try:
        PRESETS[m.preset].check_shape(m.shape, m.preset)
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    if not m.path:
        _require(m.init == "random", "model.preset has no weights: set model.init = 'random' (or use model.path)")


def _validate_architecture(m: Model) -> None:
    """An architecture of its own, from scratch: complete, consistent, and not mixed with a folder or preset."""
    _require(
        not m.path and not m.preset,
        "model.dim, n_layers, ... describe a model trained from scratch: "
        "drop model.path and model.preset (or drop the architecture fields)",
    )
    missing = [f"model.{f}" for f in _ARCHITECTURE if getattr(m, f) is None]
    _require(not missing, f"training from scratch needs {', '.join(missing)} too")
    _require(m.init == "random", "a model trained from scratch has no weights: set model.init = 'random'")
    for f in (*_ARCHITECTURE, "n_kv_heads"):
        value = getattr(m, f)
        _require(value is None or value >= 1, f"model.{f} must be >= 1, got {value}")
    assert m.dim is not None and m.n_heads is not None  # required above
    _require(m.dim % m.n_heads == 0, f"model.dim ({m.dim}) must be a multiple of model.n_heads ({m.n_heads})")
    kv = m.n_kv_heads or m.n_heads
    _require(m.n_heads % kv == 0, f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({kv})")
    _require(
        not m.shape or (len(m.shape) == 3 and min(m.shape) >= 0 and sum(m.shape) == m.n_layers),
        f"model.shape must be P,R,C counts summing to model.n_layers ({m.n_layers}), got {m.shape}",
    )


def _validate_data(d: Data) -> None:
    _require(
        0 <= d.validation_fraction < 1,
        f"data.validation_fraction must be in [0, 1), got {d.validation_fraction}",
    )
    starts = [p.start_step for p in d.phases]
    _require(starts == sorted(set(starts)), f"data.phases start_steps must be increasing, got {starts}")
    sources = [(f"[data.sources][{i}]", s) for i, s in enumerate(d.sources)]
    for j, phase in enumerate(d.phases):
        _require(phase.sources, f"[data.phases][{j}] has no sources")
        sources += [(f"[data.phases][{j}].sources[{i}]", s) for i, s in enumerate(phase.sources)]
    _require(
        not (d.validation_sources and d.validation_fraction > 0),
        "[[data.validation_sources]] are the validation split: set data.validation_fraction = 0 (a hash split "
        "would also hold documents out of training)",
    )
    sources += [(f"[data.validation_sources][{i}]", s) for i, s in enumerate(d.validation_sources)]
    for where, s in sources:
        _require(s.path, f"{where} needs a path")
        _require(s.weight > 0, f"{where} weight must be > 0, got {s.weight}")
        _require(s.shuffle_buffer >= 0, f"{where} shuffle_buffer must be >= 0, got {s.shuffle_buffer}")
        _require(
            s.format == "text" or s.kind in RECORD_SOURCE_KINDS,
            f"{where} format 'prompt_completion' needs records with fields: kind jsonl, parquet or hf, not {s.kind!r}",
        )
        _require(
            s.kind == "hf" or (s.revision is None and not s.data_files),
            f"{where} revision and data_files are for kind = 'hf' (a local {s.kind} source is its path)",
        )


def _validate_profiling(cfg: JobConfig) -> None:
    p, steps = cfg.profiling, cfg.training.steps
    for step in p.trace_steps:
        _require(1 <= step <= steps, f"profiling.trace_steps must be in 1..training.steps ({steps}), got {step}")
    _require(
        not p.memory_snapshot or p.trace_steps,
        "profiling.memory_snapshot is written with a trace: set profiling.trace_steps (the steps to record)",
    )
    dump = Path(os.path.abspath(cfg.job.dump_folder))
    traces = Path(os.path.normpath(dump / p.save_folder))
    checkpoints = Path(os.path.normpath(dump / cfg.checkpoint.folder))
    for folder, what in ((checkpoints, "the checkpoint folder"), (dump / FINAL_MODEL_FOLDER, "the final model folder")):
        _require(
            not _writes_into(traces, folder, dump),
            f"profiling.save_folder {p.save_folder!r} would write into {what} ({folder}): its step-N trace folders "
            "would mix with what the run saves there; choose a folder beside them (default 'profile')",
        )


def _writes_into(traces: Path, folder: Path, dump: Path) -> bool:
    """Traces at or under ``folder``; a checkpoint folder that is the dump folder itself owns only its step-N."""
    if traces == folder:
        return True
    if folder not in traces.parents:
        return False
    return folder != dump or traces.relative_to(dump).parts[0].startswith("step-")


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that types can't express; file existence is left to the trainer."""
    for name, low in _AT_LEAST.items():
        _require(_get(cfg, name) >= low, f"{name} must be >= {low}, got {_get(cfg, name)}")
    for name in _POSITIVE:
        _require(_get(cfg, name) > 0, f"{name} must be > 0, got {_get(cfg, name)}")
    for name in _FRACTIONS:
        _require(0 <= _get(cfg, name) <= 1, f"{name} must be in [0, 1], got {_get(cfg, name)}")
    t, r, o, s = cfg.training, cfg.recurrence, cfg.optimizer, cfg.lr_scheduler
    try:
        grad_accum_steps(t, dp_world=None)
    except ConfigError as err:
        raise ConfigError(f"invalid config: {err}") from None
    _require(
        r.mean_recurrence >= r.start,
        f"recurrence.mean_recurrence ({r.mean_recurrence}) must be >= recurrence.start ({r.start})",
    )
    _require(
        r.backprop_start <= r.backprop_depth,
        f"recurrence.backprop_start ({r.backprop_start}) must be <= backprop_depth ({r.backprop_depth})",
    )
    _require(0 <= o.momentum < 1, f"optimizer.momentum must be in [0, 1), got {o.momentum}")
    _require(
        not cfg.validation.enable or cfg.data.validation_fraction > 0 or cfg.data.validation_sources,
        "validation.enable needs data.validation_fraction > 0 or [[data.validation_sources]] (held-out "
        "documents to validate on)",
    )
    betas = o.adamw_betas
    _require(all(0 <= b < 1 for b in betas), f"optimizer.adamw_betas must be in [0, 1), got {betas}")
    _require(
        s.warmup_fraction + s.decay_fraction <= 1,
        f"lr_scheduler.warmup_fraction + decay_fraction must be <= 1, got {s.warmup_fraction} + {s.decay_fraction}",
    )
    dp_shard = cfg.parallel.dp_shard
    _require(dp_shard == -1 or dp_shard >= 1, f"parallel.dp_shard must be -1 or >= 1, got {dp_shard}")
    spike = t.loss_spike_factor
    _require(spike == 0 or spike > 1, f"training.loss_spike_factor must be 0 (off) or > 1, got {spike}")
    recurrences = cfg.validation.recurrences
    _require(all(n >= 1 for n in recurrences), f"validation.recurrences must all be >= 1, got {recurrences}")
    # Beyond the bound a step would run until the watchdog called it a stall.
    for name, values in (("recurrence.mean_recurrence", [r.mean_recurrence]), ("validation.recurrences", recurrences)):
        bad = [n for n in values if n > MAX_RECURRENCE]
        _require(
            not bad,
            f"{name} {bad[0] if bad else 0} is outside [1, {MAX_RECURRENCE}] (the core iterations a run accepts)",
        )
    peak = cfg.metrics.peak_flops
    _require(peak is None or peak > 0, f"metrics.peak_flops must be > 0, got {peak}")
    _validate_profiling(cfg)
    _validate_model(cfg.model)
    _validate_data(cfg.data)


def grad_accum_steps(t: Training, dp_world: int | None) -> int:
    """Micro-steps per optimizer step: global_batch_size / (local_batch_size x dp ranks).

    ``dp_world=None`` checks only what holds for every world size (a multiple of local_batch_size).
    """
    per_micro_step = t.local_batch_size * (dp_world or 1)
    global_batch = t.global_batch_size or per_micro_step
    if global_batch < 1 or global_batch % per_micro_step:
        divisor = f"local_batch_size ({t.local_batch_size})"
        if dp_world:
            divisor = f"local_batch_size x data-parallel ranks ({t.local_batch_size} x {dp_world} = {per_micro_step})"
        raise ConfigError(f"training.global_batch_size ({global_batch}) must be a multiple of {divisor}")
    return global_batch // per_micro_step


# ---------------------------------------------------------------------------------------------
# Entry points


def _read_file(path: str) -> dict[str, Any]:
    """Parse a TOML file, or JSON when it ends in .json (a run's saved resolved config)."""
    try:
        with open(path, "rb") as f:
            return json.load(f) if path.endswith(".json") else tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; every other value (arrays and arrays of tables too) replaces the base's."""
    merged = dict(base)
    for key, value in over.items():
        both_tables = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if both_tables else value
    return merged


def read_config_file(path: str, _chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config file's values over those of the files it ``extends`` (in order, later ones win).

    ``extends = "base.toml"`` or a list, relative to the file. Each file is type-checked on its own
    first, so an error names the file that has the bad key.
    """
    values = _read_file(path)
    parents = values.pop("extends", [])
    parents = [parents] if isinstance(parents, str) else parents
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: extends expects a file name or a list of file names, got {parents!r}")
    config_from_dict(values, source=path)
    chain, merged = _chain + (os.path.realpath(path),), dict[str, Any]()
    for parent in parents:
        parent_path = os.path.join(os.path.dirname(path), parent)
        if os.path.realpath(parent_path) in chain:
            raise ConfigError(f"{path}: extends {parent!r}, which extends {path} again (a cycle)")
        if not os.path.isfile(parent_path):
            raise ConfigError(f"{path}: extends {parent!r}, but {parent_path} is not a file")
        merged = _merge(merged, read_config_file(parent_path, chain))
    return _merge(merged, values)


def load_config(path: str | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the file at ``path`` (if any), then ``--section.key value`` overrides; validated."""
    path = find_config(path) if path else path
    cfg = config_from_dict(read_config_file(path), source=path) if path else JobConfig()
    for name, value in _parse_overrides(overrides):
        _assign(cfg, name, value)
    validate(cfg)
    return cfg


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """The trainer's command line: ``[--config FILE] [--section.key value ...]``; ``--help`` and ``--print-config`` exit 0."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(format_help(os.path.basename(sys.argv[0]) or "train"))
        raise SystemExit(0)
    path, overrides = _split_config_arg(argv)
    if "--print-config" in overrides:
        print(config_to_json(load_config(path, [a for a in overrides if a != "--print-config"])), end="")
        raise SystemExit(0)
    return load_config(path, overrides)
