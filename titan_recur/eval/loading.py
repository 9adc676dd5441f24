"""Load a model to evaluate or export: a titan_recur model folder, or a DCP step folder of a run."""

from __future__ import annotations

from pathlib import Path

import torch

from titan_recur.data.tokenizer import Tokenizer, check_same_tokenizer, check_vocab, load_tokenizer
from titan_recur.models.args import ModelArgs
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.checkpoint import ModelState, load_from
from titan_recur.storage.model_io import (
    DTYPES,
    WEIGHTS_NAME,
    check_not_hf_export,
    load_model,
    read_model_args,
    require_manifest,
)


def resolve_device(device: str | None) -> torch.device:
    """'auto' (or None) = cuda when available, else cpu; no silent fallback from an explicit cuda device."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available (use device cpu or auto)")
    return torch.device(device)


def is_dcp_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()


def checkpoint_model_args(path: str | Path, model_config: str | Path | None = None) -> ModelArgs:
    """The architecture of the checkpoint at ``path`` (see ``load_checkpoint``), read without loading any weights.

    So a tool checks its inputs against the model (max_seq_len, memory) before any work.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: no such checkpoint (expected a model folder with config.json + {WEIGHTS_NAME}, "
            "or a DCP step folder)"
        )
    if not is_dcp_checkpoint(path):
        if model_config is not None:
            raise ValueError(f"--model-config is only for DCP step folders; {path} is a model folder")
        check_not_hf_export(path)
        return read_model_args(path)
    if model_config is None:
        raise ValueError(
            f"{path} is a DCP step folder: pass --model-config with the run's model folder "
            "(config.json) for its architecture"
        )
    return read_model_args(model_config)


def load_checkpoint(
    path: str | Path,
    model_config: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    unverified: bool = False,
) -> RecurrentLM:
    """The model at ``path`` in eval mode.

    path: a model folder (config.json + model.safetensors: converted, a run's final_model/, ...), or a
    DCP step folder (``<dump>/checkpoints/step-N``), whose architecture comes from the model folder
    ``model_config`` (DCP stores tensors only). A DCP step loads into a plain module, no process group.
    A folder of either kind without its manifest loads only with ``unverified`` (storage/model_io.py).
    """
    path = Path(path)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    args = checkpoint_model_args(path, model_config)
    if not is_dcp_checkpoint(path):
        return load_model(path, device=device, dtype=DTYPES[dtype], unverified=unverified)
    require_manifest(path, unverified)
    model = RecurrentLM(args)
    load_from(path, {"model": ModelState(model)})
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def default_tokenizer_folder(path: str | Path, model_config: str | Path | None) -> Path:
    """Where the tokenizer files of a checkpoint are: the model folder (or, for DCP, the --model-config folder)."""
    return Path(model_config if model_config is not None else path)


def checkpoint_tokenizer(
    checkpoint: str | Path,
    model_config: str | Path | None,
    given: str | None,
    vocab_size: int,
    flag: str = "--tokenizer",
) -> Tokenizer:
    """The tokenizer for a checkpoint: its own folder's, or `given` when that one means the same ids; its ids must
    fit the model's vocabulary. Read before any weights."""
    own = default_tokenizer_folder(checkpoint, model_config)
    tokenizer = load_tokenizer(given or own)
    check_vocab(tokenizer, vocab_size)
    if given is not None:
        check_same_tokenizer(tokenizer, given, own, flag)
    return tokenizer
