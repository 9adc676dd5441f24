"""Nothing lost, nothing hangs: what an adversarial operator does to a run, driven through the real CLI.

Checkpoint lineage after a rewind; overwrite guards of the tools; checksums (flipped byte, truncated
shard, corrupt model folder); the run fingerprint on resume; disk full on a real tmpfs; a frozen rank
(SIGSTOP) and a collective timeout; loss spikes; kill -9 inside sync and async saves; bad input as one
line. CPU, gloo, fp32, deterministic mode. See docs/checkpointing.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.disk_util import fill_disk, tmpfs
from tests.tiny_runs import (
    CORPUS,
    CORPUS_DATA,
    ENV,
    LAUNCH_TIMEOUT,
    assert_logged_as_reference,
    assert_same_final_model,
    error_line,
    read_metrics,
    resumed_step,
    run_single_jobs,
    write_config,
)
from tests.torchrun_util import REPO_ROOT, WORKERS_DIR, load_tool, run_torchrun
from titan_recur.config import ConfigError, load_config
from titan_recur.storage.checkpoint import scan_checkpoints, verify_checkpoint
from titan_recur.storage.manifest import MANIFEST_NAME, IntegrityError
from titan_recur.storage.model_io import read_model_args, write_model_args
from titan_recur.utils.exit_codes import EXIT_BAD_INPUT, EXIT_IO_FAILURE, EXIT_NONFINITE, EXIT_STALLED

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def one_source_config(root: Path, model: Path) -> Path:
    general = f'[[data.sources]]\nname = "general"\npath = "{CORPUS / "general.jsonl"}"\nkind = "jsonl"\n'
    return write_config(root / "one_source.toml", model, general)


def data_config(root: Path, model: Path, name: str, source: str) -> Path:
    return write_config(root / f"{name}.toml", model, f'[[data.sources]]\nname = "{name}"\n{source}')


def bad_data_configs(root: Path, model: Path) -> dict[str, Path]:
    """Sources that cannot be trained on, each in its own config."""
    files = root / "data"
    files.mkdir()
    lines = [json.dumps({"text": f"document number {i} " * 8}) for i in range(20)]
    (files / "bad.jsonl").write_text("\n".join(lines[:3] + ['{"text": "unterminated'] + lines[3:]) + "\n")
    (files / "blank.jsonl").write_text("\n".join(json.dumps({"text": " " * i}) for i in range(30)) + "\n")
    (files / "numbers.jsonl").write_text("\n".join(json.dumps({"text": i}) for i in range(30)) + "\n")
    pq.write_table(pa.table({"input_ids": [[600] * 17] * 8}), files / "ids.parquet")
    # Ids beyond the vocabulary from row 20 on: the start-up check reads the first row group only.
    rows = [[1 + i % 50] * 17 for i in range(20)] + [[600] * 17] * 20
    pq.write_table(pa.table({"input_ids": rows}), files / "late_ids.parquet", row_group_size=4)
    return {
        "json_error": data_config(root, model, "json_error", f'path = "{files / "bad.jsonl"}"\nkind = "jsonl"\n'),
        "blank": data_config(root, model, "blank", f'path = "{files / "blank.jsonl"}"\nkind = "jsonl"\n'),
        "non_string": data_config(root, model, "non_string", f'path = "{files / "numbers.jsonl"}"\nkind = "jsonl"\n'),
        "token_ids": data_config(root, model, "token_ids", f'path = "{files / "ids.parquet"}"\nkind = "tokenized"\n'),
        "late_ids": data_config(
            root, model, "late_ids", f'path = "{files / "late_ids.parquet"}"\nkind = "tokenized"\n'
        ),
        "hub": data_config(root, model, "hub", 'path = "no-such-owner/no-such-dataset"\nkind = "hf"\n'),
    }


@pytest.fixture(scope="module")
def runs(normal_init_model, tmp_path_factory) -> dict:
    """Every single-process scenario, in order, in one worker: name -> result, plus the paths."""
    root = tmp_path_factory.mktemp("safety")
    config = write_config(root / "run.toml", normal_init_model, CORPUS_DATA)
    run = [
        "--config",
        str(config),
        "--training.steps",
        "8",
        "--training.global_batch_size",
        "4",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
    ]
    d = {
        name: root / name
        for name in ("base", "rewind", "allowed", "flip", "truncated", "spike", "spike_skip", "bad", "late_ids")
    }
    d["bad"].mkdir()
    (d["bad"] / "a_file").write_text("not a folder")
    tokenizer = root / "other_tokenizer"
    shutil.copytree(REPO_ROOT / "assets" / "tokenizer", tokenizer)
    (tokenizer / "tokenizer_config.json").write_text(
        (tokenizer / "tokenizer_config.json").read_text().replace("{", '{"model_max_length": 77, ', 1)
    )
    other_model = root / "other_model"
    shutil.copytree(normal_init_model, other_model)
    write_model_args(dataclasses.replace(read_model_args(normal_init_model), rope_theta=20000.0), other_model)
    bad_data = bad_data_configs(root, normal_init_model)
    base_ckpt, disk = d["base"] / "checkpoints", root / "tmpfs"

    def on(dump: Path, *extra: str, config_file: Path = config) -> list[str]:
        return ["--config", str(config_file), *run[2:], "--job.dump_folder", str(dump), *extra]

    def refused(*extra: str, config_file: Path = config) -> dict:
        return {"argv": on(d["base"], *extra, config_file=config_file), "watch": str(d["base"])}

    def bad(name: str, *extra: str, config_file: Path = config) -> dict:
        return {"argv": on(d["bad"] / name, *extra, config_file=config_file), "watch": str(d["bad"])}

    spike = [
        "--training.loss_spike_factor",
        "3",
        "--training.loss_spike_window",
        "3",
        "--debug.inject_spike_at_step",
        "6",
    ]
    jobs = {
        "base": {"argv": on(d["base"]), "watch": str(base_ckpt)},
        # Rewind to step 2 with keep_latest_k 1 and stop at step 5 (as a kill there would), then rerun.
        "rewind": {
            "argv": on(
                d["rewind"],
                "--checkpoint.load_step",
                "2",
                "--checkpoint.keep_latest_k",
                "1",
                "--debug.inject_nan_at_step",
                "5",
            ),
            "copy": [str(d["base"]), str(d["rewind"])],
            "watch": str(d["rewind"] / "checkpoints"),
        },
        "rewind_rerun": {
            "argv": on(d["rewind"], "--checkpoint.keep_latest_k", "1"),
            "watch": str(d["rewind"] / "checkpoints"),
        },
        "fp_steps": refused("--training.steps", "12"),
        "fp_seq_len": refused("--training.seq_len", "32"),
        "fp_attention_mask": refused("--training.attention_mask", "document"),
        "fp_tokenizer": refused("--data.tokenizer", str(tokenizer)),
        "fp_curriculum": refused("--recurrence.mean_recurrence", "4"),
        "fp_seed": refused("--job.seed", "1"),
        "fp_data": refused(config_file=one_source_config(root, normal_init_model)),
        "fp_global_batch": refused("--training.global_batch_size", "none"),
        "fp_model": refused("--model.path", str(other_model)),
        "fp_optimizer": refused("--optimizer.lr", "0.02"),
        "fp_allowed": {
            "argv": on(d["allowed"], "--training.steps", "12", "--checkpoint.allow_changes", "steps"),
            "copy": [str(d["base"]), str(d["allowed"])],
        },
        "flip": {
            "argv": on(d["flip"]),
            "copy": [str(d["base"]), str(d["flip"])],
            "flip_byte": str(d["flip"] / "checkpoints" / "step-8" / "__0_0.distcp"),
            "watch": str(d["flip"] / "checkpoints"),
        },
        "flip_fallback": {"argv": on(d["flip"], "--checkpoint.fallback_on_corruption", "true")},
        "truncated": {
            "argv": on(d["truncated"]),
            "copy": [str(d["base"]), str(d["truncated"])],
            "truncate": str(d["truncated"] / "checkpoints" / "step-8" / "__0_0.distcp"),
            "watch": str(d["truncated"] / "checkpoints"),
        },
        "spike_stop": {"argv": on(d["spike"], *spike)},
        "spike_skip": {"argv": on(d["spike_skip"], *spike, "--training.skip_nonfinite", "true")},
        "seq_len_max": bad("seq_len_max", "--training.seq_len", "100000"),
        "dp_replicate": bad("dp_replicate", "--parallel.dp_replicate", "2"),
        "cuda": bad("cuda", "--training.device", "cuda"),
        "dump_is_file": {"argv": on(d["bad"] / "a_file"), "watch": str(d["bad"])},
        "no_validation": bad("no_validation", "--validation.enable", "true", "--data.validation_fraction", "1e-6"),
        **{name: bad(name, config_file=path) for name, path in bad_data.items() if name != "late_ids"},
        "load_step_tensorboard": {
            "argv": on(d["base"], "--checkpoint.load_step", "5", "--metrics.enable_tensorboard", "true"),
            "watch": str(d["base"]),
        },
        "late_ids": {"argv": on(d["late_ids"], config_file=bad_data["late_ids"])},
        "full_sync": {
            "argv": on(disk / "sync"),
            "fill": {"file": str(disk / "filler"), "leave_like": str(base_ckpt / "step-2"), "factor": 1.5},
        },
        "full_rerun": {
            "argv": on(disk / "sync", "--metrics.enable_tensorboard", "true"),
            "fill": {"file": str(disk / "filler_rest")},
            "watch": str(disk / "sync"),
        },
        "full_async": {
            "argv": on(disk / "async", "--checkpoint.async_mode", "async"),
            "unlink": [str(disk / "filler"), str(disk / "filler_rest")],
            "fill": {"file": str(disk / "filler"), "leave_like": str(base_ckpt / "step-2"), "factor": 1.5},
        },
    }
    with tmpfs(disk):
        results = run_single_jobs(list(jobs.values()), root)
        checks = {
            name: [
                verify_checkpoint(disk / name / "checkpoints" / f"step-{s}") is not None
                for s in scan_checkpoints(disk / name / "checkpoints").complete
            ]
            for name in ("sync", "async")
        }
        leftovers = {
            name: sorted(p.name for p in (disk / name / "checkpoints").iterdir()) for name in ("sync", "async")
        }
        yield {
            "results": dict(zip(jobs, results, strict=True)),
            "dirs": d,
            "root": root,
            "disk_checks": checks,
            "disk_leftovers": leftovers,
            "disk": disk,
        }


def ok(result: dict) -> None:
    assert result["rc"] == 0, result["stdout"][-2000:] + result["stderr"][-3000:]


def manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


# ------------------------------------------------------------------------------------------ lineage


@pytest.mark.slow
def test_rewind_keeps_both_branches_and_resumes_the_new_one(runs):
    """Steps 2-8 on disk, rewind to 2 with keep_latest_k 1, stopped at step 5, then the same command."""
    r, d = runs["results"], runs["dirs"]
    ok(r["base"])
    base_files = r["base"]["after"]
    rewind = r["rewind"]
    assert rewind["rc"] == EXIT_NONFINITE, rewind["stderr"][-2000:]
    resumed = f"resumed from {d['rewind'] / 'checkpoints' / 'step-2'} at step 2: checkpoint.load_step = 2"
    assert resumed in rewind["stdout"]
    aside = d["rewind"] / "checkpoints" / "abandoned" / "1-rewind-to-step-2"
    assert f"moved the later checkpoints [4, 6, 8] to {aside}" in rewind["stdout"]
    # The abandoned branch is kept byte for byte; the new branch kept its latest step (keep_latest_k 1).
    after = rewind["after"]
    for step in (4, 6, 8):
        for name, stat in base_files.items():
            if name.startswith(f"step-{step}/"):
                assert after[f"abandoned/1-rewind-to-step-2/{name}"] == stat, name
    assert sorted({p.split("/")[0] for p in after if p.startswith("step-")}) == ["step-4"]
    # The plain rerun continues the new branch (step 4, whose parent is 2), not the abandoned step 8.
    rerun = r["rewind_rerun"]
    ok(rerun)
    assert resumed_step(rerun["stdout"]) == 4 and "the latest complete checkpoint" in rerun["stdout"]
    assert {k: v for k, v in rerun["after"].items() if k.startswith("abandoned/")} == {
        k: v for k, v in after.items() if k.startswith("abandoned/")
    }
    checkpoints = d["rewind"] / "checkpoints"
    assert scan_checkpoints(checkpoints).complete == [8]
    assert manifest(checkpoints / "step-8")["parent"] == 6
    assert manifest(aside / "step-8")["parent"] == 6 and manifest(aside / "step-4")["parent"] == 2
    # Same settings, same data: the new branch recomputes what the abandoned one logged, bit for bit.
    assert_logged_as_reference(read_metrics(d["rewind"]), read_metrics(d["base"]))
    assert [rec["step"] for rec in read_metrics(d["rewind"])][-4:] == [5, 6, 7, 8]


# -------------------------------------------------------------------------------------- fingerprint


def assert_refused_before_writing(result: dict) -> str:
    """A launch refused as bad input (exit 2) that changed nothing on disk; returns its error line."""
    assert result["rc"] == EXIT_BAD_INPUT, result["stderr"][-2000:]
    # The checkpoint folder's own mtime aside: the run's lock file was created in it and removed.
    before, after = ({k: v for k, v in s.items() if k != "checkpoints"} for s in (result["before"], result["after"]))
    assert before == after, "nothing written (no config.json, no TensorBoard file)"
    return error_line(result)


@pytest.mark.parametrize(
    "job, change",
    [
        ("fp_steps", "steps 8 -> 12; to resume with the new steps, pass --checkpoint.allow_changes steps"),
        ("fp_seq_len", "seq_len 16 -> 32"),
        ("fp_attention_mask", "attention_mask 'causal' -> 'document'"),
        ("fp_tokenizer", "tokenizer (other tokenizer files)"),
        ("fp_curriculum", "recurrence.mean_recurrence 3 -> 4"),
        ("fp_seed", "seed 0 -> 1; seed cannot change on resume"),
        ("fp_data", "data.phases[0].sources (2 entries -> 1)"),
        ("fp_global_batch", "global_batch_size 4 -> 2"),
        ("fp_model", "model.rope_theta 10000.0 -> 20000.0"),
        ("fp_optimizer", "optimizer.lr 0.01 -> 0.02"),
    ],
)
def test_each_change_of_the_run_settings_is_refused_on_resume(runs, job, change):
    line = assert_refused_before_writing(runs["results"][job])
    assert "step-8 was written with other settings: " in line and change in line, line


def test_an_allowed_change_resumes(runs):
    result = runs["results"]["fp_allowed"]
    ok(result)
    assert resumed_step(result["stdout"]) == 8 and "allowed changes: steps" in result["stdout"]
    assert [rec["step"] for rec in read_metrics(runs["dirs"]["allowed"])][-4:] == [9, 10, 11, 12]


def test_allow_changes_accepts_only_the_safe_fields():
    with pytest.raises(ConfigError, match="checkpoint.allow_changes expects list"):
        load_config(
            None,
            ["--model.preset", "tinyllama-1.1b", "--model.init", "random", "--checkpoint.allow_changes", "steps,model"],
        )


# ---------------------------------------------------------------------------------------- integrity


def test_a_flipped_byte_is_refused_naming_the_file_and_the_fallback(runs):
    r, d = runs["results"], runs["dirs"]
    flip = r["flip"]
    assert flip["rc"] == EXIT_BAD_INPUT
    shard = d["flip"] / "checkpoints" / "step-8" / "__0_0.distcp"
    line = error_line(flip)
    assert f"{shard}: checksum mismatch" in line and "--checkpoint.load_step 6" in line, line
    assert flip["before"] == flip["after"]
    # Opted in: resume from the newest verified step; the corrupt one is kept aside; same losses as the base.
    fallback = r["flip_fallback"]
    ok(fallback)
    assert resumed_step(fallback["stdout"]) == 6 and "corrupt: [8]" in fallback["stdout"]
    assert (d["flip"] / "checkpoints" / "abandoned" / "1-corrupt-after-step-6" / "step-8").is_dir()
    assert_logged_as_reference(read_metrics(d["flip"]), read_metrics(d["base"]))


def test_a_truncated_shard_names_the_file(runs):
    result = runs["results"]["truncated"]
    assert result["rc"] == EXIT_BAD_INPUT
    line = error_line(result)
    shard = runs["dirs"]["truncated"] / "checkpoints" / "step-8" / "__0_0.distcp"
    assert f"{shard}: " in line and "bytes, manifest.json records" in line and "--checkpoint.load_step 6" in line


def test_a_flipped_byte_in_a_model_folder_is_refused(runs, tmp_path):
    from titan_recur.eval.loading import load_checkpoint

    final = tmp_path / "final_model"
    shutil.copytree(runs["dirs"]["base"] / "final_model", final)
    assert manifest(final)["kind"] == "trained"
    load_checkpoint(final)
    weights = final / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) - 7] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.safetensors: checksum mismatch"):
        load_checkpoint(final)


# ------------------------------------------------------------------------------------- divergence


def test_a_loss_spike_stops_or_is_skipped(runs):
    r, d = runs["results"], runs["dirs"]
    stop = r["spike_stop"]
    assert stop["rc"] == EXIT_NONFINITE, stop["stderr"][-2000:]
    line = error_line(stop)
    assert "loss spike" in line and "(the median of the last 3 steps, training.loss_spike_factor) at step 6" in line
    assert f"latest good checkpoint: {d['spike'] / 'checkpoints' / 'step-4'}" in line
    assert scan_checkpoints(d["spike"] / "checkpoints").complete == [2, 4]
    skip = r["spike_skip"]
    ok(skip)
    assert "at step 6; step skipped (1 so far)" in skip["stdout"]
    assert [rec["step"] for rec in read_metrics(d["spike_skip"])] == [1, 2, 3, 4, 5, 7, 8]


# -------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "job, message",
    [
        ("seq_len_max", "training.seq_len 100000 exceeds the model's max_seq_len 4096"),
        ("dp_replicate", "world size 1 is not divisible by parallel.dp_replicate=2"),
        ("cuda", "training.device = 'cuda' but CUDA is not available"),
        ("dump_is_file", "a_file exists and is not a folder"),
        ("no_validation", "no held-out document in its first"),
        ("json_error", "bad.jsonl:4: invalid JSON (Unterminated string"),
        ("blank", "the first 30 documents are all blank"),
        ("non_string", "field 'text' holds int '0', not text"),
        ("token_ids", "ids.parquet: token id 600 outside the tokenizer's vocabulary [0, 512)"),
        ("hub", "data source 'hub' (hf no-such-owner/no-such-dataset) cannot be read: "),
        ("load_step_tensorboard", "checkpoint.load_step=5: no complete checkpoint"),
    ],
)
def test_bad_input_is_one_line_before_anything_is_written(runs, job, message):
    line = assert_refused_before_writing(runs["results"][job])
    assert message in line, line


def test_bad_data_mid_run_is_one_line_naming_the_last_checkpoint(runs):
    result, dump = runs["results"]["late_ids"], runs["dirs"]["late_ids"]
    assert result["rc"] == EXIT_BAD_INPUT
    line = error_line(result)
    assert line.startswith("error: at step 6: data source 'late_ids': token id 600 outside the tokenizer's"), line
    assert f"latest complete checkpoint: {dump / 'checkpoints'}/step-" in line


# -------------------------------------------------------------------------------------- disk full


def test_disk_full_is_one_line_and_the_previous_checkpoint_stays_intact(runs):
    r, disk = runs["results"], runs["disk"]
    for job, name in (("full_sync", "sync"), ("full_async", "async")):
        result = r[job]
        assert result["rc"] == EXIT_IO_FAILURE, result["stderr"][-3000:]
        line = error_line(result)
        folder = disk / name / "checkpoints"
        assert "No space left on device" in line and f"cannot write checkpoint {folder}/step-4.partial" in line, line
        assert f"latest complete checkpoint: {folder / 'step-2'}" in line
        assert runs["disk_checks"][name] == [True], "step 2 complete and verified"
        assert runs["disk_leftovers"][name] == ["step-2"], "the incomplete folder was removed"
    # The same command again on the full disk: one line, nothing of the run lost.
    rerun = r["full_rerun"]
    assert rerun["rc"] == EXIT_IO_FAILURE, rerun["stderr"][-3000:]
    assert "I/O failure before training: [Errno 28] No space left on device" in error_line(rerun)
    assert rerun["before"] == rerun["after"]


@pytest.mark.slow
def test_disk_full_readings_agree_across_ranks(tmp_path):
    """A rank whose own error does not say the disk is full (torch.save's "unexpected pos") still says
    "No space left", though rank 0 removes the incomplete folder (and so frees the disk) a second before
    that rank reads the disk: the ranks agree on the reading first."""
    disk = tmp_path / "tmpfs"
    with tmpfs(disk):
        folder, out = disk / "checkpoints", tmp_path / "message"
        run_torchrun([str(WORKERS_DIR / "disk_full_worker.py"), str(folder), str(out)], nproc=2)
        partial_left = (folder / "step-4.partial").exists()
    for rank in (0, 1):
        message = Path(f"{out}.{rank}").read_text()
        assert message.startswith(
            f"cannot write checkpoint {folder}/step-4.partial: RuntimeError: unexpected pos {1000 + rank}"
        )
        assert "; No space left on device (" in message, (rank, message)
    assert not partial_left


@pytest.mark.slow
def test_an_async_save_on_a_full_disk_and_its_rerun_each_end_in_one_line(normal_init_model, tmp_path):
    """An async save fills the disk; the same command on the still-full disk fails the same way: each time
    exactly one line on stderr (no warning of the writer thread) and nothing but step-2 left; once space
    is freed, the rerun completes with a silent stderr."""
    config = write_config(tmp_path / "run.toml", normal_init_model, CORPUS_DATA)
    run = ["--config", str(config), "--training.global_batch_size", "4", "--checkpoint.interval", "2"]
    run += ["--training.steps", "4"]
    disk, base = tmp_path / "tmpfs", tmp_path / "base"
    on_disk = [*run, "--job.dump_folder", str(disk / "async"), "--checkpoint.async_mode", "async"]
    filler = {"file": str(disk / "filler"), "leave_like": str(base / "checkpoints" / "step-2"), "factor": 1.5}
    jobs = [
        {"argv": [*run, "--job.dump_folder", str(base), "--training.steps", "2"]},
        {"argv": on_disk, "fill": filler},
        {"argv": on_disk},
        {"argv": on_disk, "unlink": [str(disk / "filler")]},
    ]
    with tmpfs(disk):
        results = run_single_jobs(jobs, tmp_path)
        left = sorted(p.name for p in (disk / "async" / "checkpoints").iterdir())
    folder = disk / "async" / "checkpoints"
    for result in results[1:3]:
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        assert result["rc"] == EXIT_IO_FAILURE and len(lines) == 1, result["stderr"][-3000:]
        assert lines[0].startswith(f"error: cannot write checkpoint {folder}/step-4.partial: ") and (
            "No space left on device" in lines[0]
        ), lines[0]
    assert results[3]["rc"] == 0 and not results[3]["stderr"].strip(), results[3]["stderr"][-3000:]
    assert left == ["step-2", "step-4"]


def run_command(main, argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """A command's main in this process, as its console script runs it: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["command", *argv])
    try:
        code = main()
    except SystemExit as exit:
        code = exit.code
    return code or 0, capsys.readouterr().err


def test_every_writer_on_a_full_disk_ends_in_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """convert, export and eval loss/heldout on a disk with 8 KB free: one line, exit 1, no file of theirs left
    (an empty or partial result made the rerun refuse it without --force, and --force then refuse it as not
    theirs); with the space freed the same command completes."""
    from titan_recur.cli import convert, export
    from titan_recur.cli import eval as evaluate

    disk, config = tmp_path / "tmpfs", REPO_ROOT / "train_configs" / "debug_model.toml"
    model, data = REPO_ROOT / "assets" / "tiny_llama_recurrent", REPO_ROOT / "assets" / "corpus" / "math.jsonl"
    loss = ["--checkpoint", str(model), "--data", str(data), "--recurrences", "1,2", "--batches", "1"]
    commands = {
        "convert": (convert.main, [str(REPO_ROOT / "assets" / "tiny_llama"), str(disk / "conv"), "--shape", "2,4,2"]),
        "export": (export.main, [str(model), str(disk / "hf")]),
        "eval loss": (
            evaluate.main,
            ["loss", *loss, "--batch-size", "2", "--seq-len", "32", "--out", str(disk / "loss")],
        ),
        "eval heldout": (
            evaluate.main,
            ["heldout", "--config", str(config), "--documents", "50", "--out", str(disk / "held_out.jsonl")],
        ),
    }
    results = {}
    with tmpfs(disk):
        for name, (main, argv) in commands.items():
            fill_disk(disk / "filler", leave=8 << 10)
            full = run_command(main, argv, capsys, monkeypatch)
            left = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file() and p.name != "filler")
            (disk / "filler").unlink()
            results[name] = full, left, run_command(main, argv, capsys, monkeypatch)
            for path in disk.iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    for name, ((code, stderr), left, (again, again_stderr)) in results.items():
        lines = stderr.strip().splitlines()
        assert code == 1 and len(lines) == 1, (name, code, stderr[-3000:])
        assert "No space left on device" in lines[0] and str(disk) in lines[0], (name, lines[0])
        assert left == [], (name, left)
        assert again == 0, (name, again_stderr[-3000:])


@pytest.mark.slow
def test_a_final_export_on_a_full_disk_ends_in_one_line_and_the_rerun_exports(normal_init_model, tmp_path):
    """Training done, its last checkpoint elsewhere: the final model does not fit. One line naming the folder
    and the checkpoint, no final_model/ (nor a temporary) left; the same command, with space, writes it."""
    config = write_config(tmp_path / "run.toml", normal_init_model, CORPUS_DATA)
    run = ["--config", str(config), "--training.global_batch_size", "4", "--training.steps", "2"]
    base, disk = tmp_path / "base", tmp_path / "tmpfs"
    on_disk = [*run, "--job.dump_folder", str(disk / "run"), "--checkpoint.folder", str(tmp_path / "ckpt")]
    filler = {"file": str(disk / "filler"), "leave_like": str(base / "final_model"), "factor": 0.5}
    jobs = [
        {"argv": [*run, "--job.dump_folder", str(base)]},
        {"argv": on_disk, "fill": filler},
        {"argv": on_disk, "unlink": [str(disk / "filler")]},
    ]
    with tmpfs(disk):
        results = run_single_jobs(jobs, tmp_path)
        left = sorted(p.name for p in (disk / "run").iterdir())
    full, rerun = results[1], results[2]
    assert full["rc"] == EXIT_IO_FAILURE, full["stderr"][-3000:]
    line = error_line(full)
    assert "No space left on device" in line and f"{disk / 'run' / 'final_model'}" in line, line
    assert f"latest complete checkpoint: {tmp_path / 'ckpt' / 'step-2'}" in line, line
    assert rerun["rc"] == 0 and not rerun["stderr"].strip(), rerun["stderr"][-3000:]
    assert "final_model" in left and not [name for name in left if name.startswith(".final_model")], left


# -------------------------------------------------------------------------------------------- tools


def test_force_replaces_only_a_folder_of_the_tools_own_kind(runs, tiny_hf_checkpoint, tmp_path):
    """export/convert --force onto a trained model or a checkpoint refuse and change nothing."""
    from tests.dist_workers.ckpt_worker import snapshot
    from titan_recur.cli import convert as convert_hf
    from titan_recur.cli import export as export_hf
    from titan_recur.convert.surgery import ConversionError

    trained = tmp_path / "trained"
    shutil.copytree(runs["dirs"]["base"] / "final_model", trained)
    step = tmp_path / "step-8"
    shutil.copytree(runs["dirs"]["base"] / "checkpoints" / "step-8", step)
    before = snapshot(str(tmp_path))
    source = tiny_hf_checkpoint("llama")
    for output, kind in ((trained, "a trained model"), (step, "a DCP checkpoint")):
        assert export_hf.main([str(trained), str(output), "--force"]) == 2
        with pytest.raises(ConversionError, match=f"refusing to overwrite {output} with --force: it is {kind}"):
            convert_hf.run([str(source), str(output), "--shape", "1,2,1", "--force"])
    assert snapshot(str(tmp_path)) == before
    # Their own kind they replace: an export over an export, a conversion over a conversion.
    export = tmp_path / "export"
    for _ in range(2):
        assert export_hf.main([str(trained), str(export), "--force"]) == 0
    assert manifest(export)["kind"] == "hf_export"
    converted = tmp_path / "converted"
    for _ in range(2):
        convert_hf.run([str(source), str(converted), "--shape", "1,2,1", "--force"])
    assert manifest(converted)["kind"] == "conversion"
    with pytest.raises(ConversionError, match="it is an HF export"):
        convert_hf.run([str(source), str(export), "--shape", "1,2,1", "--force"])


def test_conversion_of_a_damaged_source_is_one_line(tiny_hf_checkpoint, tmp_path):
    from titan_recur.cli import convert as convert_hf
    from titan_recur.convert.surgery import ConversionError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_hf_checkpoint("llama"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConversionError, match="model.safetensors: unreadable safetensors file"):
        convert_hf.run([str(broken), str(tmp_path / "out1"), "--shape", "1,2,1"])
    (broken / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ConversionError, match="config.json: not valid JSON"):
        convert_hf.run([str(broken), str(tmp_path / "out2"), "--shape", "1,2,1"])


def test_flops_and_eval_bound_their_inputs(runs, tmp_path, capsys):
    from titan_recur.cli import flops as flops_tool
    from titan_recur.cli.eval import main as eval_main

    for argv, message in (
        (["--at-step", "999999999"], "--at-step must be in [0, 50000]"),
        (["--steps", "999999999"], "steps must be in [1, 1,000,000]"),
        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
    ):
        assert flops_tool.main(["--preset", "tinyllama-1.1b", *argv]) == 2
        assert message in capsys.readouterr().err
    final = str(runs["dirs"]["base"] / "final_model")
    (tmp_path / "a_file").write_text("")
    loss = ["loss", "--checkpoint", final, "--data", str(CORPUS / "general.jsonl")]
    for extra, message in (
        (["--seq-len", "0", "--out", str(tmp_path / "out")], "--seq-len must be >= 1, got 0"),
        (["--out", str(tmp_path / "a_file")], "a_file exists and is not a folder"),
    ):
        assert eval_main([*loss, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_config_checks_the_new_bounds():
    base = ["--model.preset", "tinyllama-1.1b", "--model.init", "random"]
    for override, message in (
        (["--training.loss_spike_factor", "0.5"], "loss_spike_factor must be 0 (off) or > 1"),
        (["--parallel.timeout_s", "0"], "parallel.timeout_s must be > 0"),
        (["--training.step_timeout_s", "-1"], "training.step_timeout_s must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, [*base, *override])


# --------------------------------------------------------------- kill -9 during saves, stalls, timeouts


@pytest.fixture(scope="module")
def forked(normal_init_model, tmp_path_factory) -> dict:
    """The 2-rank scenarios, every rank forked from one worker that imported the trainer once: 7 kills
    per async_mode at seeded random moments inside saves (one random rank first), then two launches
    whose rank 1 is frozen by SIGSTOP after step 3 (the step watchdog; the collective timeout)."""
    root = tmp_path_factory.mktemp("forked")
    config = write_config(root / "run.toml", normal_init_model, CORPUS_DATA)
    steps, kills = 22, 7
    seed = int(os.environ.get("TITAN_RECUR_KILL_SEED", "20261202"))
    stall = [
        "--config",
        str(config),
        "--training.steps",
        "500",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.export_final",
        "false",
    ]
    spec = {
        "argv": [
            "--config",
            str(config),
            "--training.steps",
            str(steps),
            "--checkpoint.interval",
            "1",
            "--checkpoint.keep_latest_k",
            "3",
        ],
        "root": str(root),
        "world": 2,
        "kills": kills,
        "seed": seed,
        "steps": steps,
        "modes": ["disabled", "async"],
        "stalls": {
            "watchdog": {
                "argv": [*stall, "--training.step_timeout_s", "{timeout}", "--parallel.timeout_s", "300"],
                "after_step": 3,
            },
            "collective": {
                "argv": [*stall, "--training.step_timeout_s", "0", "--parallel.timeout_s", "{timeout}"],
                "after_step": 3,
            },
        },
    }
    (root / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(WORKERS_DIR / "kill_save_worker.py"), str(root / "spec.json"), str(root / "result.json")],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=3 * LAUNCH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"spec": spec, **json.loads((root / "result.json").read_text())}


@pytest.mark.slow
def test_a_frozen_rank_ends_the_run_within_the_step_timeout(forked):
    run = forked["stalls"]["watchdog"]
    log = run["log"]
    assert run["rc"] == EXIT_STALLED, log[-3000:]
    lines = [line for line in log.splitlines() if "has not finished after" in line]
    assert len(lines) == 1 and lines[0].startswith("[rank 0] step "), log[-3000:]
    timeout = forked["stall_timeout_s"]  # from this machine's step times: a slow honest step never trips it
    assert f"training.step_timeout_s = {timeout}; last completed step" in lines[0]
    assert "no heartbeat from rank 1 for" in lines[0], lines[0]
    assert run["seconds"] < timeout + 30, run["seconds"]  # the timeout, plus polling and a loaded machine


@pytest.mark.slow
def test_a_collective_timeout_is_one_line_per_rank(forked):
    run = forked["stalls"]["collective"]
    log = run["log"]
    assert run["rc"] == EXIT_STALLED, log[-3000:]
    lines = [line for line in log.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("[rank 0] error: a collective failed at step "), log[-3000:]
    timeout = forked["stall_timeout_s"]
    assert "Timed out" in lines[0] and f"parallel.timeout_s = {timeout}" in lines[0] and "Traceback" not in log
    assert run["seconds"] < timeout + 30, run["seconds"]


@pytest.mark.slow  # shares the forked fixture (~45 s of 2-rank scenarios) with the frozen-rank tests
def test_kill9_inside_sync_and_async_saves_resumes_bit_identically(forked):
    """After every kill each complete step verifies; the finished runs equal an uninterrupted one bit for bit."""
    spec = forked["spec"]
    steps, kills, seed = spec["steps"], spec["kills"], spec["seed"]
    reference = Path(forked["reference"])
    ref = read_metrics(reference)
    assert [r["step"] for r in ref] == list(range(1, steps + 1))
    for mode in spec["modes"]:
        run = forked[mode]
        note = f"{mode}, TITAN_RECUR_KILL_SEED={seed}: {run['kills']}"
        assert run["final_rc"] == [0, 0], note
        assert len(run["kills"]) == kills
        assert sum(k["in_save"] for k in run["kills"]) >= kills // 2, f"most kills land inside a save: {note}"
        dump = Path(run["dump"])
        records = read_metrics(dump)
        assert {r["step"] for r in records} == set(range(1, steps + 1)), note
        assert_logged_as_reference(records, ref, note)
        assert_same_final_model(dump, reference)


def test_bench_checkpoint_prints_its_figures(tmp_path, capsys):
    load_tool("bench_checkpoint").main(["--megabytes", "8", "--repeats", "1", "--folder", str(tmp_path / "bench")])
    out = capsys.readouterr().out
    assert "xxh3_128" in out and "with checksums + manifest" in out and "verification before it" in out, out
    assert "with the manifest check" in out and "verify_checksums=False" in out, out
    assert not (tmp_path / "bench").exists()
