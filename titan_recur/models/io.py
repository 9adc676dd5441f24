"""The converted-model folder: config.json (ModelArgs) + model.safetensors + tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from titan_recur.models.args import ModelArgs
from titan_recur.models.model import RecurrentLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CONFIG_KEY = "titan_recur"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
)


def read_model_args(folder: str | Path) -> ModelArgs:
    """ModelArgs of a converted folder, with a clear error when it is not one."""
    config_path = Path(folder) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no such file (is {folder} a titan_recur model folder?)")
    config = json.loads(config_path.read_text())
    if CONFIG_KEY not in config:
        raise ValueError(f"{config_path} has no '{CONFIG_KEY}' section: not a converted titan_recur model")
    return ModelArgs.from_dict(config[CONFIG_KEY])


def write_model_args(args: ModelArgs, folder: str | Path) -> None:
    config = {"architectures": ["RecurrentLM"], "model_type": "titan_recur", CONFIG_KEY: args.to_dict()}
    (Path(folder) / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def savable_state_dict(model: RecurrentLM) -> dict[str, torch.Tensor]:
    """The state dict without the tied head (safetensors refuses shared storage)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        state.pop("lm_head.weight")
    return state


def save_model(model: RecurrentLM, folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_model_args(model.args, folder)
    save_file(savable_state_dict(model), str(folder / WEIGHTS_NAME), metadata={"format": "pt"})


def load_state_dict_into(model: RecurrentLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict load that names the first mismatching tensor."""
    expected = model.state_dict()
    if model.args.tie_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> RecurrentLM:
    """Build a RecurrentLM from a converted folder and load its weights."""
    args = read_model_args(path)
    weights = Path(path) / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: no such file")
    model = RecurrentLM(args)
    load_state_dict_into(model, load_file(str(weights)), str(weights))
    return model.to(device=device, dtype=dtype).eval()


def copy_tokenizer_files(source: Path, destination: Path) -> list[str]:
    """Copy whichever tokenizer files the source folder has; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)
            copied.append(name)
    return copied
