"""Shared fixtures: tiny HF source checkpoints and tiny model folders, built once per session (random weights, offline)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets"

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# name -> (architecture, config overrides, save_pretrained kwargs)
TINY_HF_CHECKPOINTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # GQA, head_dim != hidden / heads, theta != 10000.
    "llama": ("llama", dict(num_hidden_layers=6, num_key_value_heads=2, head_dim=32, rope_theta=50000.0), {}),
    # Llama-3 frequency scaling with a short original context, so sequences > 16 tokens exercise it.
    "llama_rope_scaled": (
        "llama",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        {},
    ),
    # Tied embeddings (no lm_head tensor on disk), projection biases, several EOS ids.
    "llama_tied": (
        "llama",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            eos_token_id=[2, 3],
        ),
        {},
    ),
    "llama_sharded": ("llama", dict(num_hidden_layers=6, num_key_value_heads=2), dict(max_shard_size="100KB")),
    "olmo2": ("olmo2", dict(num_hidden_layers=6, num_key_value_heads=4, rms_norm_eps=1e-6), {}),
    # Qwen2.5: q/k/v biases (no o bias), tied embeddings as its small models; the sliding window is off.
    "qwen2": ("qwen2", dict(num_hidden_layers=6, num_key_value_heads=2, tie_word_embeddings=True), {}),
    # Qwen3: per-head q/k RMSNorm, head_dim != hidden / heads, theta 1e6.
    "qwen3": ("qwen3", dict(num_hidden_layers=6, num_key_value_heads=2, head_dim=32, rope_theta=1e6), {}),
    # Mistral: its sliding window (128) is shorter than its positions (256): max_seq_len is capped at it.
    "mistral": ("mistral", dict(num_hidden_layers=6, num_key_value_heads=2, sliding_window=128), {}),
}


def save_tiny_hf_checkpoint(name: str, folder: Path, seed: int = 0) -> Path:
    """Save a random tiny HF model (+ the tiny tokenizer) as a source checkpoint folder.

    Weights are scaled up and norm weights randomised so that any misplaced layer or norm shows in the
    logits well above float noise.
    """
    import transformers

    from titan_recur.models.families import FAMILIES

    arch, overrides, save_kwargs = TINY_HF_CHECKPOINTS[name]
    family = FAMILIES[arch]
    config_cls, model_cls = (getattr(transformers, cls) for cls in (family.config_class, family.architecture))
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_COMMON, **overrides}))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in param_name else 0.1 * torch.randn_like(param))
    model.save_pretrained(folder, **save_kwargs)
    for file in (ASSETS / "tokenizer").glob("*"):
        shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> folder of that tiny HF checkpoint (see TINY_HF_CHECKPOINTS), built once per session."""
    root = tmp_path_factory.mktemp("hf_checkpoints")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_tiny_hf_checkpoint(name, root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make_model_dir``'s tiny recurrent model folder (zero state init), built once per session; read only."""
    from tests.tiny_models import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def normal_init_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with a recurrent state drawn from the global RNG, so that a resume is exact only if it
    restores the RNG; built once per session; read only."""
    from tests.tiny_models import make_model_dir
    from titan_recur.storage.model_io import read_model_args, write_model_args

    folder = make_model_dir(tmp_path_factory.mktemp("normal_init_model"))
    write_model_args(dataclasses.replace(read_model_args(folder), state_init="normal"), folder)
    return folder


@pytest.fixture(scope="session")
def tiny_hf_export(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_model_dir`` exported for transformers at mean recurrence EXPORT_MEAN, built once per session; read
    only (tests that save or change an export copy it first)."""
    from tests.hf_util import EXPORT_MEAN
    from titan_recur import load_model
    from titan_recur.hf.export import export_hf

    out = tmp_path_factory.mktemp("tiny_hf_export") / "hf"
    export_hf(load_model(tiny_model_dir), out, tokenizer_folder=tiny_model_dir, mean_recurrence=EXPORT_MEAN)
    return out


@pytest.fixture(scope="session")
def generation_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model folder (vocab 512, random adapter: depth matters, max_seq_len 128, zero state init) with
    the bundled tokenizer: the generate command's and the engine's lm-eval and HF export tests; built once per
    session; read only."""
    from tests.tiny_models import tiny_args, tiny_model
    from titan_recur.storage.model_io import save_model

    args = tiny_args(512, adapter_init="random", max_seq_len=128, state_init="zero", eos_id=2, pad_id=0, bos_id=1)
    folder = tmp_path_factory.mktemp("generate") / "model"
    save_model(tiny_model(args, seed=3, std=0.1).eval(), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "tokenizer" / name, folder / name)
    return folder
