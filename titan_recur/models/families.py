"""Source-model families: one record per transformers block family (docs/families.md).

The blocks, the cost model, conversion, the static export and the presets read these records, so a new
family that fits the knobs below is one record; one that does not also needs its block code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

QKNorm = Literal["none", "full", "per_head"]
# Which layers of a family's transformers model attend over a sliding window: none; every layer when the config
# sets sliding_window (Mistral); or, with use_sliding_window, those layer_types marks "sliding_attention", by
# default the layers from max_window_layers on (Qwen2, Qwen3).
SlidingWindow = Literal["none", "every_layer", "layer_types"]
# transformers' defaults where a config leaves these out (MistralConfig, Qwen2Config, Qwen3Config).
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True)
class Family:
    """How one family's decoder layer differs from Llama's, and its transformers names.

    pre_norm: Llama's input/post-attention RMSNorms, else OLMo-2's norms on the attention and MLP
    outputs. qk_norm: RMSNorm of the projected q and k, over the whole projection ("full", OLMo-2) or
    per head before RoPE ("per_head", Qwen3). qkv_bias: q, k and v always carry biases (Qwen2), whatever
    the config's attention_bias says (which, where a config has it, biases all four projections).
    default_norm_eps: transformers' rms_norm_eps when a config leaves it out. sliding_window: how the config
    turns a sliding attention window on (SlidingWindow).
    """

    name: str
    architecture: str
    model_types: tuple[str, ...]
    config_class: str
    pre_norm: bool = True
    qk_norm: QKNorm = "none"
    qkv_bias: bool = False
    default_norm_eps: float = 1e-6
    sliding_window: SlidingWindow = "none"
    covers: str = ""


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "llama",
            "LlamaForCausalLM",
            ("llama",),
            "LlamaConfig",
            covers="Llama 2/3, TinyLlama, SmolLM 1/2 (SmolLM3 is its own architecture)",
        ),
        Family(
            "olmo2",
            "Olmo2ForCausalLM",
            ("olmo2",),
            "Olmo2Config",
            pre_norm=False,
            qk_norm="full",
            default_norm_eps=1e-5,
            covers="OLMo-2",
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            ("qwen2",),
            "Qwen2Config",
            qkv_bias=True,
            sliding_window="layer_types",
            covers="Qwen2, Qwen2.5",
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            ("qwen3",),
            "Qwen3Config",
            qk_norm="per_head",
            sliding_window="layer_types",
            covers="Qwen3 (dense)",
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            ("mistral",),
            "MistralConfig",
            sliding_window="every_layer",
            covers="Mistral 7B, Ministral",
        ),
    )
}
BLOCK_TYPES = tuple(FAMILIES)


class UnsupportedFamily(ValueError):
    """A model family titan_recur has no record for; the message names the supported ones."""


def family_named(block_type: str) -> Family:
    """The record of a ModelArgs.block_type."""
    if block_type not in FAMILIES:
        raise UnsupportedFamily(f"model block_type must be one of {BLOCK_TYPES}, got {block_type!r}")
    return FAMILIES[block_type]


def family_of_hf_config(config: dict[str, Any]) -> Family:
    """The record of an HF config.json: by its architectures, else by its model_type."""
    architectures = config.get("architectures") or []
    if architectures:
        return family_of_architecture(architectures[0])
    model_type = config.get("model_type")
    family = next((f for f in FAMILIES.values() if model_type in f.model_types), None)
    return family or family_of_architecture(str(model_type))


def family_of_architecture(architecture: str) -> Family:
    """The record of an HF architecture name (``LlamaForCausalLM``, ...)."""
    family = next((f for f in FAMILIES.values() if f.architecture == architecture), None)
    if family is None:
        supported = ", ".join(f.architecture for f in FAMILIES.values())
        raise UnsupportedFamily(f"unsupported architecture {architecture!r}; supported: {supported}")
    return family
