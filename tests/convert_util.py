"""Helpers of the conversion tests (tests/convert/, tests/cli/test_convert.py): seeded input ids, the HF source's
logits (optionally on a subset of its layers) and a converted folder's logits."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from titan_recur.storage.model_io import load_model

SEQ_LEN = 40


def input_ids(seq_len: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(3, 512, (2, seq_len), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def hf_logits(folder: Path, ids: torch.Tensor, layers: list[int] | None = None) -> torch.Tensor:
    """Logits of the HF source model, optionally restricted to (and reordered as) the given layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if layers is not None:
        model.model.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        model.config.num_hidden_layers = len(layers)
        for j, layer in enumerate(model.model.layers):
            layer.self_attn.layer_idx = j
    return model(input_ids=ids, use_cache=False).logits


@torch.no_grad()
def converted_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    return load_model(folder)(ids, num_steps=1)
