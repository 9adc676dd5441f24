"""Surgery (docs/method.md §2): turn a pretrained HF Llama / OLMo-2 checkpoint into a depth-recurrent model folder.

The source layers are split into prelude / core / coda (the rest dropped), renamed into the
RecurrentLM layout and joined by a new adapter. With the identity adapter A = [0 | I] and r = 1 the
result computes exactly the source model restricted to the kept layers, whatever the state init.

Everything is validated (config, layer plan, every tensor's presence and shape, the output folder)
before anything is written, and the output appears by one rename, so a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from titan_recur.data.tokenizer import check_vocab, load_tokenizer
from titan_recur.models.args import ModelArgs
from titan_recur.models.families import (
    DEFAULT_MAX_WINDOW_LAYERS,
    DEFAULT_SLIDING_WINDOW,
    Family,
    UnsupportedFamily,
    family_of_architecture,
    family_of_hf_config,
)
from titan_recur.models.model import RecurrentLM, init_identity_adapter
from titan_recur.models.rope import SUPPORTED_ROPE_TYPES
from titan_recur.storage.model_io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_output_folder,
    savable_state_dict,
    write_atomically,
    write_model_folder,
)
from titan_recur.storage.model_io import (
    DTYPES as MODEL_DTYPES,
)
from titan_recur.training.cost_model import param_counts
from titan_recur.utils.progress import progress

# "source" keeps each tensor's stored dtype.
DTYPES = {**MODEL_DTYPES, "source": None}
INDEX_NAME = "model.safetensors.index.json"
PROVENANCE_NAME = "conversion.json"
# Written beside a source by tools/fetch_smollm2.sh (package, GGUF file, SHA-256, quantization): copied
# into conversion.json, so exports name where the weights came from.
FETCH_RECORD = "fetch.json"
# What a hub download fetches: configs, safetensors weights, tokenizers (Llama-3 keeps its tiktoken
# file under original/, next to the multi-GB original/consolidated.00.pth, which is not fetched).
HUB_PATTERNS = ["*.json", "model*.safetensors", "tokenizer.model", "original/tokenizer.model"]
_HUB_ID = re.compile(r"\w[\w.-]*/\w[\w.-]*")
# The integer fields of a source config that conversion reads: required, then optional (null: derived).
_REQUIRED_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
# Far more layers than any checkpoint holds (Llama 3.1 405B has 126): a hand-edit or a foreign value, refused
# before per-layer lists are built.
MAX_SOURCE_LAYERS = 10_000
# The attention of a Qwen layer (its config's layer_types).
LAYER_TYPES = {"full_attention", "sliding_attention"}
# transformers' max_position_embeddings of a Llama config that leaves it out.
DEFAULT_POSITIONS = 2048
# What each rope scaling titan_recur computes reads beside its type (models/rope.py).
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_BLOCK_NAME = re.compile(r"(prelude|core\.blocks|coda)\.(\d+)\.(.+)")


class ConversionError(ValueError):
    """Bad input to a conversion; the message is one line meant for the user."""


@dataclass(frozen=True)
class LayerPlan:
    """Source layer indices per part, in the order they run; an empty core means a static model."""

    n_source_layers: int
    prelude: tuple[int, ...]
    core: tuple[int, ...]
    coda: tuple[int, ...]

    @property
    def dropped(self) -> tuple[int, ...]:
        kept = {*self.prelude, *self.core, *self.coda}
        return tuple(i for i in range(self.n_source_layers) if i not in kept)

    @property
    def is_static(self) -> bool:
        return not self.core

    def source_layers(self) -> dict[str, list[int]]:
        parts = ("prelude", "core", "coda", "dropped")
        return {part: list(getattr(self, part)) for part in parts}

    def part(self, name: str) -> tuple[int, ...]:
        """Layers of a RecurrentLM block list by its module prefix ("prelude", "core.blocks", "coda")."""
        return {"prelude": self.prelude, "core.blocks": self.core, "coda": self.coda}[name]


@dataclass(frozen=True)
class ConvertOptions:
    """Model choices made at conversion time (written into the output's ModelArgs)."""

    adapter_init: str = "identity"
    state_init: str = "normal"
    # None = the natural sqrt(2 / (5 d)); the reference used sqrt(2 / (5 * 5280)) = 0.0087 by accident.
    state_std: float | None = None
    tie_embeddings: bool = False
    # Eval depth written to the config (forward() without num_steps); 4 is the smallest paper train mean.
    mean_recurrence: int = 4
    dtype: str = "float32"
    # Seeds the random adapter init (nn.Linear's default init).
    seed: int = 0


@dataclass(frozen=True)
class SourceModel:
    """A local HF checkpoint folder and what its config.json says."""

    folder: Path
    config: dict[str, Any]
    architecture: str

    @property
    def n_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def family(self) -> Family:
        return family_of_architecture(self.architecture)

    @property
    def window(self) -> int | None:
        return attention_window(self.config, self.family)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the converted model computes as the source does: its positions, capped
        at its sliding attention window (longer runs are then refused by train, eval and generate)."""
        positions = int(self.config.get("max_position_embeddings", DEFAULT_POSITIONS))
        return positions if self.window is None else min(positions, self.window)

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))


# ---------------------------------------------------------------- layer plans


def parse_layers(text: str) -> list[int]:
    """'0-3,7,9-10' -> [0, 1, 2, 3, 7, 9, 10], order kept; '' -> []."""
    layers: list[int] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match or int(match[2] or match[1]) < int(match[1]):
            raise ConversionError(f"bad layer list {text!r}: expected indices and ascending ranges like 0,2,5-7")
        layers.extend(range(int(match[1]), int(match[2] or match[1]) + 1))
    return layers


def parse_shape(text: str, flag: str = "--shape") -> tuple[int, int, int]:
    """'4,8,4' -> (4, 8, 4): every command's P,R,C (convert, analyze_layers, flops, the benchmarks)."""
    match = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not match:
        raise ConversionError(
            f"{flag} {text!r}: expected P,R,C, 3 comma-separated integers >= 0 (prelude, core, coda layer counts) "
            "like 4,8,4"
        )
    return int(match[1]), int(match[2]), int(match[3])


def format_layers(layers: Sequence[int]) -> str:
    """Inverse of parse_layers: [0, 1, 2, 3, 7] -> '0-3,7'; [] -> '-'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "-"


def plan_layers(
    n_layers: int,
    shape: tuple[int, int, int] | None = None,
    prelude: Sequence[int] | None = None,
    core: Sequence[int] | None = None,
    coda: Sequence[int] | None = None,
    static: bool = False,
) -> LayerPlan:
    """Choose the source layers of each part.

    shape (P, R, C): prelude = first P, coda = last C, core = the R layers just before the coda.
    Explicit lists are used as given (missing ones are empty). static: the kept layers (all layers
    when nothing is given) become one plain stack in the prelude, with no core and no adapter.
    """
    lists_given = any(part is not None for part in (prelude, core, coda))
    if shape is not None and lists_given:
        raise ConversionError("give either a shape or explicit --prelude/--core/--coda lists, not both")
    if shape is not None:
        prelude, core, coda = _shape_layers(n_layers, shape)
    elif not lists_given and not static:
        raise ConversionError("choose the layers: --shape P,R,C or --prelude/--core/--coda lists (or --static)")
    elif not lists_given:
        prelude = range(n_layers)
    prelude, core, coda = tuple(prelude or ()), tuple(core or ()), tuple(coda or ())
    _check_indices(n_layers, prelude + core + coda)
    if static:
        prelude, core, coda = prelude + core + coda, (), ()
        if not prelude:
            raise ConversionError("no layers selected")
    elif not core:
        raise ConversionError("the core is empty: a recurrent model needs at least one core layer (or use --static)")
    return LayerPlan(n_layers, prelude, core, coda)


def _shape_layers(n_layers: int, shape: tuple[int, int, int]) -> tuple[range, range, range]:
    n_prelude, n_core, n_coda = shape
    if min(shape) < 0:
        raise ConversionError(f"shape {n_prelude},{n_core},{n_coda} has a negative count")
    if n_prelude + n_core + n_coda > n_layers:
        raise ConversionError(
            f"shape {n_prelude},{n_core},{n_coda} needs {n_prelude + n_core + n_coda} layers; the source has {n_layers}"
        )
    core_start = n_layers - n_coda - n_core
    return range(n_prelude), range(core_start, n_layers - n_coda), range(n_layers - n_coda, n_layers)


def _check_indices(n_layers: int, layers: tuple[int, ...]) -> None:
    for i in layers:
        if not 0 <= i < n_layers:
            raise ConversionError(f"layer {i} is out of range: the source has layers 0-{n_layers - 1}")
    repeated = sorted({i for i in layers if layers.count(i) > 1})
    if repeated:
        raise ConversionError(f"layer {repeated[0]} is selected more than once; each source layer may be used once")


# ---------------------------------------------------------------- source


def resolve_source(source: str, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub id: its config.json first, checked as read_source checks it, so
    that a source conversion refuses costs no weights download; then safetensors, configs and tokenizer."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not _HUB_ID.fullmatch(source):
        raise ConversionError(f"{source}: not a local folder (nor a hub id like owner/name)")
    import huggingface_hub

    config = _from_hub(source, lambda: huggingface_hub.hf_hub_download(source, CONFIG_NAME, revision=revision))
    check_source_config(read_config(config))
    return _from_hub(
        source, lambda: huggingface_hub.snapshot_download(source, revision=revision, allow_patterns=HUB_PATTERNS)
    )


def _from_hub(source: str, download: Callable[[], str]) -> Path:
    try:
        return Path(download())
    except Exception as e:  # network, auth, missing repo: one line for the user
        reason = (str(e).splitlines() or [""])[0]
        raise ConversionError(
            f"{source}: not a local folder, and the hub download failed: {type(e).__name__}: {reason}"
        ) from None


def read_source(folder: str | Path) -> SourceModel:
    """Read and check the source config (check_source_config)."""
    folder = Path(folder)
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise ConversionError(f"{config_path}: no such file (is {folder} an HF model folder?)")
    config = read_config(config_path)
    return SourceModel(folder, config, check_source_config(config))


def read_config(path: Path) -> dict[str, Any]:
    """A config.json's object, or one line saying why it is none."""
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: not an HF config (a JSON object)")
    return config


def check_source_config(config: dict[str, Any]) -> str:
    """The architecture of a source config, after checking every value conversion reads, so that a hand-edited
    or foreign config is one line before any work: a supported family with SiLU MLPs, positive integer shapes,
    a layer count a checkpoint can hold, the rope scaling and the sliding window."""
    architectures = config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(name, str) for name in architectures)
    ):
        raise ConversionError(
            f'config.json: architectures must be a list of names like ["LlamaForCausalLM"], got {architectures!r}'
        )
    try:
        family = family_of_hf_config(config)
    except UnsupportedFamily as err:
        raise ConversionError(str(err)) from None
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(
            f"unsupported hidden_act {config['hidden_act']!r} in {family.architecture}; only silu (SwiGLU)"
        )
    for key in _REQUIRED_COUNTS:
        if key not in config:
            raise ConversionError(f"config.json: {key} is missing")
    for key in _REQUIRED_COUNTS + _OPTIONAL_COUNTS:
        value = config.get(key)
        if not _is_int(value) and not (value is None and key in _OPTIONAL_COUNTS):
            raise ConversionError(f"config.json: {key} must be an integer >= 1, got {value!r}")
    if config["num_hidden_layers"] > MAX_SOURCE_LAYERS:
        raise ConversionError(
            f"config.json: num_hidden_layers {config['num_hidden_layers']:,} is more than a checkpoint holds "
            f"(at most {MAX_SOURCE_LAYERS:,})"
        )
    _rope(config)
    attention_window(config, family)
    return family.architecture


def _is_int(value: Any, minimum: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def attention_window(config: dict[str, Any], family: Family) -> int | None:
    """The sliding attention window transformers runs some layer of a source config with (Family.sliding_window),
    or None where no layer slides. titan_recur attends over the whole sequence, which equals the source's
    attention only for sequences no longer than the window."""
    if family.sliding_window == "none":
        return None
    if family.sliding_window == "layer_types" and not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if window is not None and not _is_int(window):
        raise ConversionError(f"config.json: sliding_window must be an integer >= 1 or null, got {window!r}")
    if family.sliding_window == "layer_types" and not _has_sliding_layer(config):
        return None
    return window


def _has_sliding_layer(config: dict[str, Any]) -> bool:
    """Whether a Qwen config marks a layer sliding: its layer_types, else the layers from max_window_layers on."""
    n_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        if not _is_int(first, minimum=0):
            raise ConversionError(f"config.json: max_window_layers must be an integer >= 0, got {first!r}")
        return first < n_layers
    if not (isinstance(layer_types, list) and len(layer_types) == n_layers and set(layer_types) <= LAYER_TYPES):
        raise ConversionError(
            f"config.json: layer_types must name {' or '.join(sorted(LAYER_TYPES))} for each of the {n_layers} layers"
        )
    return "sliding_attention" in layer_types


def standard_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """A rope scaling as transformers 5 writes it: its type under rope_type, None for plain RoPE. Legacy configs
    name it `type`, which transformers reads only where rope_type is absent: {rope_type: default, type: linear}
    is plain RoPE to it."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if scaling is None or rope_type == "default":
        return None
    return {"rope_type": rope_type, **{k: v for k, v in scaling.items() if k not in ("type", "rope_type")}}


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """theta and scaling as transformers reads them: top-level rope_theta and rope_scaling (hub configs, the
    legacy `type` key included) or rope_parameters (transformers 5)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConversionError("config.json: rope_scaling and rope_parameters must be JSON objects")
    theta: Any = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if not _is_number(theta) or theta <= 0:
        raise ConversionError(f"config.json: rope_theta must be a number > 0, got {theta!r}")
    scaling = standard_rope_scaling({k: v for k, v in scaling.items() if k != "rope_theta"})
    if scaling is None:
        return float(theta), None
    rope_type = scaling["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConversionError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "llama3":  # transformers: a top-level value wins, else the scaling's, else the positions
        original = scaling.get(
            "original_max_position_embeddings", config.get("max_position_embeddings", DEFAULT_POSITIONS)
        )
        scaling["original_max_position_embeddings"] = config.get("original_max_position_embeddings", original)
    missing = [key for key in ROPE_SCALING_KEYS[rope_type] if not _is_number(scaling.get(key))]
    if missing:
        raise ConversionError(f"config.json: rope scaling {rope_type!r} needs a number for {', '.join(missing)}")
    return float(theta), scaling


def _first(token_id: int | list[int] | None) -> int | None:
    """Configs may list several EOS ids (instruct models); the first is the document separator."""
    if isinstance(token_id, list):
        return token_id[0] if token_id else None
    return token_id


def hf_config_to_model_args(source: SourceModel, plan: LayerPlan, options: ConvertOptions) -> ModelArgs:
    """ModelArgs of the converted model: the source's shapes, the plan's layer counts, the options."""
    config = source.config
    theta, scaling = _rope(config)
    n_heads = int(config["num_attention_heads"])
    try:
        return ModelArgs(
            vocab_size=int(config["vocab_size"]),
            dim=int(config["hidden_size"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // n_heads),
            ffn_dim=int(config["intermediate_size"]),
            n_prelude=len(plan.prelude),
            n_core=len(plan.core),
            n_coda=len(plan.coda),
            block_type=source.family.name,
            norm_eps=float(config.get("rms_norm_eps", source.family.default_norm_eps)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=source.max_seq_len,
            tie_embeddings=options.tie_embeddings,
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            state_init=options.state_init,
            state_std=options.state_std,
            adapter_init=options.adapter_init,
            mean_recurrence=options.mean_recurrence,
            bos_id=_first(config.get("bos_token_id")),
            eos_id=_first(config.get("eos_token_id")),
            pad_id=_first(config.get("pad_token_id")),
            source_layers=plan.source_layers(),
        )
    except ValueError as e:
        raise ConversionError(str(e)) from None


class SourceWeights:
    """Tensor name -> safetensors file of a local checkpoint (one file or sharded), read lazily."""

    def __init__(self, folder: Path) -> None:
        if (folder / INDEX_NAME).is_file():
            weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
        elif (folder / WEIGHTS_NAME).is_file():
            with _open_safetensors(folder / WEIGHTS_NAME) as f:
                self.files = dict.fromkeys(f.keys(), folder / WEIGHTS_NAME)
        else:
            raise ConversionError(
                f"{folder}: no {WEIGHTS_NAME} or {INDEX_NAME} (only safetensors checkpoints are supported)"
            )
        for file in sorted(set(self.files.values())):
            if not file.is_file():
                raise ConversionError(f"{file}: no such file (listed in {folder / INDEX_NAME})")
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _open(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = _open_safetensors(file)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._open(name).get_tensor(name)


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
        raise ConversionError(f"{file}: unreadable safetensors file (truncated or corrupt?): {err}") from None


# ---------------------------------------------------------------- conversion


def _meta_model(args: ModelArgs) -> RecurrentLM:
    with torch.device("meta"):
        return RecurrentLM(args)


def target_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor the converted folder stores (a tied head is not stored), with its shape."""
    return {name: tuple(t.shape) for name, t in savable_state_dict(_meta_model(args)).items()}


def source_tensor_names(targets: Iterable[str], plan: LayerPlan, source_tied: bool) -> dict[str, str | None]:
    """Each converted tensor name -> its source tensor name (None: the new adapter)."""
    names: dict[str, str | None] = {}
    for target in targets:
        block = _BLOCK_NAME.fullmatch(target)
        if block:
            names[target] = f"model.layers.{plan.part(block[1])[int(block[2])]}.{block[3]}"
        elif target == "core.adapter.weight":
            names[target] = None
        elif target == "lm_head.weight":
            names[target] = "model.embed_tokens.weight" if source_tied else "lm_head.weight"
        else:  # embed_tokens.weight, norm.weight
            names[target] = f"model.{target}"
    return names


def _check_weights(
    weights: SourceWeights,
    names: dict[str, str | None],
    shapes: dict[str, tuple[int, ...]],
    source: SourceModel,
    tie: bool,
) -> None:
    """Every needed source tensor exists with the right shape; tying needs equal embedding and head."""
    for target, name in names.items():
        if name is None:
            continue
        if name not in weights:
            raise ConversionError(f"{source.folder}: tensor {name} is missing from the checkpoint")
        if weights.shape(name) != shapes[target]:
            raise ConversionError(
                f"{source.folder}: tensor {name} has shape {weights.shape(name)}, the config implies {shapes[target]}"
            )
    if tie and not source.tied:
        if "lm_head.weight" not in weights or not torch.equal(
            weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
        ):
            raise ConversionError(
                "--tie-embeddings: the source's LM head is not its embedding (untied source); use --untie-embeddings"
            )


def adapter_weight(dim: int, init: str, seed: int) -> torch.Tensor:
    """The new adapter A (d x 2d): identity [0 | I] or nn.Linear's default init, seeded."""
    weight = torch.empty(dim, 2 * dim)
    if init == "identity":
        init_identity_adapter(weight)
    else:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    return weight


def check_output(output: Path, force: bool, source: Path | None = None) -> None:
    """Refuse to write into an existing non-empty folder, or with --force over anything but a conversion."""
    if source is not None and output.resolve() == source.resolve():
        raise ConversionError(f"{output}: the output folder is the source folder")
    check_output_folder(output, force, "conversion", ConversionError)


def convert(
    source_dir: str | Path,
    output_dir: str | Path,
    plan: LayerPlan,
    options: ConvertOptions = ConvertOptions(),
    *,
    force: bool = False,
    dry_run: bool = False,
    source_name: str | None = None,
) -> ModelArgs:
    """Convert a local HF checkpoint into OUTPUT (config.json, model.safetensors, tokenizer files).

    Everything is checked before anything is written; dry_run checks and writes nothing.
    source_name (e.g. a hub id) is recorded in OUTPUT/conversion.json instead of the folder path.
    """
    output = Path(output_dir)
    source = read_source(source_dir)
    check_output(output, force, source.folder)
    check_tokenizer(source)
    args, weights, names = _checked_conversion(source, plan, options)
    if dry_run:
        return args
    state = _converted_state(weights, names, args, options)
    provenance = {
        "source": source_name or str(source.folder),
        "architecture": source.architecture,
        "n_source_layers": source.n_layers,
        "options": dataclasses.asdict(options),
    }
    fetched = source.folder / FETCH_RECORD
    if fetched.is_file():  # a source written by tools/fetch_smollm2.sh: where its weights came from
        provenance["fetched"] = json.loads(fetched.read_text())
    write_atomically(output, lambda tmp: _write_folder(tmp, args, state, source.folder, provenance), kind="conversion")
    return args


def converted_state_dict(
    source: SourceModel,
    plan: LayerPlan,
    options: ConvertOptions = ConvertOptions(),
    weights: SourceWeights | None = None,
) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """What ``convert`` writes, in memory: the converted ModelArgs and state dict, checked the same way.

    weights: the source tensors by HF name; default the source folder's safetensors. Tools that
    convert many candidates pass tensors already in memory (a SourceWeights subclass).
    """
    args, weights, names = _checked_conversion(source, plan, options, weights)
    return args, _converted_state(weights, names, args, options)


def check_tokenizer(source: SourceModel) -> None:
    """The tokenizer a source ships produces no id past its embedding's rows (a larger, padded embedding is fine)."""
    try:
        check_vocab(load_tokenizer(source.folder), source.config["vocab_size"])
    except FileNotFoundError:  # no tokenizer files: none is copied either
        return
    except ValueError as err:  # ids past the embedding, or files that do not load
        raise ConversionError(str(err)) from None


def _checked_conversion(
    source: SourceModel, plan: LayerPlan, options: ConvertOptions, weights: SourceWeights | None = None
) -> tuple[ModelArgs, SourceWeights, dict[str, str | None]]:
    """The converted ModelArgs and tensor names, after checking the plan, options and source tensors."""
    if plan.n_source_layers != source.n_layers:
        raise ConversionError(f"the plan is for {plan.n_source_layers} layers; the source has {source.n_layers}")
    _check_options(options)
    args = hf_config_to_model_args(source, plan, options)
    weights = weights if weights is not None else SourceWeights(source.folder)
    shapes = target_shapes(args)
    names = source_tensor_names(shapes, plan, source.tied)
    _check_weights(weights, names, shapes, source, args.tie_embeddings)
    return args, weights, names


def _check_options(options: ConvertOptions) -> None:
    if options.dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {options.dtype!r}; choose from {', '.join(DTYPES)}")
    if options.mean_recurrence < 1:
        raise ConversionError(f"mean recurrence must be >= 1, got {options.mean_recurrence}")
    if options.state_std is not None and not options.state_std > 0:
        raise ConversionError(f"state std must be > 0, got {options.state_std}")


def _converted_state(
    weights: SourceWeights, names: dict[str, str | None], args: ModelArgs, options: ConvertOptions
) -> dict[str, torch.Tensor]:
    """Renamed source tensors plus the new adapter, cast to the requested dtype; no shared storage."""
    # dtype "source" keeps each tensor's stored dtype; the new adapter takes the embedding's.
    adapter_dtype = DTYPES[options.dtype] or weights.get("model.embed_tokens.weight").dtype
    state = {}
    for target, name in progress(names.items(), desc="convert", unit="tensor", total=len(names)):
        if name is None:
            state[target] = adapter_weight(args.dim, args.adapter_init, options.seed).to(adapter_dtype)
        else:
            tensor = weights.get(name)
            state[target] = tensor.to(DTYPES[options.dtype] or tensor.dtype)
    if "lm_head.weight" in state and names["lm_head.weight"] == names["embed_tokens.weight"]:
        # A tied source, untied here: both reads return the same (mmapped) memory, which safetensors refuses.
        state["lm_head.weight"] = state["lm_head.weight"].clone()
    return state


def _write_folder(
    folder: Path, args: ModelArgs, state: dict[str, torch.Tensor], source: Path, provenance: dict[str, Any]
) -> None:
    copied = write_model_folder(folder, args, state, source)
    # Llama-3 hub repos keep the tiktoken ranks file under original/.
    if "tokenizer.model" not in copied and (source / "original" / "tokenizer.model").is_file():
        shutil.copy2(source / "original" / "tokenizer.model", folder / "tokenizer.model")
    (folder / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")


# ---------------------------------------------------------------- summary


def format_summary(source: SourceModel, args: ModelArgs, source_name: str | None = None) -> str:
    """What the conversion keeps, drops and costs, for the CLI."""
    layers = args.source_layers
    scaling = args.rope_scaling or {}
    lines = [
        f"source        {source_name or source.folder}",
        f"architecture  {source.architecture}: {source.n_layers} layers, dim {args.dim}, "
        f"{args.n_heads} heads / {args.n_kv_heads} kv, ffn {args.ffn_dim}, vocab {args.vocab_size}, "
        f"{'tied' if source.tied else 'untied'} embeddings, rope theta {args.rope_theta:g}"
        + (f" + {scaling.get('rope_type', scaling.get('type'))} scaling" if scaling else ""),
    ]
    window = source.window
    if window is not None and window == args.max_seq_len:
        lines.append(
            f"max_seq_len   {window}: the source's sliding attention window (titan_recur attends over the whole "
            "sequence, equal to the source's attention up to the window; longer runs are refused)"
        )
    for part in ("prelude", "core", "coda", "dropped"):
        lines.append(f"{part:<13} {len(layers[part]):>2} layers  source {format_layers(layers[part])}")
    if args.is_recurrent:
        std = f"std {args.effective_state_std:.4g}" if args.state_init == "normal" else ""
        lines.append(f"recurrence    adapter {args.adapter_init}, state init {args.state_init} {std}".rstrip())
    else:
        lines.append("recurrence    none (static model: the kept layers as one plain stack)")
    counts = param_counts(args)
    for part, n in {**dataclasses.asdict(counts), "total": counts.total}.items():
        note = " (tied to embedding)" if part == "head" and args.tie_embeddings else ""
        lines.append(f"params {part:<10} {n:>15,}{note}")
    depth = f"effective depth  r=1: {args.effective_depth(1)} blocks"
    if args.is_recurrent:
        depth += f"; r={args.mean_recurrence} (mean recurrence): {args.effective_depth(args.mean_recurrence)} blocks"
    lines.append(depth)
    return "\n".join(lines)
