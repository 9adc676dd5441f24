"""[profiling]: a debug run writes a torch.profiler trace and a memory profile for each chosen step."""

import json
import subprocess
import sys

import pytest

from tests.torchrun_util import REPO_ROOT, debug_run_argv
from titan_recur.config import ConfigError, load_config
from titan_recur.training.profiling import trace_path


@pytest.mark.slow
def test_a_debug_run_writes_a_trace_and_a_memory_profile_of_the_chosen_step(tmp_path):
    dump = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            *debug_run_argv(
                dump,
                "--training.steps",
                "3",
                "--validation.enable",
                "false",
                "--checkpoint.export_final",
                "false",
                "--profiling.trace_steps",
                "2",
                "--profiling.memory_snapshot",
            ),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    folder = dump / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]  # only the chosen step
    trace = json.loads(trace_path(folder, step=2, rank=0).read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"aten::mm", "forward", "backward", "optimizer"} <= names, sorted(n for n in names if n)[:50]
    memory = (folder / "step-2" / "rank0_memory.txt").read_text()
    assert "CPU Mem" in memory and "aten::" in memory
    assert f"profile of step 2 written to {folder / 'step-2'}" in done.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        (["--profiling.trace_steps", "0"], "profiling.trace_steps must be in 1..training.steps (40), got 0"),
        (["--profiling.trace_steps", "51"], "profiling.trace_steps must be in 1..training.steps (40), got 51"),
        (
            ["--profiling.memory_snapshot"],
            "profiling.memory_snapshot is written with a trace: set profiling.trace_steps",
        ),
    ],
)
def test_bad_profiling_options_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("train_configs/debug_model.toml", override)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "save_folder, checkpoint_folder, inside",
    [
        ("checkpoints", "checkpoints", "the checkpoint folder"),
        ("checkpoints/profile", "checkpoints", "the checkpoint folder"),
        ("ckpt/../checkpoints/step-2", "checkpoints", "the checkpoint folder"),
        (".", ".", "the checkpoint folder"),
        ("step-4", ".", "the checkpoint folder"),
        ("final_model", "checkpoints", "the final model folder"),
        ("final_model/traces", "checkpoints", "the final model folder"),
    ],
)
def test_traces_are_never_written_into_checkpoints_or_the_final_model(tmp_path, save_folder, checkpoint_folder, inside):
    """Trace folders are named step-N like checkpoints: among them a save sets a trace aside (or a trace
    lands in a checkpoint), and in final_model/ they break the export at the end of the run."""
    dump = tmp_path / "run"
    override = ["--job.dump_folder", str(dump), "--checkpoint.folder", checkpoint_folder]
    override += ["--profiling.trace_steps", "2", "--profiling.save_folder", save_folder]
    with pytest.raises(ConfigError) as err:
        load_config("train_configs/debug_model.toml", override)
    assert f"profiling.save_folder {save_folder!r} would write into {inside}" in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "save_folder, checkpoint_folder", [("profile", "checkpoints"), ("profile", "."), (".", "ckpt")]
)
def test_trace_folders_beside_the_checkpoints_are_accepted(tmp_path, save_folder, checkpoint_folder):
    override = ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.folder", checkpoint_folder]
    override += ["--profiling.trace_steps", "2", "--profiling.save_folder", save_folder]
    assert load_config("train_configs/debug_model.toml", override).profiling.save_folder == save_folder


@pytest.mark.parametrize("save_folder", ["/elsewhere/traces", "../traces", "profile/../../traces"])
def test_trace_folders_outside_the_dump_folder_are_refused(tmp_path, save_folder):
    """Every output of a run stays in its dump folder: an absolute or ../ save_folder wrote beside it silently."""
    override = ["--job.dump_folder", str(tmp_path / "run"), "--profiling.trace_steps", "2"]
    with pytest.raises(ConfigError) as err:
        load_config("train_configs/debug_model.toml", [*override, "--profiling.save_folder", save_folder])
    assert str(err.value) == (
        f"invalid config: profiling.save_folder {save_folder!r} is outside job.dump_folder ({tmp_path / 'run'}): "
        "traces stay with the run; give a folder relative to it (default 'profile')"
    )
    inside = str(tmp_path / "run" / "traces")  # an absolute path into the dump folder is that folder
    assert load_config("train_configs/debug_model.toml", [*override, "--profiling.save_folder", inside])


@pytest.mark.parametrize("check", [False, True])
def test_a_trace_folder_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, check):
    """It failed at the traced step (exit 1) after the run had started; now one line, exit 2, nothing written."""
    from titan_recur.cli.train import main

    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "traces").write_text("keep me")
    argv = ["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(dump), "--training.steps", "2"]
    argv += ["--profiling.trace_steps", "1", "--profiling.save_folder", "traces/cpu"] + (["--check"] if check else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {dump / 'traces'} exists and is not a folder (profiling.save_folder)\n", err
    assert sorted(p.name for p in dump.iterdir()) == ["traces"] and (dump / "traces").read_text() == "keep me"
