"""The schema of a run: one dataclass per TOML section, the Literal types and the choice lists derived from them."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from titan_recur.models.args import (
    DEFAULT_BACKPROP_DEPTH,
    DEFAULT_SEED,
    DEFAULT_SIGMA,
    BackpropCurriculum,
    MeanCurriculum,
)

# Activation checkpointing modes of the parallelize recipe (their FLOP cost is in titan_recur.training.cost_model).
ACMode = Literal["none", "full", "per_iteration"]
AC_MODES: tuple[str, ...] = get_args(ACMode)
# Fingerprint fields whose change on resume is safe by design (titan_recur.training.fingerprint; docs/checkpointing.md).
AllowedChange = Literal["steps", "seq_len", "global_batch_size", "recurrence", "data", "attention_mask"]
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
# Which earlier tokens a token attends to: the whole packed row, or only its own document (titan_recur.models.model).
AttentionMask = Literal["causal", "document"]
ATTENTION_MASKS: tuple[str, ...] = get_args(AttentionMask)
# The learning rate's decay (titan_recur.training.optim).
DecayType = Literal["cosine", "linear"]
DECAY_TYPES: tuple[str, ...] = get_args(DecayType)

# The run's model export at the end of training, under job.dump_folder.
FINAL_MODEL_FOLDER = "final_model"


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
    attention_mask: AttentionMask = opt(
        "causal",
        "'causal': a token attends to every earlier token of its packed row, across document boundaries. "
        "'document': only to its own document's (each ends with EOS), with RoPE positions restarting at each "
        "document, as torchtitan's block_causal; also in validation and eval loss. See docs/training.md.",
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
        "profile",
        "Folder for the traces, relative to job.dump_folder and inside it; never the checkpoint folder or "
        "final_model/.",
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
