"""[profiling]: a debug run writes a torch.profiler trace and a memory profile for each chosen step."""

import json
import subprocess
import sys

import pytest

from tests.torchrun_util import REPO_ROOT, debug_run_argv
from titan_recur.config import ConfigError, load_config
from titan_recur.training.profiling import trace_path


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
