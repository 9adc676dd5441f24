"""The tiny model shapes and model folders the tests share: random init, CPU, milliseconds per forward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from titan_recur.models.args import ModelArgs
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.model_io import save_model

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# d 32, 4 query / 2 KV heads of 8 (GQA, head_dim != dim / heads), one prelude, two core and one coda block.
TINY: dict[str, Any] = dict(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, n_prelude=1, n_core=2, n_coda=1)
# The same layout twice as wide: where a test needs d 64 (FLOP shapes, bf16 rounding, longer contexts).
SMALL: dict[str, Any] = {**TINY, "dim": 64, "head_dim": 16, "ffn_dim": 128}


def tiny_args(vocab_size: int = 97, shape: dict[str, Any] = TINY, **overrides: Any) -> ModelArgs:
    """``ModelArgs`` of a shared shape; ``overrides`` replace any field (vocab, layout, behaviour)."""
    return ModelArgs(**{"vocab_size": vocab_size, **shape, **overrides})


def tiny_model(args: ModelArgs, seed: int = 0, std: float = 0.02) -> RecurrentLM:
    """The model of ``args``, seeded and randomly initialised (``init_weights(std)``)."""
    torch.manual_seed(seed)
    model = RecurrentLM(args)
    model.init_weights(std)
    return model


def make_model_dir(folder: Path, **overrides: Any) -> Path:
    """A tiny model folder as a conversion writes it, with the bundled tokenizer (vocab 512); zero state init
    keeps runs comparable. ``overrides`` replace ModelArgs fields."""
    args = tiny_args(512, **{"ffn_dim": 64, "state_init": "zero", "adapter_init": "random", **overrides})
    torch.manual_seed(0)
    model = RecurrentLM(args)
    model.init_weights()
    save_model(model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "tokenizer" / name, folder / name)
    return folder


def edited_source(source: Path, folder: Path, **changes: Any) -> Path:
    """A copy of a tiny HF source whose config.json has ``changes`` (a None drops the key)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
