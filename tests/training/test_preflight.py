"""Preflight (`python -m titan_recur.train --check`): the plan of every shipped config, one line per
problem with nothing written, the memory estimate against measured memory, and the start-up banner,
ETA and TensorBoard validation chart of a real run.

The paper configs name converted model folders and hub datasets that only exist after a download:
their model folders are stand-ins (the converted config.json of the preset's architecture, plus the
tiny tokenizer), and the hub is replaced by a local file serving each dataset's first rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from tests.data_util import build_bpe_tokenizer
from tests.tiny_models import SMALL, tiny_args
from tests.torchrun_util import load_tool
from titan_recur.cli.train import main
from titan_recur.config import load_config
from titan_recur.data import loader
from titan_recur.models.args import PRESETS, ModelArgs
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.model_io import resolve_model_args, write_model_args
from titan_recur.training import cost_model
from titan_recur.training.optim import split_params_for_muon

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "train_configs"
DEBUG_CONFIG = str(CONFIGS / "debug_model.toml")
SHIPPED = sorted(p.stem for p in CONFIGS.glob("*.toml") if p.stem != "debug_model")
TOKENIZER = REPO / "assets" / "tokenizer"
# Paper-convention FLOPs of two paper runs, as the paper's result files store them (tests/config/test_paper_configs.py).
PAPER_FLOPS = {"tinyllama_cc_math": 1.217748875e21, "tinyllama_static_cc_math": 3.048136142e20}


def write_standin(folder: Path, args: ModelArgs) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_model_args(args, folder)
    for file in TOKENIZER.glob("*"):
        shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A folder with train_configs/ and a stand-in model folder at every config's model.path."""
    root = tmp_path_factory.mktemp("checkout")
    (root / "train_configs").symlink_to(CONFIGS)
    for name in SHIPPED:
        m = load_config(str(CONFIGS / f"{name}.toml")).model
        write_standin(root / m.path, PRESETS[m.preset].model_args(*m.shape))
    return root


@pytest.fixture
def hub_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub sources read a local corpus (its "text" column under the source's field name)."""
    real = loader.open_source

    def open_source(s):
        if s.kind != "hf":
            return real(s)
        ds = datasets.load_dataset(
            "json", data_files=[str(REPO / "assets/corpus/math.jsonl")], split="train", streaming=True
        ).select_columns(["text"])
        return ds if s.text_field == "text" else ds.rename_column("text", s.text_field)

    monkeypatch.setattr(loader, "open_source", open_source)


def run_check(argv: list[str], capsys) -> tuple[int, str, list[str]]:
    code = main([*argv, "--check"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


@pytest.mark.slow
def test_check_prints_the_plan_of_every_shipped_config(checkout, hub_standin, monkeypatch, capsys):
    monkeypatch.chdir(checkout)
    for name in SHIPPED:
        cfg = load_config(f"train_configs/{name}.toml")
        # A later phase's stand-in source may sit in this run's final_model/ (the mixture reads the healing run's):
        # set it aside, as before the run, since a check refuses to start over a finished run.
        final_model = checkout / cfg.job.dump_folder / "final_model"
        aside = final_model.with_name("final_model.aside")
        if final_model.exists():
            final_model.rename(aside)
        try:
            code, out, err = run_check(
                ["--config", f"train_configs/{name}.toml", "--world-size", "64", "--gpu", "h100"], capsys
            )
        finally:
            if aside.exists():
                aside.rename(final_model)
        assert code == 0 and not err, (name, err)
        assert "check passed for 64 rank(s)" in out
        assert "1024 sequences x 1024 tokens = 1,048,576 tokens/step (16 per rank x 1 micro-step(s))" in out, name
        assert f"steps: {cfg.training.steps:,} " in out
        assert "memory per GPU: ~" in out and "time: ~" in out and "of 989 TFLOP/s per GPU" in out
        assert "validation: every 1000 steps" in out, name
        sources = {s.name for s in loader.all_sources(cfg.data)}
        assert all(f"data: {s}: first document read" in out for s in sources), name
        if name in PAPER_FLOPS:
            assert f"paper {PAPER_FLOPS[name]:.4e}" in out, name
    assert not (checkout / "outputs" / "tinyllama").exists()  # a check writes nothing


def test_check_plan_counts(checkout, hub_standin, monkeypatch, capsys):
    """The plan's figures against independent counts: parameters, micro-steps, time at the MFU."""
    monkeypatch.chdir(checkout)
    code, out, _ = run_check(
        ["--config", "train_configs/llama3_2_1b.toml", "--world-size", "16", "--assume-mfu", "0.5", "--gpu", "mi300x"],
        capsys,
    )
    assert code == 0
    # Llama-3.2-1B: 16 layers of 60,821,504 + 2,048-d norm + 128,256 x 2,048 embedding (tied in the source);
    # 4,6,4 keeps 14 layers, unties the head and adds the 2d x d adapter.
    layer, emb = 60_821_504, 128_256 * 2048
    assert f"parameters {14 * layer + 2048 + 2 * emb + 2 * 2048 * 2048:,}" in out
    assert "(16 per rank x 4 micro-step(s))" in out  # 1024 / (16 x 16)
    assert "of 1,307 TFLOP/s per GPU" in out and "MFU 0.5" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model.path", "no/such/folder"], ["model.path no/such/folder: no such folder"]),
        (["--training.bogus", "1"], ["unknown option --training.bogus"]),
        (
            ["--training.attention_mask", "blockwise"],
            ["--training.attention_mask expects one of 'causal', 'document', got 'blockwise'"],
        ),
        (
            ["--training.global_batch_size", "24", "--world-size", "2"],
            [
                "training.global_batch_size (24) must be a multiple of local_batch_size x data-parallel ranks (8 x 2 = 16)"
            ],
        ),
        (
            ["--parallel.dp_replicate", "3", "--world-size", "2"],
            ["world size 2 is not divisible by parallel.dp_replicate=3"],
        ),
        (["--world-size", "0"], ["--world-size must be >= 1"]),
        (["--training.seq_len", "4096"], ["training.seq_len 4096 exceeds the model's max_seq_len 2048"]),
    ],
)
def test_check_problems_are_one_line_each(tmp_path, capsys, argv, expected):
    dump = tmp_path / "run"
    code, out, err = run_check(["--config", DEBUG_CONFIG, "--job.dump_folder", str(dump), *argv], capsys)
    assert code == 2 and not out
    assert len(err) == len(expected) and all(e in line for e, line in zip(expected, err, strict=True)), err
    assert not dump.exists()


def test_check_says_document_masking_is_on(tmp_path, capsys):
    argv = ["--config", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path / "run")]
    code, out, _ = run_check([*argv, "--training.attention_mask", "document"], capsys)
    assert code == 0 and f"attention: {cost_model.document_masking_note()}" in out
    code, out, _ = run_check(argv, capsys)
    assert code == 0 and "document masking" not in out


@pytest.mark.parametrize(
    "case, expected",
    [
        ("seq_len", "training.seq_len 4096 exceeds the model's max_seq_len 2048"),
        ("dump_is_file", "a_file exists and is not a folder"),
        ("no_held_out", "no held-out document in its first"),
        ("other_tokenizer", "is not the tokenizer of assets/tiny_llama_recurrent (its ids mean other tokens"),
    ],
)
def test_check_refuses_what_the_run_refuses(tmp_path, capsys, case, expected):
    """Each input the run refuses before any work, --check refuses with the same line (each passed the check)."""
    (tmp_path / "a_file").write_text("not a folder")
    argv = {
        "seq_len": ["--training.seq_len", "4096"],
        "dump_is_file": ["--job.dump_folder", str(tmp_path / "a_file")],
        "no_held_out": ["--data.validation_fraction", "1e-6"],
        "other_tokenizer": ["--data.tokenizer", str(build_bpe_tokenizer(tmp_path))],
    }[case]
    argv = ["--config", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path / "run"), *argv, "--checkpoint.enable", "false"]
    code, out, err = run_check(argv, capsys)
    assert code == 2 and not out and len(err) == 1 and expected in err[0], err
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == err  # the run's own line
    assert not (tmp_path / "run").exists()


def test_check_reports_a_vocab_mismatch_and_each_unreachable_source(tmp_path, capsys):
    """A model vocab below the tokenizer's: one line. An offline hub dataset and a missing file: one line each."""
    small = write_standin(tmp_path / "model256", tiny_args(256, SMALL))
    model = write_standin(tmp_path / "model512", tiny_args(512, SMALL))
    good = f'[[data.sources]]\nname = "math"\npath = "{REPO}/assets/corpus/math.jsonl"\nkind = "jsonl"\n'
    bad = (
        '[[data.sources]]\nname = "hub"\npath = "no-such-org/no-such-dataset"\nkind = "hf"\n'
        f'[[data.sources]]\nname = "gone"\npath = "{tmp_path}/missing/*.jsonl"\nkind = "jsonl"\n'
    )
    config = tmp_path / "run.toml"
    config.write_text(f'[job]\ndump_folder = "{tmp_path / "run"}"\n' + good)
    code, out, err = run_check(["--config", str(config), "--model.path", str(small)], capsys)
    assert code == 2 and not out
    assert err == [
        "error: tokenizer/model vocab mismatch: the tokenizer produces ids up to 511 but the model's vocab_size is 256"
    ]
    config.write_text(f'[job]\ndump_folder = "{tmp_path / "run"}"\n' + bad + good)
    code, out, err = run_check(["--config", str(config), "--model.path", str(model)], capsys)
    assert code == 2 and not out and len(err) == 2, err
    assert err[0].startswith("error: data source 'hub' (hf no-such-org/no-such-dataset) cannot be read: ")
    assert "no-such-org/no-such-dataset" in err[0].split("cannot be read: ")[1]
    assert err[1].startswith("error: data source 'gone': no file matches")
    assert not (tmp_path / "run").exists()


def test_an_unreachable_hub_fails_fast_from_the_cache(tmp_path):
    """Not offline, but the Hub's endpoint refuses connections: the hub source fails in one line from the
    local cache (which lacks it), without huggingface_hub's retries (each waits seconds)."""
    config = tmp_path / "run.toml"
    config.write_text(
        f'extends = "{DEBUG_CONFIG}"\n[job]\ndump_folder = "{tmp_path / "run"}"\n'
        '[[data.sources]]\nname = "hub"\npath = "no-such-org/no-such-dataset"\nkind = "hf"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf_home"))  # port 9: nothing listens
    done = subprocess.run(
        [sys.executable, "-m", "titan_recur.train", "--config", str(config), "--check"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "127.0.0.1:9 is unreachable" in errors[0] and "local cache only" in errors[0], errors
    assert "Retrying" not in done.stderr + done.stdout


def test_check_flags_need_check(capsys):
    assert main(["--config", DEBUG_CONFIG, "--world-size", "2"]) == 2
    assert "--world-size only apply with --check" in capsys.readouterr().err
    assert main(["--config", DEBUG_CONFIG, "--check", "--gpu", "tpu"]) == 2
    assert "--gpu 'tpu' is not in the peak table" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- memory


def saved_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> float:
    """What one block saves for backward, measured with saved-tensor hooks (its input and RoPE tables aside)."""
    torch.manual_seed(0)
    model = RecurrentLM(args).to(dtype)
    block, (batch, seq) = model.prelude[0], (2, 64)
    x = torch.randn(batch, seq, args.dim, dtype=dtype, requires_grad=True)
    ctx = model.attention_context(torch.zeros(batch, seq, dtype=torch.long), None, None, None)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, ctx)
    skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), x, ctx.cos, ctx.sin]}
    return sum(n for ptr, n in storages.items() if ptr not in skip) / (batch * seq)


@pytest.mark.parametrize(
    "block_type, kv_heads", [("llama", 2), ("olmo2", 4), ("qwen2", 2), ("qwen3", 2), ("mistral", 2)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_saved_bytes_match_saved_tensor_hooks(block_type, kv_heads, dtype):
    args = ModelArgs(
        vocab_size=64,
        dim=96,
        n_heads=4,
        n_kv_heads=kv_heads,
        head_dim=24,
        ffn_dim=160,
        n_prelude=1,
        n_core=1,
        n_coda=1,
        block_type=block_type,
    )
    c = 4 if dtype == torch.float32 else 2
    assert cost_model.block_saved_bytes(args, c) == pytest.approx(saved_bytes_per_token(args, dtype), rel=0.005)


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_memory")


@pytest.fixture(scope="module")
def wide_vocab_model(tmp_path_factory) -> Path:
    """A model whose embedding, head and loss outweigh its activations (vocab 4096 at d 128)."""
    from titan_recur.storage.model_io import save_model

    torch.manual_seed(0)
    model = RecurrentLM(
        ModelArgs(
            vocab_size=4096, dim=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256, n_prelude=1, n_core=2, n_coda=1
        )
    )
    model.init_weights()
    folder = tmp_path_factory.mktemp("wide_vocab")
    save_model(model, folder, TOKENIZER)
    return folder


@pytest.mark.parametrize(
    "ac_mode, optimizer, wide",
    [("per_iteration", "muon", False), ("none", "muon", False), ("per_iteration", "adamw", True)],
)
def test_memory_estimate_within_25_percent_of_live_tensors(
    bench, ac_mode, optimizer, wide, wide_vocab_model, monkeypatch
):
    """The debug run's training step on CPU: peak live tensor bytes (profiler) vs the estimate."""
    monkeypatch.chdir(REPO)
    model = ["--model.path", str(wide_vocab_model)] if wide else []
    cfg = load_config(
        DEBUG_CONFIG, ["--training.device", "cpu", "--training.ac_mode", ac_mode, "--optimizer.name", optimizer, *model]
    )
    measured = bench.measure_tensors(cfg)
    estimate = cost_model.memory_estimate(cfg, resolve_model_args(cfg.model), 1, "cpu")
    assert 0.75 < estimate.total / measured < 1.25, (estimate, measured)


def test_memory_estimate_shards_model_state():
    """Per GPU: fp32 master weights and grads over dp_shard, Muon 1 and AdamW 2 states, gathered units."""
    cfg = load_config(str(CONFIGS / "llama3_2_1b.toml"), ["--model.path", "none", "--model.init", "random"])
    args = PRESETS["llama3.2-1b"].model_args(4, 6, 4)
    with torch.device("meta"):
        model = RecurrentLM(args)
    muon, adamw = (sum(p.numel() for _, p in group) for group in split_params_for_muon(model))
    total = sum(p.numel() for p in model.parameters())
    assert cost_model.muon_params(args) == muon  # the analytic split is the optimizer's
    assert adamw == 2 * 128_256 * 2048 + (2 * 14 + 1) * 2048  # embedding, head, norms
    one, many = (cost_model.memory_estimate(cfg, args, w) for w in (1, 64))
    assert one.weights == 4 * total and many.weights == one.weights / 64
    assert many.optimizer == 4 * (muon + 2 * adamw) / 64
    assert one.gathered == 0 and many.gathered > 2 * 2 * sum(p.numel() for p in model.core.parameters())
    assert many.activations == one.activations  # per micro-batch, whatever the world size


# ---------------------------------------------------------------------------------------------- a run


def test_banner_eta_and_validation_chart(tmp_path, capsys):
    """The run prints the plan, the step line carries the window loss and an ETA, TensorBoard gets one
    validation chart over r and a loss-vs-r figure."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    dump = tmp_path / "run"
    argv = [
        "--config",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        "4",
        "--metrics.log_freq",
        "2",
        "--validation.interval",
        "2",
        "--checkpoint.enable",
        "false",
        "--checkpoint.export_final",
        "false",
        "--job.description",
        "banner test",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[titan_recur] plan: run: banner test;" in out
    assert "[titan_recur] plan: memory per process: ~" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(" (avg " in line and " mean r " in line and "  eta 0:00:" in line for line in steps)
    assert steps[-1].endswith("eta 0:00:00")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert logged[0]["eta_seconds"] == pytest.approx(2 * logged[0]["step_time"]) and logged[-1]["eta_seconds"] == 0
    tags, layout = set(), None
    for path in (dump / "tb").glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                tags.add(value.tag)
                if value.tag == "custom_scalars__config__":
                    layout = value.tensor.string_val[0].decode("latin-1")
    assert "validation/loss_vs_r" in tags  # the figure
    assert layout is not None and all(f"validation/loss_r{r}" in layout for r in (1, 2, 4, 8))
