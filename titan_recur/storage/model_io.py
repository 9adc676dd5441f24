"""The model folder: config.json (ModelArgs) + model.safetensors + tokenizer files.

One home for reading and writing model folders (conversions, a run's final model, HF exports) and
for checking where one may be written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from titan_recur.models.args import PRESETS, ModelArgs
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.manifest import (
    MANIFEST_NAME,
    folder_kind,
    read_manifest,
    seal_folder,
    update_manifest_entry,
    verify_folder,
)

if TYPE_CHECKING:  # the config schema; models never import it at run time
    from titan_recur.config import Model

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CONFIG_KEY = "titan_recur"
MODEL_ARCHITECTURES = ["RecurrentLM"]  # a model folder's config.json; an HF export names its transformers class
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Failures of the file system being written (full, over quota, read-only, failing), not of an input.
DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # transformers 5 writes a tokenizer's chat template here
    "chat_template.json",
)


def read_model_args(folder: str | Path) -> ModelArgs:
    """ModelArgs of a converted folder, with a clear error when it is not one."""
    config_path = Path(folder) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no such file (is {folder} a titan_recur model folder?)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict) or CONFIG_KEY not in config:
        raise ValueError(f"{config_path} has no '{CONFIG_KEY}' section: not a converted titan_recur model")
    return ModelArgs.from_dict(config[CONFIG_KEY])


def check_not_hf_export(folder: str | Path) -> None:
    """An HF export has a titan_recur section too, but HF tensor names: say what it is and how to load it."""
    try:
        config = json.loads((Path(folder) / CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # read_model_args names the problem
    if isinstance(config, dict) and is_hf_export_config(config):
        raise ValueError(
            f"{folder} is an HF export (architectures {config.get('architectures')}), not a titan_recur model folder: "
            "load it with transformers' AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True) "
            "(docs/hf.md), or give the titan_recur model folder it was exported from"
        )


def is_hf_export_config(config: dict) -> bool:
    """An HF export's config.json names its HF class (TitanRecurForCausalLM); a model folder's names RecurrentLM."""
    return config.get("architectures", MODEL_ARCHITECTURES) != MODEL_ARCHITECTURES


def write_model_args(args: ModelArgs, folder: str | Path) -> None:
    """config.json; in a sealed folder its manifest entry too (the folder stays verifiable)."""
    config = {"architectures": MODEL_ARCHITECTURES, "model_type": "titan_recur", CONFIG_KEY: args.to_dict()}
    (Path(folder) / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    update_manifest_entry(Path(folder), CONFIG_NAME)


def savable_state_dict(model: RecurrentLM) -> dict[str, torch.Tensor]:
    """Detached, contiguous tensors (safetensors refuses views of shared storage)."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def save_weights(state: dict[str, torch.Tensor], folder: Path) -> None:
    """model.safetensors, readable by everyone (safetensors creates it owner-only; model folders are shared)."""
    path = folder / WEIGHTS_NAME
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    except SafetensorError as err:  # its I/O failures (a full disk) are OSErrors like every other writer's
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None
    path.chmod(0o644)


def write_model_folder(
    folder: Path, args: ModelArgs, state: dict[str, torch.Tensor], tokenizer_folder: str | Path | None = None
) -> list[str]:
    """config.json + model.safetensors (+ the tokenizer files found in ``tokenizer_folder``); returns those names."""
    folder.mkdir(parents=True, exist_ok=True)
    write_model_args(args, folder)
    save_weights(state, folder)
    return copy_tokenizer_files(Path(tokenizer_folder), folder) if tokenizer_folder else []


def save_model(model: RecurrentLM, folder: str | Path, tokenizer_folder: str | Path | None = None) -> None:
    """A model folder, sealed (manifest of kind "trained") so that loaders can verify it."""
    write_model_folder(Path(folder), model.args, savable_state_dict(model), tokenizer_folder)
    seal_folder(Path(folder), "trained")


def load_state_dict_into(model: RecurrentLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict load that names the first mismatching tensor."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state)


def read_weights(folder: str | Path, unverified: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a model folder's model.safetensors, checked against its manifest; one-line errors.

    A titan_recur folder always has a manifest: one without is refused (it was deleted, or the folder
    was assembled by hand) unless ``unverified`` says to load it unchecked.
    """
    weights = Path(folder) / WEIGHTS_NAME
    check_not_hf_export(folder)
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: no such file")
    require_manifest(folder, unverified)
    verify_folder(Path(folder), [CONFIG_NAME, WEIGHTS_NAME])  # the files a load reads
    try:
        return load_file(str(weights))
    except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"{weights}: unreadable safetensors file (truncated or corrupt?): {err}") from None


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, unverified: bool = False
) -> RecurrentLM:
    """Build a RecurrentLM from a sealed model folder and load its weights (eval mode); see ``read_weights``."""
    model = RecurrentLM(read_model_args(path))
    load_state_dict_into(model, read_weights(path, unverified), str(Path(path) / WEIGHTS_NAME))
    return model.to(device=device, dtype=dtype).eval()


def require_manifest(folder: str | Path, unverified: bool) -> None:
    """A folder titan_recur wrote (a model folder, a DCP step) always has a manifest: one without (deleted, or
    assembled by hand) loads only ``unverified``, unchecked, else nothing would say its files are unchecked."""
    if read_manifest(Path(folder)) is None and not unverified:
        raise UnverifiedFolderError(
            f"{folder} has no {MANIFEST_NAME}: its files cannot be verified (titan_recur seals every folder it "
            "writes); load it unchecked with --unverified (unverified=True), or write it again"
        )


class UnverifiedFolderError(ValueError):
    """A titan_recur model folder or DCP step folder without its manifest.json."""


def copy_tokenizer_files(source: Path, destination: Path) -> list[str]:
    """Copy whichever tokenizer files the source folder has; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)
            copied.append(name)
    return copied


_KIND_NAMES = {
    "conversion": "a conversion (made by tools/convert_hf.py)",
    "trained": "a trained model (a run's final_model)",
    "hf_export": "an HF export (made by tools/export_hf.py)",
    "checkpoint": "a DCP checkpoint",
    None: "a folder titan_recur did not write (no manifest.json naming its kind)",
}


def check_output_folder(output: Path, force: bool, replaceable_kind: str, error: type[Exception] = ValueError) -> None:
    """Refuse to write over a file or a non-empty folder; with force, only over a folder of ``replaceable_kind``.

    The kind is the one its writer recorded (models/manifest.py): a tool replaces its own earlier
    output, never a trained model, a checkpoint or a folder of unknown origin.
    """
    if output.exists() and not output.is_dir():
        raise error(f"{output} exists and is not a folder")
    if not output.is_dir() or not any(output.iterdir()):
        return
    if not force:
        raise error(f"{output} exists and is not empty; pass --force to overwrite it")
    kind = folder_kind(output)
    if kind != replaceable_kind:
        raise error(
            f"refusing to overwrite {output} with --force: it is {_KIND_NAMES[kind]}; --force replaces only "
            f"{_KIND_NAMES[replaceable_kind]}"
        )


def check_output_files(
    paths: list[Path], force: bool, is_own: Callable[[Path], bool], kind: str, error: type[Exception] = ValueError
) -> None:
    """Refuse to replace existing files; with force, only files ``is_own`` recognises as ``kind`` (this tool's).

    A folder in their place, or a file of another kind, is refused even with force.
    """
    existing = [p for p in paths if p.exists() or p.is_symlink()]
    for path in existing:
        if path.is_dir():
            raise error(f"{path} exists and is a folder")
    if existing and not force:
        raise error(f"{existing[0]} exists; pass --force to replace it")
    for path in existing:
        if not is_own(path):
            raise error(f"refusing to replace {path} with --force: it is not {kind}")


def write_atomically(output: Path, write: Callable[[Path], object], *, kind: str) -> None:
    """Build the folder beside OUTPUT, seal it (manifest of ``kind``), then swap it in by rename.

    On failure the partial folder is removed and OUTPUT is left as it was; an I/O error (a full disk)
    names OUTPUT, not the temporary folder.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        tmp.chmod(0o755)
        write(tmp)
        seal_folder(tmp, kind)
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=output.parent))
            output.replace(old / output.name)
            tmp.replace(output)
            shutil.rmtree(old)
        else:
            tmp.replace(output)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_naming(err, output)


def write_files_atomically(writers: Mapping[Path, Callable[[Path], object]]) -> None:
    """Each ``writer(path)`` writes a temporary file beside its path (same suffix, for writers that go by
    it); once all are written each replaces its path. On failure every temporary is removed and the paths
    are left as they were: a full disk leaves no empty or partial result that a rerun would refuse."""
    temporaries = {path: path.with_name(f".{path.stem}.partial{path.suffix}") for path in writers}
    current = next(iter(writers))
    try:
        for current, write in writers.items():
            write(temporaries[current])
        for current, tmp in temporaries.items():
            tmp.replace(current)
    except BaseException as err:
        for tmp in temporaries.values():
            tmp.unlink(missing_ok=True)
        raise_naming(err, current)


def raise_naming(err: BaseException, output: Path) -> NoReturn:
    """Raise ``err``; a disk error as an OSError naming ``output`` (not a temporary, or no file at all)."""
    if isinstance(err, OSError) and err.errno in DISK_ERRORS:
        raise OSError(err.errno, err.strerror, str(output)) from None
    raise err


def architecture_args(model: Model) -> ModelArgs:
    """The ModelArgs of ``[model]``'s own architecture (from scratch): static unless model.shape splits it."""
    # The config's validation requires every architecture field of a model trained from scratch.
    assert model.n_layers is not None and model.dim is not None and model.n_heads is not None
    assert model.vocab_size is not None and model.ffn_dim is not None
    n_prelude, n_core, n_coda = model.shape or (model.n_layers, 0, 0)
    return ModelArgs(
        vocab_size=model.vocab_size,
        dim=model.dim,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads or model.n_heads,
        head_dim=model.dim // model.n_heads,
        ffn_dim=model.ffn_dim,
        n_prelude=n_prelude,
        n_core=n_core,
        n_coda=n_coda,
    )


def resolve_model_args(model: Model) -> ModelArgs:
    """The architecture a run's ``[model]`` section names: a model folder's, or a preset's at its shape.

    With both, the folder must have the preset's architecture at that shape.
    """
    path, preset, shape = model.path, model.preset, model.shape
    if model.dim is not None:
        return architecture_args(model)
    if not path:
        assert preset is not None  # the config's validation requires a path or a preset
        return PRESETS[preset].model_args(*shape)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model.path {path}: no such folder (convert a model first: tools/convert_hf.py)")
    args = read_model_args(path)
    if preset:
        expected = PRESETS[preset].model_args(*shape)
        fields = (
            "n_prelude",
            "n_core",
            "n_coda",
            "dim",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "vocab_size",
            "block_type",
        )
        diff = [
            f"{f} {getattr(args, f)} != {getattr(expected, f)}"
            for f in fields
            if getattr(args, f) != getattr(expected, f)
        ]
        if diff:
            raise ValueError(
                f"model.path {path} is not model.preset {preset} with shape {list(shape)}: {', '.join(diff)}"
            )
    return args
