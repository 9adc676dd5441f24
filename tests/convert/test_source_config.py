"""A source's config.json as conversion reads it: the sliding window transformers runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from titan_recur.convert.surgery import SourceModel
from titan_recur.models.families import FAMILIES

# A tiny source's shapes (tests/conftest.py's), 6 layers; its positions (256) are longer than the windows below.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=6,
    max_position_embeddings=256,
)


# ---------------------------------------------------------------- the sliding window transformers runs


@torch.no_grad()
def windowed_in_transformers(family: str, config: dict[str, Any]) -> bool:
    """Whether transformers' model of ``config`` computes other logits past an 8-token window than the same weights
    with full attention: the oracle of whether any of its layers slides."""
    import transformers

    record = FAMILIES[family]
    config_cls, model_cls = (getattr(transformers, name) for name in (record.config_class, record.architecture))
    torch.manual_seed(0)
    model = model_cls(config_cls(**config)).eval()
    no_window = {
        "sliding_window": None,
        "use_sliding_window": False,
        **({"layer_types": None} if "layer_types" in config else {}),
    }
    full = model_cls(config_cls(**{**config, **no_window})).eval()
    full.load_state_dict(model.state_dict())
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    return not torch.allclose(model(ids, use_cache=False).logits, full(ids, use_cache=False).logits, atol=1e-4)


FULL = ["full_attention"] * 6


@pytest.mark.parametrize(
    "family, window",
    [
        ("mistral", dict(sliding_window=8)),
        ("mistral", dict(sliding_window=None)),
        ("llama", dict(sliding_window=8)),  # Llama has no window: the key is ignored
        ("qwen2", dict(sliding_window=8)),  # use_sliding_window defaults to false
        ("qwen2", dict(sliding_window=8, use_sliding_window=False, max_window_layers=0)),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True)),  # max_window_layers defaults to 28 > 6 layers
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=6)),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=5)),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=0, layer_types=FULL)),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, layer_types=[*FULL[:5], "sliding_attention"])),
        ("qwen3", dict(sliding_window=8, use_sliding_window=True, max_window_layers=6)),
        ("qwen3", dict(sliding_window=8, use_sliding_window=True, max_window_layers=2)),
    ],
)
def test_max_seq_len_is_capped_where_transformers_slides_a_layer(family, window):
    """max_seq_len is the window exactly where transformers' model of the config computes a windowed layer (Mistral's
    sliding_window; Qwen's use_sliding_window, max_window_layers and layer_types), else the source's positions."""
    record = FAMILIES[family]
    config = {**TINY, "architectures": [record.architecture], "model_type": family, **window}
    capped = SourceModel(Path("."), config, record.architecture).max_seq_len
    assert capped == (8 if windowed_in_transformers(family, config) else 256)
