"""An adversarial operator's inputs: each is refused in one line (``error: ...``, exit 2) before any work.

Bounds (sequence length vs the model, recurrences, memory vs the machine), writers that never replace
what they did not write, model folders without their manifest, undecodable text, and messages that
name the root cause.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import subprocess
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest
import tomllib
import torch

from titan_recur.cli.analyze_layers import main as analyze_main
from titan_recur.cli.compare import main as compare_main
from titan_recur.cli.eval import main as eval_main
from titan_recur.cli.generate import main as generate_main
from titan_recur.cli.prepare_data import _encoded_chunks
from titan_recur.cli.prepare_data import main as prepare_main
from titan_recur.storage.manifest import MANIFEST_NAME
from titan_recur.storage.model_io import UnverifiedFolderError, load_model
from titan_recur.utils.limits import MAX_RECURRENCE, available_memory, check_allocation

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets"
MODEL = ASSETS / "tiny_llama_recurrent"  # max_seq_len 2048
CORPUS = ASSETS / "corpus" / "math.jsonl"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def one_error_line(capsys, code: int, *needles: str) -> str:
    """The command failed with exit 2 and a single ``error:`` line on stderr that holds every needle."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "error: " in lines[0], err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def loss_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "loss",
        "--checkpoint",
        str(MODEL),
        "--data",
        str(CORPUS),
        "--batches",
        "1",
        "--batch-size",
        "1",
        "--seq-len",
        "32",
        "--recurrences",
        "1",
        "--out",
        str(tmp_path / "loss"),
        *extra,
    ]


# ------------------------------------------------------------------------------------------- bounds


def test_eval_loss_refuses_a_seq_len_beyond_the_models_positions(tmp_path, capsys):
    code = eval_main(loss_args(tmp_path, "--seq-len", "4096"))
    one_error_line(capsys, code, "--seq-len 4096", "max_seq_len 2048")
    assert not (tmp_path / "loss").exists()


def test_eval_loss_refuses_an_unbounded_recurrence(tmp_path, capsys):
    code = eval_main(loss_args(tmp_path, "--recurrences", "1,1000000000"))
    one_error_line(capsys, code, "1000000000", str(MAX_RECURRENCE))


def test_eval_loss_refuses_a_batch_larger_than_free_memory(tmp_path, capsys):
    code = eval_main(loss_args(tmp_path, "--batch-size", "100000000", "--seq-len", "2048"))
    one_error_line(capsys, code, "GiB", "free", "--batch-size")


def test_analyze_layers_refuses_a_seq_len_beyond_the_sources_positions(tmp_path, capsys):
    code = analyze_main(
        [str(ASSETS / "tiny_llama"), "--data", str(CORPUS), "--seq-len", "100000000", "--out", str(tmp_path / "a")]
    )
    one_error_line(capsys, code, "--seq-len 100000000", "max_seq_len")
    assert not (tmp_path / "a").exists()


def test_analyze_layers_refuses_an_unbounded_recurrence(tmp_path, capsys):
    code = analyze_main(
        [str(ASSETS / "tiny_llama"), "--data", str(CORPUS), "--recurrences", "1,5000", "--out", str(tmp_path / "a")]
    )
    one_error_line(capsys, code, "5000", str(MAX_RECURRENCE))


def test_generate_refuses_an_unbounded_num_steps(capsys):
    code = generate_main(["--checkpoint", str(MODEL), "--prompt", "1 2", "--num-steps", "1000000000"])
    one_error_line(capsys, code, "--num-steps 1000000000", str(MAX_RECURRENCE))


def test_generate_refuses_a_lookahead_without_a_draft_or_beyond_memory(capsys):
    """--lookahead alone would be ignored; a huge one would allocate its verify block and cache columns."""
    common = ["--checkpoint", str(MODEL), "--prompt", "1 2", "--num-steps", "4"]
    one_error_line(capsys, generate_main([*common, "--lookahead", "3"]), "--lookahead needs --draft-steps")
    code = generate_main([*common, "--draft-steps", "1", "--lookahead", "1000000000"])
    one_error_line(capsys, code, "KV cache", "lookahead")


def test_generate_refuses_a_kv_cache_larger_than_free_memory(tmp_path, capsys):
    """1000 prompts decoded together at r = 1024 with full K/V sharing: ~1 TB of cache, refused before the load."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + 1 ="}) + "\n" for i in range(1000)))
    code = generate_main(
        [
            "--checkpoint",
            str(MODEL),
            "--prompts",
            str(prompts),
            "--num-steps",
            "1024",
            "--batch-size",
            "1000",
            "--max-new-tokens",
            "2000",
        ]
    )
    one_error_line(capsys, code, "KV cache", "GiB", "free", "--kv-sharing latest")


def test_check_allocation_compares_with_the_free_memory():
    cpu = torch.device("cpu")
    free = available_memory(cpu)
    assert free > 0
    check_allocation(1 << 20, cpu, "a small buffer")
    with pytest.raises(ValueError, match="a huge buffer needs .* GiB but cpu has .* GiB free"):
        check_allocation(free * 4, cpu, "a huge buffer")


# ---------------------------------------------------------------------------------- no overwrites


def test_eval_heldout_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "notes.jsonl"
    mine.write_text("my own notes\n")
    argv = ["heldout", "--data", str(CORPUS), "--documents", "3", "--out", str(mine)]
    one_error_line(capsys, eval_main(argv), str(mine), "--force")
    one_error_line(capsys, eval_main([*argv, "--force"]), "refusing to replace", str(mine))
    assert mine.read_text() == "my own notes\n"
    # Its own earlier output is replaced with --force only.
    out = tmp_path / "held.jsonl"
    assert eval_main(["heldout", "--data", str(CORPUS), "--documents", "3", "--out", str(out)]) == 0
    one_error_line(capsys, eval_main(["heldout", "--data", str(CORPUS), "--documents", "2", "--out", str(out)]))
    assert eval_main(["heldout", "--data", str(CORPUS), "--documents", "2", "--out", str(out), "--force"]) == 0
    assert len(out.read_text().splitlines()) == 2


def test_eval_loss_never_replaces_an_earlier_report_without_force(tmp_path, capsys):
    assert eval_main(loss_args(tmp_path)) == 0
    report = tmp_path / "loss" / "validation_loss.json"
    before = report.read_text()
    one_error_line(capsys, eval_main(loss_args(tmp_path, "--recurrences", "2")), str(report), "--force")
    assert report.read_text() == before
    assert eval_main(loss_args(tmp_path, "--recurrences", "2", "--force")) == 0
    assert list(json.loads(report.read_text())["loss"]) == ["2"]
    # A file of another kind under the report's name is refused even with --force.
    report.write_text('{"mine": 1}\n')
    one_error_line(capsys, eval_main(loss_args(tmp_path, "--force")), "refusing to replace")
    assert report.read_text() == '{"mine": 1}\n'


def prepare_args(out: Path, *extra: str) -> list[str]:
    return [
        "--tokenizer",
        str(ASSETS / "tokenizer"),
        "--path",
        str(CORPUS),
        "--out",
        str(out),
        "--workers",
        "1",
        "--max-docs",
        "20",
        *extra,
    ]


def test_prepare_data_refuses_a_non_empty_out_in_one_line(tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    one_error_line(capsys, prepare_main(prepare_args(out)), "not empty", "--force")
    one_error_line(capsys, prepare_main(prepare_args(out, "--force")), "refusing to replace")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_prepare_data_without_a_tokenizer_fails_in_one_line_and_keeps_the_output(tmp_path, capsys):
    """A tokenizer folder without a tokenizer: one line before any work, the previous output kept (it once
    hung: the tokenizer was loaded only in the pool's initializer, whose workers respawned forever)."""
    out = tmp_path / "data"
    assert prepare_main(prepare_args(out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    argv = [sys.executable, "-m", "titan_recur.cli.prepare_data", *prepare_args(out, "--force")]
    argv[argv.index("--tokenizer") + 1] = str(tmp_path)  # a folder without a tokenizer
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)  # a hang fails, not a slow run
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no tokenizer found" in done.stderr, done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_failing_tokenizer_worker_ends_prepare_data(tmp_path):
    """A worker whose start fails (here: no tokenizer in its folder) breaks the pool at once; nothing respawns."""
    with pytest.raises(BrokenProcessPool):
        list(_encoded_chunks(1, str(tmp_path), iter([[{"text": "one"}], [{"text": "two"}]])))


def test_prepare_data_replaces_its_own_output_only_with_force(tmp_path, capsys):
    out = tmp_path / "data"
    assert prepare_main(prepare_args(out)) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    one_error_line(capsys, prepare_main(prepare_args(out)), "not empty")
    assert prepare_main(prepare_args(out, "--force", "--seq-len", "16")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.parquet"]  # v1: no stale metadata.json left
    assert first.keys() == {"metadata.json", "part-00000.parquet"}


# -------------------------------------------------------------------------------------- integrity


@pytest.fixture
def unsealed_model(tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(MODEL, folder)
    (folder / MANIFEST_NAME).unlink()
    return folder


def test_a_model_folder_without_its_manifest_is_refused(unsealed_model, capsys):
    with pytest.raises(UnverifiedFolderError, match="no manifest.json"):
        load_model(unsealed_model)
    code = generate_main(["--checkpoint", str(unsealed_model), "--prompt", "1 2", "--max-new-tokens", "2"])
    one_error_line(capsys, code, "no manifest.json", "--unverified")


def test_unverified_loads_a_folder_without_manifest_and_says_so(unsealed_model, capsys):
    model = load_model(unsealed_model, unverified=True)
    reference = load_model(MODEL)
    ids = torch.tensor([[1, 5, 9, 11]])
    torch.testing.assert_close(model(ids, num_steps=2), reference(ids, num_steps=2), rtol=0, atol=0)
    code = generate_main(
        ["--checkpoint", str(unsealed_model), "--prompt", "1 2", "--max-new-tokens", "2", "--unverified"]
    )
    assert code == 0, capsys.readouterr().err


@pytest.fixture
def unsealed_step(tmp_path) -> Path:
    """A run's DCP step folder (the shipped model's weights) without its manifest."""
    from titan_recur.storage.checkpoint import CheckpointManager, ModelState

    CheckpointManager(
        tmp_path / "checkpoints", {"model": ModelState(load_model(MODEL))}, interval=1, keep_latest_k=0
    ).save(1)
    step = tmp_path / "checkpoints" / "step-1"
    (step / MANIFEST_NAME).unlink()
    return step


def test_a_step_folder_without_its_manifest_needs_unverified(unsealed_step, tmp_path, capsys):
    """generate, eval and export_hf loaded it unchecked without a word (rc 0); model folders need --unverified."""
    from titan_recur.cli.export import main as export_main

    model = ["--checkpoint", str(unsealed_step), "--model-config", str(MODEL)]
    generation = [*model, "--prompt", "1 2", "--max-new-tokens", "2"]
    loss = [*loss_args(tmp_path)[:1], *model, *loss_args(tmp_path)[3:]]
    export = [str(unsealed_step), str(tmp_path / "hf"), "--model-config", str(MODEL)]
    for command, argv in ((generate_main, generation), (eval_main, loss), (export_main, export)):
        one_error_line(capsys, command(argv), f"{unsealed_step} has no manifest.json", "--unverified")
    assert not (tmp_path / "loss").exists() and not (tmp_path / "hf").exists()
    for command, argv in ((generate_main, generation), (eval_main, loss), (export_main, export)):
        assert command([*argv, "--unverified"]) == 0, capsys.readouterr().err


def test_the_shipped_model_folders_are_sealed():
    for folder in (MODEL, ASSETS / "perm_llama"):
        assert (folder / MANIFEST_NAME).is_file(), folder
    load_model(MODEL)  # its checksums match


# ------------------------------------------------------------------------------- undecodable text


def test_generate_names_a_prompt_that_is_not_utf8(capsys):
    # Python keeps the undecodable bytes of an argument as lone surrogates (os.fsdecode).
    code = generate_main(["--checkpoint", str(MODEL), "--prompt", "\udcff\udcfeabc", "--max-new-tokens", "2"])
    one_error_line(capsys, code, "--prompt", "UTF-8")


def test_generate_names_a_prompts_file_that_is_not_utf8(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "1 2"}\n{"prompt": "\xff\xfe"}\n')
    code = generate_main(["--checkpoint", str(MODEL), "--prompts", str(prompts), "--max-new-tokens", "2"])
    one_error_line(capsys, code, str(prompts), "UTF-8", "0xff")


def test_prepare_data_names_a_text_file_that_is_not_utf8(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello\n\nworld \xff\xfe bad\n")
    code = prepare_main(
        [
            "--tokenizer",
            str(ASSETS / "tokenizer"),
            "--path",
            str(bad),
            "--kind",
            "text",
            "--out",
            str(tmp_path / "out"),
            "--workers",
            "1",
        ]
    )
    one_error_line(capsys, code, str(bad), "not UTF-8", "0xff at offset 13")


# ----------------------------------------------------------------------------------------- messages


def test_generate_says_an_hf_export_is_one_and_how_to_load_it(tmp_path, capsys):
    from titan_recur.hf.export import export_hf

    out = tmp_path / "hf"
    export_hf(load_model(MODEL), out, tokenizer_folder=MODEL)
    code = generate_main(["--checkpoint", str(out), "--prompt", "1 2", "--max-new-tokens", "2"])
    line = one_error_line(capsys, code, "is an HF export", "from_pretrained", "trust_remote_code=True")
    assert "missing tensors" not in line


@pytest.mark.parametrize("command", ["generate", "eval loss", "eval harness", "export", "train"])
def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path, capsys, monkeypatch, command):
    """Same size, ids that fit the model, but two tokens swapped: the ids mean other text. generate refused it;
    eval, export and train ran with it."""
    import titan_recur.eval.loading as loading
    from titan_recur.cli.export import main as export_main
    from titan_recur.cli.train import main as train_main

    other = tmp_path / "tok"
    shutil.copytree(ASSETS / "tokenizer", other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["e"], vocab["t"] = vocab["t"], vocab["e"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    out = tmp_path / "out"

    def run(tokenizer: Path) -> int:
        if command == "generate":
            argv = ["--checkpoint", str(MODEL), "--prompt", "the test", "--max-new-tokens", "2"]
            return generate_main([*argv, "--tokenizer", str(tokenizer)])
        if command == "eval loss":
            return eval_main(loss_args(tmp_path, "--tokenizer", str(tokenizer), "--out", str(out)))
        if command == "eval harness":
            pytest.importorskip("lm_eval")
            model_args = f"pretrained={MODEL},tokenizer={tokenizer}"
            return eval_main(["harness", "--model-args", model_args, "--tasks", "gsm8k_cot_recur", "--out", str(out)])
        if command == "export":
            return export_main([str(MODEL), str(out), "--tokenizer", str(tokenizer)])
        config = REPO / "train_configs" / "debug_model.toml"
        argv = ["--config", str(config), "--job.dump_folder", str(out), "--model.path", str(MODEL)]
        return train_main([*argv, "--data.tokenizer", str(tokenizer), "--training.steps", "1"])

    flag = {"eval harness": "tokenizer=", "train": "data.tokenizer"}.get(command, "--tokenizer")
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    one_error_line(capsys, run(other), f"{flag} {other}", "not the tokenizer of")
    assert not out.exists()
    if command in ("generate", "train"):  # the model's own tokenizer, named explicitly, is fine
        monkeypatch.undo()
        assert run(ASSETS / "tokenizer") == 0, capsys.readouterr().err


def test_compare_says_it_wants_run_folders(capsys):
    code = compare_main([str(MODEL), "--data", str(CORPUS), "--out", "/nonexistent/compare"])
    line = one_error_line(capsys, code, "is a model folder", "run folders")
    assert "unknown section" not in line


def test_eval_harness_checks_the_model_before_the_tasks(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    code = eval_main(
        [
            "harness",
            "--model-args",
            f"pretrained={tmp_path / 'missing'}",
            "--tasks",
            "gsm8k_cot_recur",
            "--out",
            str(tmp_path / "h"),
        ]
    )
    one_error_line(capsys, code, str(tmp_path / "missing"), "no such checkpoint")


# ------------------------------------------------------------------------------------ full disk


@pytest.fixture
def full_disk(tmp_path):
    """A tiny real tmpfs (the tests run as root, here and in CI) and a function that fills it up."""
    import subprocess

    folder = tmp_path / "tmpfs"
    folder.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.fail(f"the disk-full tests need to mount a tmpfs (run as root): {mount.stderr.strip()}")

    def fill() -> None:
        with open(folder / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
            except OSError:
                pass

    try:
        yield folder, fill
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # TensorBoard's thread traceback
def test_metrics_close_on_a_full_disk_is_one_warning_not_a_traceback(full_disk, capsys):
    from titan_recur.training.metrics import MetricsLogger

    folder, fill = full_disk
    metrics = MetricsLogger(folder / "dump", enabled=True, tensorboard=True, jsonl=True)
    metrics.open()
    fill()
    with contextlib.suppress(OSError):  # a training step's log reports this one (an I/O failure at step N)
        for step in range(1, 2000):
            metrics.writer.add_scalar("loss", 1.0 / step, step)
    metrics.close()  # raises nothing
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert all("warning: " in line for line in out.out.splitlines() if line.strip()), out.out


# --------------------------------------------------------------------------------- dump-folder lock

HOLD = (
    "import sys, time; from titan_recur.storage.lock import DumpFolderLock; DumpFolderLock.acquire(sys.argv[1]); "
    "print('held', flush=True); time.sleep(600)"
)


def subprocess_env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **extra}


def start_holder(folder: Path, **env: str):
    """A real process that takes the folder's lock and keeps it (sleeping) until killed."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=subprocess_env(**env)
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def kill9(process) -> None:
    import signal

    process.send_signal(signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="module")
def train_config(tiny_model_dir, tmp_path_factory) -> Path:
    from tests.tiny_runs import CORPUS_DATA, write_config

    return write_config(tmp_path_factory.mktemp("lock") / "run.toml", tiny_model_dir, CORPUS_DATA)


def train(config: Path, dump: Path, *extra: str, wait: bool = True):
    import subprocess
    import sys

    argv = [
        sys.executable,
        "-m",
        "titan_recur.train",
        "--config",
        str(config),
        "--job.dump_folder",
        str(dump),
        "--training.global_batch_size",
        "2",
        *extra,
    ]
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    return subprocess.run(argv, capture_output=True, text=True, env=subprocess_env(), timeout=600)


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_dump_folder_is_refused_naming_it(train_config, tmp_path):
    """Two real trainers: the second is refused in one line naming the first; after kill -9 of the first, a
    third takes the stale lock over and finishes."""
    import socket
    import time

    from titan_recur.storage.lock import LOCK_NAME

    dump = tmp_path / "dump"
    first = train(
        train_config,
        dump,
        "--training.steps",
        "100000",
        "--checkpoint.interval",
        "100000",
        "--validation.enable",
        "false",
        wait=False,
    )
    try:
        while not (dump / "metrics.jsonl").is_file() or not (dump / "metrics.jsonl").read_text():
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        second = train(train_config, dump, "--training.steps", "2")
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert f"host {socket.gethostname()}, pid {first.pid}" in lines[0] and "in use by another run" in lines[0]
        assert lines[0].startswith("error: ")
    finally:
        kill9(first)
    assert (dump / LOCK_NAME).is_file(), "kill -9 leaves the lock behind"
    third = train(train_config, dump, "--training.steps", "2")
    assert third.returncode == 0, third.stderr[-3000:]
    assert (
        f"took over the stale lock {dump / LOCK_NAME}" in third.stdout
        and f"process {first.pid} is gone" in third.stdout
    )
    assert not (dump / LOCK_NAME).exists(), "released at the end"


def test_a_requeued_slurm_job_takes_over_its_own_earlier_lock(tmp_path, monkeypatch):
    from titan_recur.storage.lock import DumpFolderLock, DumpFolderLockedError

    holder = start_holder(tmp_path, SLURM_JOB_ID="777", SLURM_RESTART_COUNT="0")
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "778")
        with pytest.raises(DumpFolderLockedError, match=f"pid {holder.pid}, Slurm job 777"):
            DumpFolderLock.acquire(tmp_path)
        # The same job id, once requeued (Slurm counts the restarts): the earlier incarnation's lock.
        monkeypatch.setenv("SLURM_JOB_ID", "777")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        lock = DumpFolderLock.acquire(tmp_path)
        assert lock.holder["slurm_restart_count"] == "1"
        lock.release()
    finally:
        kill9(holder)


def test_a_lock_held_on_another_host_is_refused(tmp_path, monkeypatch):
    from titan_recur.storage.lock import LOCK_NAME, DumpFolderLock, DumpFolderLockedError

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node-elsewhere", "pid": 1, "since": "2026-01-01T00:00:00"}))
    with pytest.raises(DumpFolderLockedError, match="host node-elsewhere, pid 1"):
        DumpFolderLock.acquire(tmp_path)


def _try_acquire(folder: str, queue, done) -> None:
    """Report the outcome, then stay alive (a winner that exited would leave a stale lock for a late racer)."""
    from titan_recur.storage.lock import DumpFolderLock, DumpFolderLockedError

    try:
        DumpFolderLock.acquire(folder)
        queue.put("held")
    except DumpFolderLockedError:
        queue.put("refused")
    done.wait(300)


@pytest.mark.slow
def test_processes_racing_for_a_stale_lock_leave_exactly_one_holder(tmp_path):
    import multiprocessing

    kill9(start_holder(tmp_path))  # a stale lock
    context = multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    racers = [context.Process(target=_try_acquire, args=(str(tmp_path), queue, done)) for _ in range(6)]
    for racer in racers:
        racer.start()
    outcomes = sorted(queue.get(timeout=300) for _ in racers)
    done.set()
    for racer in racers:
        racer.join()
    assert outcomes == ["held"] + ["refused"] * 5


# ------------------------------------------------------------------------------- watchdog, wording


class DictStore:
    """The part of a c10d store the watchdog uses."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


def test_the_heartbeat_names_the_step_the_rank_is_in_not_one_a_poll_behind():
    """Steps shorter than the poll: each step start is published at once (the poll here is 1000 s)."""
    import time

    from titan_recur.training.watchdog import StepWatchdog

    watchdog = StepWatchdog(timeout_s=10_000, rank=0, world_size=2)
    watchdog.poll_s = 1000.0
    store = DictStore()
    watchdog.start(store)
    try:
        for step in range(1, 8):
            watchdog.step_started(step)
            watchdog.step_finished(step)
        watchdog.step_started(8)
        for _ in range(600):  # the watchdog thread runs as soon as it is scheduled
            beat = json.loads(store.values.get("rank_0", "{}"))
            if beat.get("step") == 8:
                break
            time.sleep(0.1)
        assert beat == {**beat, "step": 8, "done": 7}
    finally:
        watchdog.stop()


def test_rank_counts_are_worded_in_the_singular_and_plural():
    from titan_recur.training.trainer import ranks

    assert (ranks(1), ranks(2)) == ("1 rank", "2 ranks")


# ------------------------------------------------------- run lock: containers, checkpoint folder, no links

FLOCK = (
    "import fcntl, sys, time; f = open(sys.argv[1], 'rb'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
    "time.sleep(600)"
)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def plant_lock(folder: Path, **fields) -> Path:
    """A lock file of another run on this host: its pid is dead here (the pid of another PID namespace)."""
    import socket

    from titan_recur.storage.lock import LOCK_NAME

    record = {"host": socket.gethostname(), "pid": dead_pid(), "since": "2026-12-01T00:00:00", "token": "x", **fields}
    (folder / LOCK_NAME).write_text(json.dumps(record) + "\n")
    return folder / LOCK_NAME


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_a_live_holder_in_another_pid_namespace_is_never_judged_gone(tmp_path, monkeypatch):
    """A container on this machine: its pid means nothing here, but the lease it holds on the lock file does."""
    from titan_recur.storage.lock import DumpFolderLock, DumpFolderLockedError

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    path = plant_lock(tmp_path, boot_id=boot_id(), pid_ns="pid:[4026599999]", lease=True)
    leaseholder = subprocess.Popen([sys.executable, "-c", FLOCK, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert leaseholder.stdout.readline().strip() == "held"
        with pytest.raises(DumpFolderLockedError, match="in use by another run"):
            DumpFolderLock.acquire(tmp_path)
    finally:
        kill9(leaseholder)
    lock = DumpFolderLock.acquire(tmp_path)  # its lease is free now: provably gone
    assert lock.holder["lease"] is True and lock.holder["pid_ns"] and lock.holder["boot_id"] == boot_id()
    lock.release()


@pytest.mark.parametrize(
    "fields",
    [{"boot_id": "another-boot", "lease": False}, {"pid_ns": "pid:[4026599999]", "lease": False}, {}],
    ids=["another-machine-same-hostname", "another-namespace-without-lease", "no-boot-id"],
)
def test_a_holder_that_cannot_be_proven_gone_is_refused(tmp_path, monkeypatch, fields):
    """Same hostname, pid dead here: without the same boot and PID namespace, or a lease, nothing proves it gone."""
    from titan_recur.storage.lock import DumpFolderLock, DumpFolderLockedError

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if "pid_ns" in fields:
        fields = {**fields, "boot_id": boot_id()}
    path = plant_lock(tmp_path, **fields)
    with pytest.raises(DumpFolderLockedError, match=f"if that run is gone, delete {path}"):
        DumpFolderLock.acquire(tmp_path)
    assert json.loads(path.read_text())["token"] == "x"


@pytest.mark.parametrize("code", ["EPERM", "ENOTSUP"])
def test_a_file_system_without_hard_links_still_locks(tmp_path, monkeypatch, code):
    """os.link fails (some FUSE and object-store mounts): exclusive create instead; still one holder."""
    import errno
    import os

    from titan_recur.storage.lock import LOCK_NAME, DumpFolderLock, DumpFolderLockedError

    def no_links(src, dst, *args, **kwargs):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(os, "link", no_links)
    lock = DumpFolderLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.holder["token"]
    with pytest.raises(DumpFolderLockedError, match="in use by another run"):
        DumpFolderLock.acquire(tmp_path)
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    DumpFolderLock.acquire(tmp_path).release()


@pytest.mark.slow
def test_two_runs_sharing_a_checkpoint_folder_are_refused(train_config, tmp_path):
    """Another dump folder, the same absolute checkpoint.folder: the checkpoint folder is locked too."""
    checkpoints = tmp_path / "shared_checkpoints"
    holder = start_holder(checkpoints)  # what a run with this checkpoint.folder holds
    try:
        second = train(
            train_config, tmp_path / "dump", "--training.steps", "1", "--checkpoint.folder", str(checkpoints)
        )
    finally:
        kill9(holder)
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
    assert f"checkpoint.folder {checkpoints} is in use by another run (host " in lines[0]
    assert not (checkpoints / "step-1").exists()


FORK_AND_HOLD = (
    "import os, sys, time; from titan_recur.storage.lock import DumpFolderLock; DumpFolderLock.acquire(sys.argv[1])\n"
    "child = os.fork()\n"
    "if child == 0:\n    time.sleep(600)\n    os._exit(0)\n"
    "print(child, flush=True); time.sleep(600)"
)


def test_a_forked_child_does_not_keep_a_dead_runs_lease(tmp_path, monkeypatch):
    """A DataLoader worker forked by the holder may outlive it for a while: the lock is stale once the holder dies."""
    import os
    import signal

    from titan_recur.storage.lock import DumpFolderLock

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", FORK_AND_HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    child = int(holder.stdout.readline())
    try:
        kill9(holder)
        lock = DumpFolderLock.acquire(tmp_path)
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------------------------------- bad --tokenizer


def broken_tokenizer(folder: Path, kind: str) -> Path:
    """A tokenizer folder that does not load: missing, empty, a tokenizer.json or tokenizer_config.json that does not
    parse, or a tokenizer.model that is neither tiktoken nor sentencepiece."""
    if kind == "missing":
        return folder / "missing"
    folder.mkdir()
    if kind == "tokenizer.json":
        (folder / "tokenizer.json").write_text("{not json")
    elif kind == "tokenizer_config.json":
        shutil.copy(MODEL / "tokenizer.json", folder)
        (folder / "tokenizer_config.json").write_text("{not json")
    elif kind == "tokenizer.model":
        (folder / "tokenizer.model").write_text("garbage\n")
    return folder


@pytest.mark.parametrize("kind", ["missing", "empty", "tokenizer.json", "tokenizer_config.json", "tokenizer.model"])
@pytest.mark.parametrize("command", ["export", "eval loss", "eval harness", "generate", "prepare_data", "train"])
def test_a_bad_tokenizer_folder_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, command, kind):
    """generate, prepare_data and train printed the tokenizers or sentencepiece library's traceback."""
    import titan_recur.eval.loading as loading
    from titan_recur.cli.export import main as export_main
    from titan_recur.cli.train import main as train_main

    tokenizer = broken_tokenizer(tmp_path / "tok", kind)
    out = tmp_path / "out"

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(loading, "load_model", no_weights)
    if command == "export":
        code = export_main([str(MODEL), str(out), "--tokenizer", str(tokenizer)])
    elif command == "eval loss":
        code = eval_main(loss_args(tmp_path, "--tokenizer", str(tokenizer), "--out", str(out)))
    elif command == "eval harness":
        pytest.importorskip("lm_eval")
        argv = ["harness", "--model-args", f"pretrained={MODEL},tokenizer={tokenizer}", "--tasks", "gsm8k_cot_recur"]
        code = eval_main([*argv, "--out", str(out)])
    elif command == "generate":
        code = generate_main(["--checkpoint", str(MODEL), "--prompt", "1 2", "--tokenizer", str(tokenizer)])
    elif command == "prepare_data":
        code = prepare_main(
            ["--tokenizer", str(tokenizer), "--path", str(CORPUS), "--kind", "jsonl", "--out", str(out)]
        )
    else:
        config = REPO / "train_configs" / "debug_model.toml"
        code = train_main(["--config", str(config), "--job.dump_folder", str(out), "--data.tokenizer", str(tokenizer)])
    one_error_line(capsys, code, str(tokenizer))
    assert not out.exists()


@pytest.mark.parametrize("ranks, words", [("0", ">= 1, got 0"), ("-2", ">= 1, got -2"), ("1000000000", "1000000000")])
def test_eval_loss_refuses_data_ranks_out_of_bounds(tmp_path, capsys, ranks, words):
    code = eval_main(loss_args(tmp_path, "--data-ranks", ranks))
    one_error_line(capsys, code, "--data-ranks", words)
    assert not (tmp_path / "loss").exists()


@pytest.mark.parametrize("script", sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]))
def test_every_command_answers_a_bad_flag_in_one_line(script, capsys, monkeypatch):
    """Every console script (the `python -m` entry points run the same mains): an unknown flag is one line on
    stderr, exit 2 (half the commands printed argparse's usage block before cli/kit.py's OneLineParser)."""
    module, function = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][script].split(":")
    main = getattr(importlib.import_module(module), function)
    monkeypatch.setattr(sys, "argv", [script, "--no-such-flag"])
    try:
        code = main()
    except SystemExit as exit:
        code = exit.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "error" in lines[0], (code, lines)
