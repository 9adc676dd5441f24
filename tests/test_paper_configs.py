"""The paper's train configs (train_configs/*.toml): hyperparameters, meta-device parameter counts, FLOPs.

The configs point model.path at converted folders that only exist after a download, so the model
is built from the matching preset (--model.path none --model.preset P --model.shape ...) or, for
tools/flops.py, from stand-in folders holding just the converted config.json.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_recur.config import config_to_dict, load_config
from titan_recur.flops import TrainingRun, block_params, param_counts, training_flops_per_token
from titan_recur.models.args import PRESETS
from titan_recur.models.io import resolve_model_args, write_model_args
from titan_recur.models.model import RecurrentLM
from titan_recur.recurrence import RecurrenceSchedule

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"
FLOPS_TOOL = REPO / "tools" / "flops.py"

# config stem -> (preset, shape); static baselines keep every layer as one plain stack.
RECURRENT = {
    "tinyllama": ("tinyllama-1.1b", (4, 8, 4)),
    "llama3_2_1b": ("llama3.2-1b", (4, 6, 4)),
    "llama3_2_1b_2_4_2": ("llama3.2-1b", (2, 4, 2)),
    "olmo2_1b": ("olmo2-1b", (4, 6, 4)),
    "tinyllama_cc_math": ("tinyllama-1.1b", (4, 8, 4)),
    "llama3_2_1b_cc_math": ("llama3.2-1b", (4, 6, 4)),
    "olmo2_1b_cc_math": ("olmo2-1b", (4, 6, 4)),
}
STATIC = {
    "tinyllama_static": "tinyllama-1.1b",
    "llama3_2_1b_static": "llama3.2-1b",
    "olmo2_1b_static": "olmo2-1b",
    "tinyllama_static_cc_math": "tinyllama-1.1b",
    "llama3_2_1b_static_cc_math": "llama3.2-1b",
    "olmo2_1b_static_cc_math": "olmo2-1b",
}
PAPER = {**RECURRENT, **{name: (preset, (PRESETS[preset].n_layers, 0, 0)) for name, preset in STATIC.items()}}
# Each static baseline and the recurrent config it is compared with.
TWINS = {
    "tinyllama_static": "tinyllama",
    "llama3_2_1b_static": "llama3_2_1b",
    "olmo2_1b_static": "olmo2_1b",
    "tinyllama_static_cc_math": "tinyllama_cc_math",
    "llama3_2_1b_static_cc_math": "llama3_2_1b_cc_math",
    "olmo2_1b_static_cc_math": "olmo2_1b_cc_math",
}

# Parameters of one source-model block (SPEC section 2 facts), written out by hand.
D = 2048
PER_LAYER = {
    # q, o: d x d; k, v: d x 256 (4 kv heads x 64); SwiGLU 3 x d x 5632; two RMSNorms.
    "tinyllama-1.1b": 2 * D * D + 2 * D * 256 + 3 * D * 5632 + 2 * D,
    # q, o: d x d; k, v: d x 512 (8 kv heads x 64); SwiGLU 3 x d x 8192; two RMSNorms.
    "llama3.2-1b": 2 * D * D + 2 * D * 512 + 3 * D * 8192 + 2 * D,
    # MHA q, k, v, o: d x d; SwiGLU 3 x d x 8192; two post-norms; q_norm and k_norm over d each.
    "olmo2-1b": 4 * D * D + 3 * D * 8192 + 2 * D + 2 * D,
}
# Whole source models as published (HF parameter counts); Llama-3.2-1B ties its embeddings.
SOURCE_TOTAL = {"tinyllama-1.1b": 1_100_048_384, "llama3.2-1b": 1_235_814_400}

TOKENS_PER_STEP = 2**20
# SPEC section 4: paper-convention FLOPs of TinyLlama 4,8,4 over 50k steps at train mean 32, and static.
# (The other means, 4/8/16, are checked from the presets in tests/test_flops.py.)
TINYLLAMA_PAPER_FLOPS = 1.22e21
TINYLLAMA_STATIC_PAPER_FLOPS = 3.05e20


def preset_overrides(name: str) -> list[str]:
    preset, shape = PAPER[name]
    return ["--model.path", "none", "--model.preset", preset, "--model.shape", ",".join(map(str, shape)),
            "--model.init", "random"]


def load(name: str, *overrides: str):
    return load_config(str(CONFIGS / f"{name}.toml"), list(overrides))


def test_every_config_is_covered():
    assert {p.stem for p in CONFIGS.glob("*.toml")} - {"debug_model"} == set(PAPER)
    assert set(TWINS) == set(STATIC)


# ---------------------------------------------------------------- what the files say


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_hyperparameters(name):
    cfg = load(name)  # as written: model.path set, validation passes
    t, o, s, c = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.checkpoint
    assert t.steps == 50_000
    assert t.seq_len == 1024
    assert t.global_batch_size * t.seq_len == TOKENS_PER_STEP
    assert t.global_batch_size % (t.local_batch_size * 64) == 0  # 64 GPUs: no gradient accumulation
    assert t.max_norm == 1.0
    assert (t.mixed_precision_param, t.mixed_precision_reduce) == ("bfloat16", "float32")
    assert t.compile and t.ac_mode == "per_iteration"
    assert (o.name, o.lr, o.momentum, o.nesterov, o.ns_steps, o.weight_decay) == ("muon", 1e-3, 0.95, True, 5, 1e-4)
    assert (o.adamw_lr, o.adamw_betas, o.adamw_weight_decay) == (5e-5, (0.9, 0.95), 1e-4)
    # WSD within SPEC's ranges: warmup 0.25-0.5% of steps, decay over the last 60-90%, to 0.001 lr.
    assert 0.0025 <= s.warmup_fraction <= 0.005 and 0.6 <= s.decay_fraction <= 0.9
    assert (s.decay_type, s.min_lr_factor) == ("cosine", 0.001)
    assert c.enable and c.interval == 1000 and c.keep_latest_k == 3
    assert cfg.job.dump_folder == f"./outputs/{name}"


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrence_schedule(name):
    r = load(name).recurrence
    assert (r.curriculum, r.warmup_fraction, r.mean_recurrence, r.backprop_depth) == ("1-sqrt", 0.75, 32, 8)
    assert (r.start, r.sigma, r.seed, r.backprop_curriculum) == (1, 0.5, 514229, False)


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_baseline_matches_its_twin(name):
    """Same data, optimizer, schedule and batch as the recurrent run; no recurrence."""
    static, twin = config_to_dict(load(name)), config_to_dict(load(TWINS[name]))
    assert (static["recurrence"]["curriculum"], static["recurrence"]["mean_recurrence"]) == ("none", 1)
    for section in ("job", "model", "recurrence"):
        static.pop(section), twin.pop(section)
    assert static == twin


@pytest.mark.parametrize("base", ["tinyllama", "llama3_2_1b", "olmo2_1b"])
def test_variants_differ_only_where_expected(base):
    """The 2,4,2 shape changes the model only; the CC-Math runs change the data only."""
    ref = config_to_dict(load(base))
    variants = {f"{base}_cc_math": "data"}
    if base == "llama3_2_1b":
        variants["llama3_2_1b_2_4_2"] = "model"
    for name, differs in variants.items():
        other = config_to_dict(load(name))
        for section in ("job", differs):
            other.pop(section)
        assert other == {k: v for k, v in ref.items() if k not in ("job", differs)}, name


HEALING = {"name": "fineweb-edu", "path": "HuggingFaceFW/fineweb-edu", "kind": "hf", "hf_config": "sample-350BT"}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_data(name):
    data = config_to_dict(load(name))["data"]
    keys = ("name", "path", "kind", "hf_config")
    if name.endswith("cc_math"):
        assert data["phases"] == []
        [source] = data["sources"]
        assert {k: source[k] for k in keys} == {
            "name": "nemotron-cc-math", "path": "nvidia/Nemotron-CC-Math-v1", "kind": "hf", "hf_config": "4plus",
        }
        return
    assert data["sources"] == []
    healing, mix = data["phases"]
    assert healing["start_step"] == 0 and 0 < mix["start_step"] < 50_000
    assert [{k: s[k] for k in keys} for s in healing["sources"]] == [HEALING]
    # The mix: 1:1:1 FineWeb-Edu (the same stream, so it continues), SFT General and SFT Math.
    assert [{k: s[k] for k in keys} for s in mix["sources"]] == [
        HEALING,
        {"name": "sft-general", "path": "nvidia/Nemotron-Pretraining-SFT-v1", "kind": "hf",
         "hf_config": "Nemotron-SFT-General"},
        {"name": "sft-math", "path": "nvidia/Nemotron-Pretraining-SFT-v1", "kind": "hf",
         "hf_config": "Nemotron-SFT-MATH"},
    ]
    assert len({s["weight"] for s in mix["sources"]}) == 1
    assert healing["sources"][0]["text_field"] == mix["sources"][0]["text_field"]


def _load_module(name: str, path: Path):
    """A tools/ script as a module (once; registered first, as dataclasses need)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("name", sorted(PAPER))
def test_convert_command_in_comment(name):
    """The documented convert command writes exactly the folder model.path names, with this shape."""
    text = (CONFIGS / f"{name}.toml").read_text()
    [line] = [ln for ln in text.splitlines() if "tools/convert_hf.py" in ln]
    argv = shlex.split(line.lstrip("# "))
    assert argv[:2] == ["python", "tools/convert_hf.py"]
    source, output, *flags = argv[2:]
    preset, (p, r, c) = PAPER[name]
    assert source == PRESETS[preset].hf_id
    assert output == load(name).model.path
    assert flags == (["--static"] if r == 0 else ["--shape", f"{p},{r},{c}"])
    parser = _load_module("convert_hf_tool", REPO / "tools" / "convert_hf.py").build_parser()
    parser.parse_args([source, output, *flags])


# ---------------------------------------------------------------- the model each config trains


@pytest.mark.parametrize("name", sorted(PAPER))
def test_meta_model_matches_source_model(name):
    cfg = load(name, *preset_overrides(name))
    args = resolve_model_args(cfg.model)
    preset, (p, r, c) = PAPER[name]
    assert (args.n_prelude, args.n_core, args.n_coda) == (p, r, c)
    with torch.device("meta"):
        model = RecurrentLM(args)
    counts = param_counts(args)

    def numel(module) -> int:
        return sum(x.numel() for x in module.parameters()) if module is not None else 0

    unique = {id(x): x.numel() for x in model.parameters()}
    assert sum(unique.values()) == counts.total
    per_layer = PER_LAYER[preset]
    assert block_params(args) == per_layer
    for block in [*model.prelude, *model.coda, *(model.core.blocks if model.core is not None else [])]:
        assert numel(block) == per_layer
    assert numel(model.prelude) == counts.prelude == p * per_layer
    assert numel(model.coda) == counts.coda == c * per_layer
    assert (numel(model.core.blocks) if model.core is not None else 0) == counts.core == r * per_layer
    assert (numel(model.core.adapter) if model.core is not None else 0) == counts.adapter == (2 * D * D if r else 0)
    assert numel(model.embed_tokens) == counts.embedding == args.vocab_size * D
    assert numel(model.lm_head) == counts.head == args.vocab_size * D  # untied: a tied source is copied
    if r == 0:
        # The static baseline is the whole source model.
        n_layers = PRESETS[preset].n_layers
        assert counts.non_embedding == n_layers * per_layer + D
        if preset in SOURCE_TOTAL:
            tied = preset == "llama3.2-1b"
            assert counts.total == SOURCE_TOTAL[preset] + (args.vocab_size * D if tied else 0)


def test_tinyllama_static_non_embedding_params():
    """SPEC section 4: the static TinyLlama has 968,976,384 non-embedding parameters."""
    args = resolve_model_args(load("tinyllama_static", *preset_overrides("tinyllama_static")).model)
    assert param_counts(args).non_embedding == 968_976_384


# ---------------------------------------------------------------- FLOPs under the paper's convention


def paper_flops(name: str, *overrides: str) -> float:
    cfg = load(name, *preset_overrides(name), *overrides)
    tokens = cfg.training.global_batch_size * cfg.training.seq_len
    run = TrainingRun(resolve_model_args(cfg.model), RecurrenceSchedule.from_config(cfg.recurrence, cfg.training.steps), tokens, cfg.training.seq_len)
    return run.cumulative_flops(cfg.training.steps, "paper")


def test_tinyllama_static_paper_flops():
    assert paper_flops("tinyllama_static") == pytest.approx(TINYLLAMA_STATIC_PAPER_FLOPS, rel=0.01)


@pytest.fixture(scope="module")
def converted_standins(tmp_path_factory):
    """A working directory where every config's model.path holds a converted config.json (no weights).

    tools/flops.py reads the architecture from model.path; the real folders need a download.
    """
    root = tmp_path_factory.mktemp("cluster_checkout")
    (root / "train_configs").symlink_to(CONFIGS)
    for name, (preset, shape) in PAPER.items():
        folder = root / load(name).model.path
        folder.mkdir(parents=True, exist_ok=True)
        write_model_args(PRESETS[preset].model_args(*shape), folder)
    return root


def test_flops_cli_matched_static_steps(converted_standins):
    """`tools/flops.py --config tinyllama.toml --match tinyllama_static.toml`: the paper's numbers."""
    argv = ["--config", "train_configs/tinyllama.toml", "--match", "train_configs/tinyllama_static.toml",
            "--world-size", "64", "--json"]
    result = subprocess.run([sys.executable, str(FLOPS_TOOL), *argv], cwd=converted_standins,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["steps"], out["tokens_per_step"], out["micro_steps"]) == (50_000, TOKENS_PER_STEP, 1)
    assert out["params"]["core"] == 8 * PER_LAYER["tinyllama-1.1b"]
    assert out["paper_flops"] == pytest.approx(TINYLLAMA_PAPER_FLOPS, rel=0.01)
    matched = out["matched_steps"]
    assert "tinyllama_static" in matched["other"]
    # A static step costs 6 * N_nonembedding * tokens; over 50k steps that is SPEC's 3.05e20.
    static_step = 6 * 968_976_384 * TOKENS_PER_STEP
    assert static_step * 50_000 == pytest.approx(TINYLLAMA_STATIC_PAPER_FLOPS, rel=0.01)
    assert matched["paper"] == pytest.approx(out["paper_flops"] / static_step, rel=1e-9)
    ratio = TINYLLAMA_PAPER_FLOPS / TINYLLAMA_STATIC_PAPER_FLOPS
    assert matched["paper"] == pytest.approx(50_000 * ratio, rel=0.01)  # ~200k static steps
    # The full convention (attention, adapter, head, sampled depths): the same division by the static step.
    static_args = PRESETS["tinyllama-1.1b"].model_args(22, 0, 0)
    full_static_step = training_flops_per_token(static_args, (0, 0), 1024).total * TOKENS_PER_STEP
    assert matched["full"] == pytest.approx(out["full_flops"] / full_static_step, rel=1e-9)


@pytest.mark.parametrize("static", ["tinyllama_static", "llama3_2_1b_static", "olmo2_1b_static"])
def test_equal_flops_checkpoint(static):
    """The step of the recurrent run that has spent as many paper FLOPs as the whole static run.

    (What `tools/flops.py --config <static> --match <recurrent>` reports: the checkpoint to compare
    with the static model at equal training FLOPs.) The CC-Math pairs have the same model, batch and
    schedule (test_variants_differ_only_where_expected), hence the same numbers.
    """
    twin = TWINS[static]
    static_total = paper_flops(static)
    cfg = load(twin, *preset_overrides(twin))
    run = TrainingRun(resolve_model_args(cfg.model), RecurrenceSchedule.from_config(cfg.recurrence, cfg.training.steps), TOKENS_PER_STEP, 1024)
    steps = run.steps_for_flops(static_total, "paper")
    assert 0 < steps < cfg.training.steps
    whole = math.floor(steps)
    assert run.cumulative_flops(whole, "paper") <= static_total <= run.cumulative_flops(whole + 1, "paper")


def test_config_comments_name_existing_files():
    """The commands in the configs' comments refer to configs and scripts that exist."""
    for path in (CONFIGS / f"{name}.toml" for name in PAPER):
        comments = "\n".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#"))
        for ref in re.findall(r"(?:train_configs|slurm|tools)/[\w.]+\.(?:toml|sh|py)", comments):
            assert (REPO / ref).is_file(), (path.name, ref)
        assert "--world-size 64" in comments  # the flops commands must not replay 64 micro-steps per step
