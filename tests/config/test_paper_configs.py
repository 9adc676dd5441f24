"""The paper's train configs (train_configs/*.toml): hyperparameters, models, optimizers, FLOPs, commands.

Expected values are the paper's, as its authors' public training code runs them (its train.py and
shells/*.sh) and as its result files store them; they are written out here, not derived from
titan_recur. The configs point model.path at converted folders that only exist after a download, so
the model is built from the matching preset (--model.path none --model.preset P --model.shape ...) or,
for tools/flops.py, from stand-in folders holding just the converted config.json.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from tests.tiny_models import tiny_args
from tests.tiny_models import tiny_model as shared_tiny_model
from titan_recur.config import Recurrence, config_from_dict, config_to_dict, load_config, parse_args
from titan_recur.models.args import PRESETS
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.model_io import resolve_model_args, write_model_args
from titan_recur.training.cost_model import (
    TrainingRun,
    block_params,
    paper_flops_per_token,
    param_counts,
    training_flops_per_token,
)
from titan_recur.training.optim import Muon, build_optimizers
from titan_recur.training.recurrence import RecurrenceSchedule

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "train_configs"
FLOPS_TOOL = REPO / "tools" / "flops.py"
CLUSTER_DOC = REPO / "docs" / "cluster.md"
# Every train config as the self-contained file it was before the configs became bases + deltas.
BEFORE_COMPOSITION = json.loads((REPO / "tests" / "fixtures" / "train_configs_before_composition.json").read_text())

MODELS = {  # config prefix -> (preset, recurrent shape)
    "tinyllama": ("tinyllama-1.1b", (4, 8, 4)),
    "llama3_2_1b": ("llama3.2-1b", (4, 6, 4)),
    "olmo2_1b": ("olmo2-1b", (4, 6, 4)),
}
HUB_IDS = {
    "tinyllama-1.1b": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B",
    "olmo2-1b": "allenai/OLMo-2-0425-1B",
}
# The paper converted OLMo-2 from the end of stage-1 pretraining (its utils/download_to_local.py).
OLMO_REVISION = "stage1-step1907359-tokens4001B"
PAPER_STATE_STD = "0.008703882797784892"  # sqrt(2 / (5 * 5280)), the reference's monkeypatched state std

# Recipes: (steps, LR warmup, LR decay, (curriculum, warmup fraction, mean)). The reference's shells:
# CC-Math (Figs. 5-7) --max_steps=50000 --scheduler_args.warmup=0.0025 --scheduler_args.cooldown=0.6
#   --mean_recurrence_schedule.warmup=0.75 --mean_recurrence_schedule.warmup_type="1-sqrt";
# Fig. 8 --max_steps=25000 --scheduler_args.warmup=0.005 --scheduler_args.cooldown=0.9
#   --mean_recurrence_schedule.warmup=0.25 (linear, its default), max_mean_rec 32 (default) in phase
#   one, 4 in phase two. "onerun" is this project's own single-run healing + mix.
RECIPES = {
    "cc_math": (50_000, 0.0025, 0.6, ("1-sqrt", 0.75, 32)),
    "healing": (25_000, 0.005, 0.9, ("linear", 0.25, 32)),
    "mixture": (25_000, 0.005, 0.9, ("linear", 0.25, 4)),
    "onerun": (50_000, 0.005, 0.75, ("1-sqrt", 0.75, 32)),
}


def _family(name: str) -> str:
    return next((f for f in ("cc_math", "healing", "mixture") if name.endswith(f)), "onerun")


RECURRENT = {
    "tinyllama": MODELS["tinyllama"],
    "llama3_2_1b": MODELS["llama3_2_1b"],
    "llama3_2_1b_2_4_2": ("llama3.2-1b", (2, 4, 2)),
    "olmo2_1b": MODELS["olmo2_1b"],
    **{f"{m}_{f}": MODELS[m] for m in MODELS for f in ("cc_math", "healing", "mixture")},
}
STATIC = {
    **{f"{m}_static": MODELS[m][0] for m in MODELS},
    **{f"{m}_static_cc_math": MODELS[m][0] for m in MODELS},
    "tinyllama_static_healing": "tinyllama-1.1b",
    "tinyllama_static_mixture": "tinyllama-1.1b",
}
PAPER = {**RECURRENT, **{name: (preset, (PRESETS[preset].n_layers, 0, 0)) for name, preset in STATIC.items()}}
TWINS = {name: name.replace("_static", "") for name in STATIC}  # static baseline -> its recurrent run
# Runs that start from another run's final model (the paper's phase two) -> that run.
CHAINED = {name: name.replace("_mixture", "_healing") for name in PAPER if name.endswith("_mixture")}

# Parameters of one source-model block, written out by hand.
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
# Paper-convention FLOPs of TinyLlama 4,8,4 over 50k steps at train mean 32, and of its static model
# (docs/method.md); the other means are checked below and in tests/training/test_cost_model.py.
TINYLLAMA_PAPER_FLOPS = 1.22e21
TINYLLAMA_STATIC_PAPER_FLOPS = 3.05e20


def preset_overrides(name: str) -> list[str]:
    preset, shape = PAPER[name]
    return [
        "--model.path",
        "none",
        "--model.preset",
        preset,
        "--model.shape",
        ",".join(map(str, shape)),
        "--model.init",
        "random",
    ]


def load(name: str, *overrides: str):
    return load_config(str(CONFIGS / f"{name}.toml"), list(overrides))


def test_every_config_is_covered():
    assert {p.stem for p in CONFIGS.glob("*.toml")} - {"debug_model"} == set(PAPER)
    assert all(twin in RECURRENT for twin in TWINS.values())


@pytest.mark.parametrize("name", sorted(BEFORE_COMPOSITION["configs"]))
def test_composed_configs_resolve_as_before(name):
    """Each config (a recipe of train_configs/base/ plus its delta) resolves to exactly the values of
    the self-contained file it replaced (tests/fixtures: those files, parsed, at the commit named there)."""
    before = config_to_dict(config_from_dict(BEFORE_COMPOSITION["configs"][name], source="before"))
    assert config_to_dict(load(name)) == before


def test_paper_configs_are_deltas_of_a_recipe():
    """The paper configs set only the run's name, description, model and (Figure 8) curriculum."""
    for name in PAPER:
        own = tomllib.loads((CONFIGS / f"{name}.toml").read_text())
        assert own.pop("extends")
        assert set(own) <= {"job", "model", "recurrence"}, name
        assert set(own["job"]) == {"dump_folder", "description"}, name


# ---------------------------------------------------------------- what the files say


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_hyperparameters(name):
    cfg = load(name)  # as written: model.path set, validation passes
    t, o, s, c = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.checkpoint
    steps, warmup, decay, _ = RECIPES[_family(name)]
    assert (t.steps, s.warmup_fraction, s.decay_fraction) == (steps, warmup, decay)
    assert (s.decay_type, s.min_lr_factor) == ("cosine", 0.001)
    assert t.seq_len == 1024
    assert t.global_batch_size * t.seq_len == TOKENS_PER_STEP
    assert t.global_batch_size % (t.local_batch_size * 64) == 0  # 64 GPUs: no gradient accumulation
    assert t.max_norm == 1.0
    assert (t.mixed_precision_param, t.mixed_precision_reduce, t.mixed_precision_mode) == (
        "bfloat16",
        "float32",
        "fsdp",
    )
    assert t.compile and t.ac_mode == "per_iteration"
    assert (o.name, o.lr, o.momentum, o.nesterov, o.ns_steps, o.weight_decay) == ("muon", 1e-3, 0.95, True, 5, 1e-4)
    assert (o.adamw_lr, o.adamw_betas, o.adamw_eps, o.adamw_weight_decay) == (5e-5, (0.9, 0.95), 1e-10, 1e-4)
    assert o.fuse_qkv == (name in RECURRENT)  # the reference fuses the recurrent models' matrices only
    assert c.enable and c.interval == 1000 and c.keep_latest_k == 3
    assert cfg.job.dump_folder == f"./outputs/{name}"


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrence_schedule(name):
    r = load(name).recurrence
    assert (r.curriculum, r.warmup_fraction, r.mean_recurrence) == RECIPES[_family(name)][3]
    assert (r.backprop_depth, r.start, r.sigma, r.seed, r.mean_offset, r.backprop_curriculum) == (
        8,
        1,
        0.5,
        514229,
        True,
        False,
    )


def test_cc_math_lr_factor_is_the_references():
    """The reference's LR: transformers' warmup_stable_decay with num_warmup_steps = ceil(0.0025 * 50k) =
    125, num_decay_steps = ceil(0.6 * 50k) = 30,000, min_lr_ratio 0.001: factor(s) = 0.001 + 0.999 * f,
    f = s / 125 in warmup, 1 until 20,000, then 0.5 (1 + cos(pi (s - 20,000) / 30,000)), 0.001 from 50k.

    Step 30,000 is 1/3 into the decay: 0.001 + 0.999 * 0.75 = 0.75025 (the old 0.75 decay gave 0.553).
    """
    expected = {0: 0.001, 100: 0.001 + 0.999 * 100 / 125, 30_000: 0.75025, 50_000: 0.001}
    for name in ("tinyllama_cc_math", "llama3_2_1b_static_cc_math"):
        cfg = load(name)
        optimizers = build_optimizers(tiny_model(False), cfg.optimizer, cfg.lr_scheduler, cfg.training.steps)
        factor = optimizers.lr_schedulers[0].lr_lambdas[0]
        for step, value in expected.items():
            assert factor(step) == pytest.approx(value, abs=1e-12), (name, step)
        assert factor(30_000) < 0.76


def test_schedules_read_the_curriculum_where_the_reference_does():
    """1-sqrt to 32 over 37,500 of 50k updates: r reaches 2, 3, 4 at updates 2,309, 4,543, 6,703 (the
    reference reads r(u - 1) = ceil(32 (1 - sqrt(1 - (u - 1) / 37,500))); see tests/training/test_recurrence.py)."""
    cfg = load("tinyllama_cc_math")
    schedule = RecurrenceSchedule.from_config(cfg.recurrence, cfg.training.steps)
    assert [schedule.mean(u) for u in (2308, 2309, 4542, 4543, 6702, 6703)] == [1, 2, 2, 3, 3, 4]


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_baseline_matches_its_twin(name):
    """Same data, schedule and batch as the recurrent run; no recurrence; Muon on separate matrices."""
    static, twin = config_to_dict(load(name)), config_to_dict(load(TWINS[name]))
    assert (static["recurrence"]["curriculum"], static["recurrence"]["mean_recurrence"]) == ("none", 1)
    assert (static["optimizer"].pop("fuse_qkv"), twin["optimizer"].pop("fuse_qkv")) == (False, True)
    # A static model's loss does not depend on r: it validates at r = 1 only.
    assert (static["validation"].pop("recurrences"), twin["validation"].pop("recurrences")) == ([1], [1, 4, 8, 16, 32])
    for section in ("job", "model", "recurrence"):
        static.pop(section), twin.pop(section)
    assert static == twin


@pytest.mark.parametrize("base", sorted(MODELS))
def test_variants_differ_only_where_expected(base):
    """2,4,2 changes the model; CC-Math changes data and LR schedule; the mixture (phase two) changes the
    model (the healing run's export), the target mean and the data of the healing run."""
    ref = config_to_dict(load(base))
    variants = {f"{base}_cc_math": ("data", "lr_scheduler")}
    if base == "llama3_2_1b":
        variants["llama3_2_1b_2_4_2"] = ("model",)
    for name, differs in variants.items():
        other = config_to_dict(load(name))
        for section in ("job", *differs):
            other.pop(section)
        assert other == {k: v for k, v in ref.items() if k not in ("job", *differs)}, name
    for mixture, healing in CHAINED.items():
        if mixture.startswith(base):
            a, b = config_to_dict(load(mixture)), config_to_dict(load(healing))
            assert a["model"]["path"] == f"outputs/{healing}/final_model"
            assert a["recurrence"].pop("mean_recurrence") in (1, 4)
            b["recurrence"].pop("mean_recurrence")
            for d in (a, b):
                d.pop("job"), d["model"].pop("path"), d.pop("data")
            assert a == b, mixture


FINEWEB = {"name": "fineweb-edu", "path": "HuggingFaceFW/fineweb-edu", "kind": "hf", "hf_config": "sample-350BT"}
MIX = [
    FINEWEB,
    {
        "name": "sft-general",
        "path": "nvidia/Nemotron-Pretraining-SFT-v1",
        "kind": "hf",
        "hf_config": "Nemotron-SFT-General",
    },
    {"name": "sft-math", "path": "nvidia/Nemotron-Pretraining-SFT-v1", "kind": "hf", "hf_config": "Nemotron-SFT-MATH"},
]
KEYS = ("name", "path", "kind", "hf_config")


def _sources(sources: list[dict]) -> list[dict]:
    return [{k: s[k] for k in KEYS} for s in sources]


@pytest.mark.parametrize("name", sorted(PAPER))
def test_data(name):
    data = config_to_dict(load(name))["data"]
    family = _family(name)
    if family != "onerun":
        assert data["phases"] == []
        expected = {
            "cc_math": [
                {"name": "nemotron-cc-math", "path": "nvidia/Nemotron-CC-Math-v1", "kind": "hf", "hf_config": "4plus"}
            ],
            "healing": [FINEWEB],
            "mixture": MIX,
        }[family]
        assert _sources(data["sources"]) == expected
        assert len({s["weight"] for s in data["sources"]}) == 1
        return
    assert data["sources"] == []
    healing, mix = data["phases"]
    assert healing["start_step"] == 0 and 0 < mix["start_step"] < 50_000
    assert _sources(healing["sources"]) == [FINEWEB]
    # The mix: 1:1:1 FineWeb-Edu (the same stream, so it continues), SFT General and SFT Math.
    assert _sources(mix["sources"]) == MIX
    assert len({s["weight"] for s in mix["sources"]}) == 1
    assert healing["sources"][0]["text_field"] == mix["sources"][0]["text_field"]


def convert_tool():
    from titan_recur.cli import convert

    return convert


def flops_tool():
    from titan_recur.cli import flops

    return flops


def check_convert_command(argv: list[str], preset: str, shape: tuple[int, int, int], output: str):
    """A documented convert_hf.py command: the source model, the output folder, the layers, the revision."""
    assert argv[:2] == ["python", "tools/convert_hf.py"]
    ns = convert_tool().build_parser().parse_args(argv[2:])
    assert (ns.source, str(ns.output)) == (HUB_IDS[preset], output)
    p, r, c = shape
    assert (ns.static, ns.shape) == ((True, None) if r == 0 else (False, f"{p},{r},{c}"))
    assert ns.revision == (OLMO_REVISION if preset == "olmo2-1b" else None)
    return ns


@pytest.mark.parametrize("name", sorted(PAPER))
def test_convert_commands_in_comment(name):
    """The documented conversions write the folder model.path names, with this shape; a recurrent run
    offers this project's start and the paper's exact one (random adapter, state std 0.0087)."""
    lines = [ln for ln in (CONFIGS / f"{name}.toml").read_text().splitlines() if "tools/convert_hf.py" in ln]
    preset, shape = PAPER[name]
    if name in CHAINED:
        assert lines == []  # it starts from the healing run's final model
        assert load(name).model.path == f"outputs/{CHAINED[name]}/final_model"
        assert load(CHAINED[name]).job.dump_folder == f"./outputs/{CHAINED[name]}"
        return
    commands = [
        check_convert_command(shlex.split(ln.lstrip("# ")), preset, shape, load(name).model.path) for ln in lines
    ]
    if name in STATIC:
        assert len(commands) == 1
        return
    default, exact = commands
    assert (default.adapter_init, default.state_std) == ("identity", None)
    assert (exact.adapter_init, exact.state_std) == ("random", float(PAPER_STATE_STD))
    assert float(PAPER_STATE_STD) == pytest.approx(math.sqrt(2 / (5 * 5280)), rel=1e-15)


PAPER_RUNS = {n for n in PAPER if n.endswith("cc_math")} | {
    n for n in PAPER if n.startswith("tinyllama") and _family(n) in ("healing", "mixture")
}


def test_config_headers_name_the_paper_figure():
    """Each config says which paper figure it reproduces, or that it is not a paper run."""
    for name in PAPER:
        header = (CONFIGS / f"{name}.toml").read_text().split("\n[")[0]
        if name in PAPER_RUNS:
            assert re.search(r"Figures? \d", header) and "Not a paper run" not in header, name
        else:
            assert "Not a paper run" in header, name
        assert "SPEC" not in header, name


# ---------------------------------------------------------------- the model and optimizers each config trains


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
    for block in model.blocks():
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
    """docs/method.md: the static TinyLlama has 968,976,384 non-embedding parameters."""
    args = resolve_model_args(load("tinyllama_static", *preset_overrides("tinyllama_static")).model)
    assert param_counts(args).non_embedding == 968_976_384


def tiny_model(static: bool, block_type: str = "llama") -> RecurrentLM:
    """A tiny stand-in of a config's model (the presets are too big to step on a CPU)."""
    shape = dict(n_prelude=3, n_core=0, n_coda=0) if static else dict(n_prelude=1, n_core=2, n_coda=1)
    heads = dict(n_heads=4, n_kv_heads=4) if block_type == "olmo2" else dict(n_heads=4, n_kv_heads=2)
    return shared_tiny_model(tiny_args(64, block_type=block_type, **heads, **shape))


@pytest.mark.parametrize("name", sorted(PAPER))
def test_optimizers_built_from_the_config(name):
    """Muon on every block (and adapter) matrix; the static baselines orthogonalise HF's separate q, k, v,
    gate and up matrices, the recurrent runs the fused ones; the aux AdamW has the reference's eps 1e-10."""
    cfg = load(name)
    static = name in STATIC
    model = tiny_model(static, "olmo2" if name.startswith("olmo2") else "llama")
    optimizers = build_optimizers(model, cfg.optimizer, cfg.lr_scheduler, cfg.training.steps)
    muon, adamw = optimizers.optimizers
    assert isinstance(muon, Muon) and type(adamw) is torch.optim.AdamW
    assert [g["eps"] for g in adamw.param_groups] == [1e-10]
    blocks = [*model.prelude, *(model.core.blocks if model.core is not None else []), *model.coda]
    matrices = {id(p) for b in blocks for n, p in b.named_parameters() if p.ndim == 2}
    if not static:
        matrices.add(id(model.core.adapter.weight))
    assert {id(p) for g in muon.param_groups for p in g["params"]} == matrices
    assert {id(p) for g in adamw.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if id(p) not in matrices
    }
    fused = [[id(p) for p in members] for members in muon.fuse_groups]
    if static:
        assert fused == []
        return
    expected = []
    for b in blocks:
        attn, mlp = b.self_attn, b.mlp
        expected += [
            [id(attn.q_proj.weight), id(attn.k_proj.weight), id(attn.v_proj.weight)],
            [id(mlp.gate_proj.weight), id(mlp.up_proj.weight)],
        ]
    assert fused == expected


def test_adamw_eps_default_is_the_references():
    assert load_config(None, ["--model.path", "m"]).optimizer.adamw_eps == 1e-10


# ---------------------------------------------------------------- FLOPs under the paper's convention


def config_run(name: str, *overrides: str) -> TrainingRun:
    """The run tools/flops.py --config builds (its code path), from the preset instead of model.path."""
    setup = flops_tool().setup_from_config(str(CONFIGS / f"{name}.toml"), [*preset_overrides(name), *overrides], 64)
    assert (setup.tokens_per_step, setup.micro_steps) == (TOKENS_PER_STEP, 1)
    return setup.run()


def paper_flops(name: str, *overrides: str) -> float:
    cfg = load(name, *preset_overrides(name), *overrides)
    return config_run(name, *overrides).cumulative_flops(cfg.training.steps, "paper")


def test_tinyllama_static_paper_flops():
    assert paper_flops("tinyllama_static") == pytest.approx(TINYLLAMA_STATIC_PAPER_FLOPS, rel=0.01)


# The paper's result files (paper_plots/data/*.jsonl of its code): the FLOPs of the last evaluated
# checkpoint of each CC-Math run, by train mean, and of its static baseline; Figure 8's phase two.
PAPER_RESULT_FLOPS = {
    "tinyllama_cc_math": (50_000, {4: 3.775535372e20, 8: 5.975065763e20, 16: 8.480569261e20, 32: 1.217748875e21}),
    "llama3_2_1b_cc_math": (48_000, {4: 4.048031696e20, 8: 6.14238351e20, 16: 8.614852842e20, 32: 1.219880722e21}),
    "olmo2_1b_cc_math": (48_000, {4: 4.467038007e20, 8: 6.778173358e20, 16: 9.506564662e20, 32: 1.346148933e21}),
    "tinyllama_mixture": (25_000, {4: 2.563222143e20}),
}
PAPER_RESULT_STATIC_FLOPS = {
    "tinyllama_static_cc_math": (50_000, 304813614248755200000),
    "llama3_2_1b_static_cc_math": (48_000, 293880285370515456000),
    "olmo2_1b_static_cc_math": (48_000, 324299374064566272000),
    "tinyllama_static_mixture": (25_000, 152406807124377600000),
}


@pytest.mark.parametrize("name", sorted(PAPER_RESULT_FLOPS))
def test_paper_convention_flops_match_the_papers_results(name):
    """tools/flops.py --config, at the paper's checkpoints and train means, against its stored FLOPs.

    The paper's FLOP histogram (param_counter.warmup_hist) places the ramp one update later than its
    training loop reads it (train.py: update u runs r(u - 1)), so its numbers count, update for update,
    r(u) where this replay counts r(u - 1): the two differ by exactly one update, r(S) against r(0) = 1.
    Checked to 3e-6 after adding that update (the histogram's int() rounding), 3e-5 without it.
    """
    steps, by_mean = PAPER_RESULT_FLOPS[name]
    preset, shape = PAPER[name]
    args = PRESETS[preset].model_args(*shape)
    for mean, stored in by_mean.items():
        ours = config_run(name, "--recurrence.mean_recurrence", str(mean)).cumulative_flops(steps, "paper")
        one_update = TOKENS_PER_STEP * (paper_flops_per_token(args, mean) - paper_flops_per_token(args, 1))
        assert ours == pytest.approx(stored, rel=3e-5), (name, mean)
        assert ours + one_update == pytest.approx(stored, rel=3e-6), (name, mean)


@pytest.mark.parametrize("name", sorted(PAPER_RESULT_STATIC_FLOPS))
def test_static_paper_flops_match_the_papers_results(name):
    steps, stored = PAPER_RESULT_STATIC_FLOPS[name]
    assert config_run(name).cumulative_flops(steps, "paper") == pytest.approx(stored, rel=1e-12)


def test_paper_stored_totals_at_their_precision():
    """The paper's rounded totals (TinyLlama 4,8,4 to mean 4 / 8 / 16 / 32: 3.78e20 / 5.98e20 / 8.48e20 /
    1.22e21) are its result files' numbers to 3 digits; this replay is within 3e-5 of those (above)."""
    _, by_mean = PAPER_RESULT_FLOPS["tinyllama_cc_math"]
    assert {m: float(f"{v:.2e}") for m, v in by_mean.items()} == {4: 3.78e20, 8: 5.98e20, 16: 8.48e20, 32: 1.22e21}


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
    argv = [
        "--config",
        "train_configs/tinyllama.toml",
        "--match",
        "train_configs/tinyllama_static.toml",
        "--world-size",
        "64",
        "--json",
    ]
    result = subprocess.run(
        [sys.executable, str(FLOPS_TOOL), *argv], cwd=converted_standins, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["steps"], out["tokens_per_step"], out["micro_steps"]) == (50_000, TOKENS_PER_STEP, 1)
    assert out["params"]["core"] == 8 * PER_LAYER["tinyllama-1.1b"]
    assert out["paper_flops"] == pytest.approx(TINYLLAMA_PAPER_FLOPS, rel=0.01)
    assert out["paper_flops"] == pytest.approx(PAPER_RESULT_FLOPS["tinyllama_cc_math"][1][32], rel=3e-5)
    matched = out["matched_steps"]
    assert "tinyllama_static" in matched["other"]
    # A static step costs 6 * N_nonembedding * tokens; over 50k steps that is the paper's 3.05e20.
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
    curriculum, hence the same numbers.
    """
    twin = TWINS[static]
    static_total = paper_flops(static)
    run = config_run(twin)
    steps = run.steps_for_flops(static_total, "paper")
    assert 0 < steps < 50_000
    whole = math.floor(steps)
    assert run.cumulative_flops(whole, "paper") <= static_total <= run.cumulative_flops(whole + 1, "paper")


def test_config_comments_name_existing_files():
    """The commands in the configs' comments refer to configs and scripts that exist."""
    for path in (CONFIGS / f"{name}.toml" for name in PAPER):
        comments = "\n".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#"))
        for ref in re.findall(r"(?:train_configs|slurm|tools)/[\w.]+\.(?:toml|sh|py)", comments):
            assert (REPO / ref).is_file(), (path.name, ref)
        assert "--world-size 64" in comments  # the flops commands must not replay 64 micro-steps per step


# ---------------------------------------------------------------- docs/cluster.md: "Reproduce the paper"


def reproduce_table() -> list[list[str]]:
    """The table's rows as cells: paper run, convert, train, FLOPs."""
    text = CLUSTER_DOC.read_text()
    section = text.split("## Reproduce the paper", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| paper run")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def _command(cell: str) -> list[str] | None:
    found = re.fullmatch(r"`([^`]+)`", cell)
    return shlex.split(found.group(1)) if found else None


def train_argv(command: list[str]) -> tuple[str, list[str]]:
    """`CONFIG=X sbatch [sbatch options] slurm/S.sh [trainer args]` -> (script, trainer argv)."""
    env = dict(token.split("=", 1) for token in command if re.fullmatch(r"[A-Z_]+=\S+", token))
    rest = [token for token in command if not re.fullmatch(r"[A-Z_]+=\S+", token)]
    assert rest[0] == "sbatch"
    script = next(i for i, token in enumerate(rest) if token.endswith(".sh"))
    assert all(token.startswith("-") for token in rest[1:script])
    return rest[script], ["--config", str(REPO / env["CONFIG"]), *rest[script + 1 :]]


@pytest.fixture(scope="module")
def standin_sources(tmp_path_factory):
    """Tiny HF checkpoints with each source model's architecture and layer count (the hub ids are not
    reachable here), so the documented conversions can run --dry-run."""
    from transformers import LlamaConfig, LlamaForCausalLM, Olmo2Config, Olmo2ForCausalLM

    root = tmp_path_factory.mktemp("standin_sources")
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    builds = {
        "tinyllama-1.1b": (LlamaConfig, LlamaForCausalLM, dict(num_hidden_layers=22)),
        "llama3.2-1b": (LlamaConfig, LlamaForCausalLM, dict(num_hidden_layers=16, tie_word_embeddings=True)),
        "olmo2-1b": (Olmo2Config, Olmo2ForCausalLM, dict(num_hidden_layers=16)),
    }
    folders = {}
    for preset, (config_cls, model_cls, extra) in builds.items():
        torch.manual_seed(0)
        folders[HUB_IDS[preset]] = root / preset
        model_cls(config_cls(**tiny, **extra)).save_pretrained(folders[HUB_IDS[preset]])
    return folders


def test_reproduce_the_paper_table(standin_sources, tmp_path, capsys):
    """Every command in the table parses and checks out, and its FLOPs are what tools/flops.py computes.

    Conversions run --dry-run against a stand-in of the source (a tiny model with its layer count);
    trainer command lines load and validate their config with the overrides given.
    """
    rows = reproduce_table()
    configs = []
    for _run, convert, train, quoted in rows:
        script, argv = train_argv(_command(train))
        assert (REPO / script).is_file()
        cfg = parse_args(argv)
        name = Path(argv[1]).stem
        configs.append(name)
        assert cfg.training.mixed_precision_mode == "autocast"  # the paper's precision
        preset, shape = PAPER[name]
        if name in CHAINED:
            assert convert.startswith("none")
        else:
            command = _command(convert)
            ns = check_convert_command(command, preset, shape, load(name).model.path)
            if name in RECURRENT:
                assert (ns.adapter_init, ns.state_std) == ("random", float(PAPER_STATE_STD))
            dry = [str(standin_sources[ns.source]), str(tmp_path / name), *command[4:], "--dry-run"]
            convert_tool().run(dry)
            assert "dry run: nothing written" in capsys.readouterr().out
            assert not (tmp_path / name).exists()
        # The quoted FLOPs (5 digits) are tools/flops.py's paper convention over the whole run.
        computed = paper_flops(name)
        mantissa, exponent = re.fullmatch(r"(\d\.\d{4})e(\d+)", quoted).groups()
        assert abs(computed - float(quoted)) <= 0.5e-4 * 10 ** int(exponent), (name, f"{computed:.4e}")
    assert set(configs) == PAPER_RUNS  # every paper run: the CC-Math pairs and the Figure 8 runs


def test_recurrence_section_of_configs_builds_the_paper_schedule():
    """RecurrenceSchedule.from_config is what the trainer and tools/flops.py use (one builder)."""
    schedule = RecurrenceSchedule.from_config(Recurrence(), 50_000)
    assert (schedule.mean(1), schedule.mean(50_000), schedule.backprop_depth(1)) == (1, 32, 8)


def test_cluster_doc_points_sources_at_shards_from_the_command_line():
    """docs/cluster.md section 4: the documented --data.phases.P.sources.S overrides load and validate."""
    text = CLUSTER_DOC.read_text().split("## 4. Prepare data", 1)[1].split("## 5.", 1)[0]
    block = text.split("point each source at its shards", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    argv = shlex.split(block.replace("\\\n", " "))
    overrides = argv[argv.index("slurm/llama1b_retrofit.sh") + 1 :]
    phases = load("llama3_2_1b", *overrides).data.phases
    assert [[(s.name, s.kind, s.path.split("/")[2]) for s in p.sources] for p in phases] == [
        [("fineweb-edu", "tokenized", "fineweb_edu_1024")],
        [
            ("fineweb-edu", "tokenized", "fineweb_edu_1024"),
            ("sft-general", "tokenized", "sft_general_1024"),
            ("sft-math", "tokenized", "sft_math_1024"),
        ],
    ]
