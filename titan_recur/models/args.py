"""Model shape and behaviour of a depth-recurrent LM (docs/method.md §1), plus source-model presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from titan_recur.models.families import family_named

STATE_INITS = ("normal", "zero", "embed")
# state_init of a decoded token that starts from the previous token's final state (continuous compute).
WARM_START = "previous"
ADAPTER_INITS = ("identity", "random")

# The depth sampler's defaults (training/recurrence.py); the reference seeds it with 514229 + step.
DEFAULT_SEED = 514229
DEFAULT_SIGMA = 0.5
# The trainer's default backprop depth (docs/method.md §3), and the grad-carrying iterations of a
# train-mode forward given a depth r rather than (n, k): the last min(r, 8) of its r iterations.
DEFAULT_BACKPROP_DEPTH = 8
# The ramps of the mean recurrence and of the backprop depth over training (training/recurrence.py; the
# config's recurrence.curriculum and backprop_curriculum_kind).
MeanCurriculum = Literal["1-sqrt", "linear", "none"]
BackpropCurriculum = Literal["interpolate", "linear"]
CURRICULUM_KINDS: tuple[str, ...] = tuple(dict.fromkeys((*get_args(MeanCurriculum), *get_args(BackpropCurriculum))))


@dataclass
class ModelArgs:
    """Everything needed to build the model; serialised as the converted folder's config.json.

    A static (non-recurrent) model has ``n_core == 0``: no adapter, no loop.
    """

    vocab_size: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    n_prelude: int
    n_core: int
    n_coda: int
    block_type: str = "llama"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 32.0, ...}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    state_init: str = "normal"
    # std of the truncated-normal state init; None means the natural sqrt(2 / (5 d)).
    state_std: float | None = None
    adapter_init: str = "identity"
    # Iterations used when forward() is called without num_steps (eval default, HF export default).
    mean_recurrence: int = 1
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    # Provenance: the source-model layer indices kept in each part (informational).
    source_layers: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        family_named(self.block_type)  # an unknown family fails here, naming the supported ones
        if self.state_init not in STATE_INITS:
            raise ValueError(f"model state_init must be one of {STATE_INITS}, got {self.state_init!r}")
        if self.adapter_init not in ADAPTER_INITS:
            raise ValueError(f"model adapter_init must be one of {ADAPTER_INITS}, got {self.adapter_init!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if min(self.n_prelude, self.n_core, self.n_coda) < 0:
            raise ValueError("layer counts must be >= 0")

    @property
    def is_recurrent(self) -> bool:
        return self.n_core > 0

    @property
    def eval_state_init(self) -> str:
        """The state init at evaluation: deterministic, so a row's result depends neither on the RNG
        nor on its batch. 'embed' models keep theirs; the others start from zeros, the mean of the
        training draw (std sqrt(2/(5d)), ~0.01 at d = 2048)."""
        return "embed" if self.state_init == "embed" else "zero"

    @property
    def effective_state_std(self) -> float:
        return self.state_std if self.state_std is not None else math.sqrt(2.0 / (5.0 * self.dim))

    def effective_depth(self, num_iterations: int) -> int:
        """Blocks traversed per token at r iterations: P + R*r + C."""
        return self.n_prelude + self.n_core * num_iterations + self.n_coda

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        return cls(**values)


@dataclass(frozen=True)
class SourcePreset:
    """Shape of a pretrained source model, so shapes and FLOPs need no download."""

    hf_id: str
    n_layers: int
    default_shape: tuple[int, int, int]
    args: dict[str, Any]

    def check_shape(self, shape: tuple[int, ...] | list[int], name: str) -> None:
        """P,R,C must be three counts >= 0 that fit in the source's layers; ``name`` is the preset's."""
        example = ",".join(map(str, self.default_shape))
        if len(shape) != 3 or min(shape) < 0:
            raise ValueError(
                f"model.preset needs model.shape = P,R,C (three counts >= 0, e.g. {example}), got {list(shape)}"
            )
        if sum(shape) > self.n_layers:
            raise ValueError(f"model.shape {list(shape)} needs {sum(shape)} layers; {name} has {self.n_layers}")

    def model_args(self, n_prelude: int, n_core: int, n_coda: int, **overrides: Any) -> ModelArgs:
        self.check_shape((n_prelude, n_core, n_coda), self.hf_id)
        return ModelArgs(n_prelude=n_prelude, n_core=n_core, n_coda=n_coda, **{**self.args, **overrides})


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# What the Qwen2.5 and Qwen3 base models share (their config.json files); converted models are untied, as
# conversion unties by default.
_QWEN: dict[str, Any] = dict(
    block_type="qwen2",
    vocab_size=151936,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_embeddings=False,
    max_seq_len=32768,
    bos_id=151643,
    eos_id=151643,
)

PRESETS: dict[str, SourcePreset] = {
    "tinyllama-1.1b": SourcePreset(
        hf_id="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
        n_layers=22,
        default_shape=(4, 8, 4),
        args=dict(
            vocab_size=32000,
            dim=2048,
            n_heads=32,
            n_kv_heads=4,
            head_dim=64,
            ffn_dim=5632,
            norm_eps=1e-5,
            rope_theta=10000.0,
            tie_embeddings=False,
            max_seq_len=2048,
            bos_id=1,
            eos_id=2,
        ),
    ),
    "llama3.2-1b": SourcePreset(
        hf_id="meta-llama/Llama-3.2-1B",
        n_layers=16,
        default_shape=(4, 6, 4),
        args=dict(
            vocab_size=128256,
            dim=2048,
            n_heads=32,
            n_kv_heads=8,
            head_dim=64,
            ffn_dim=8192,
            norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=dict(_LLAMA3_SCALING),
            tie_embeddings=False,
            max_seq_len=131072,
            bos_id=128000,
            eos_id=128001,
        ),
    ),
    "olmo2-1b": SourcePreset(
        hf_id="allenai/OLMo-2-0425-1B",
        n_layers=16,
        default_shape=(4, 6, 4),
        args=dict(
            vocab_size=100352,
            dim=2048,
            n_heads=16,
            n_kv_heads=16,
            head_dim=128,
            ffn_dim=8192,
            block_type="olmo2",
            norm_eps=1e-6,
            rope_theta=500000.0,
            tie_embeddings=False,
            max_seq_len=4096,
            bos_id=100257,
            eos_id=100257,
            pad_id=100277,
        ),
    ),
    # The families beyond the paper's. Each shape is paper-style (TinyLlama's 4,8,4: a 4-layer prelude and
    # coda, an 8-layer core of the middle layers), not a ranking of the real weights: run
    # tools/analyze_layers.py on the downloaded source and pass its --layers (docs/families.md).
    "qwen2.5-0.5b": SourcePreset(
        hf_id="Qwen/Qwen2.5-0.5B",
        n_layers=24,
        default_shape=(4, 8, 4),
        args=dict(_QWEN, dim=896, n_heads=14, n_kv_heads=2, head_dim=64, ffn_dim=4864, max_seq_len=32768),
    ),
    "qwen2.5-1.5b": SourcePreset(
        hf_id="Qwen/Qwen2.5-1.5B",
        n_layers=28,
        default_shape=(4, 8, 4),
        args=dict(_QWEN, dim=1536, n_heads=12, n_kv_heads=2, head_dim=128, ffn_dim=8960, max_seq_len=131072),
    ),
    "qwen3-0.6b": SourcePreset(
        hf_id="Qwen/Qwen3-0.6B-Base",
        n_layers=28,
        default_shape=(4, 8, 4),
        args=dict(_QWEN, block_type="qwen3", dim=1024, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072),
    ),
    "qwen3-1.7b": SourcePreset(
        hf_id="Qwen/Qwen3-1.7B-Base",
        n_layers=28,
        default_shape=(4, 8, 4),
        args=dict(_QWEN, block_type="qwen3", dim=2048, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144),
    ),
    "smollm2-1.7b": SourcePreset(
        hf_id="HuggingFaceTB/SmolLM2-1.7B",
        n_layers=24,
        default_shape=(4, 8, 4),
        args=dict(
            vocab_size=49152,
            dim=2048,
            n_heads=32,
            n_kv_heads=32,
            head_dim=64,
            ffn_dim=8192,
            norm_eps=1e-5,
            rope_theta=130000.0,
            tie_embeddings=False,
            max_seq_len=8192,
            bos_id=1,
            eos_id=2,
        ),
    ),
}
