"""docs/evaluation.md "Offline": a task copied to read a local dataset folder runs with the network off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "assets" / "tiny_llama_recurrent"
# The README of the openai/gsm8k dataset repository: its `configs` map "main" to the parquet files.
README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


def gsm8k_like_folder(folder: Path) -> Path:
    """A dataset folder with the layout `hf download openai/gsm8k --repo-type dataset` writes."""
    rows = {
        "question": ["What is 2 plus 3?", "What is 4 plus 4?", "What is 1 plus 6?"],
        "answer": ["2 + 3 = 5\n#### 5", "4 + 4 = 8\n#### 8", "1 + 6 = 7\n#### 7"],
    }
    (folder / "main").mkdir(parents=True)
    for split in ("train", "test"):
        datasets.Dataset.from_dict(rows).to_parquet(str(folder / "main" / f"{split}-00000-of-00001.parquet"))
    (folder / "README.md").write_text(README)
    return folder


@pytest.mark.slow
def test_the_documented_local_folder_recipe_runs_offline(tmp_path: Path) -> None:
    data = gsm8k_like_folder(tmp_path / "datasets" / "gsm8k")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shipped = (REPO / "titan_recur" / "tasks" / "gsm8k_cot_recur.yaml").read_text()
    local = shipped.replace("\ntask: gsm8k_cot_recur\n", "\ntask: gsm8k_cot_recur_local\n")
    local = local.replace("\ndataset_path: openai/gsm8k\n", f"\ndataset_path: {data}\n")
    assert local.count("gsm8k_cot_recur_local") == 1 and str(data) in local  # the doc's two sed edits applied
    (tasks / "gsm8k_cot_recur_local.yaml").write_text(local)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty_cache")}
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_recur.eval",
            "harness",
            "--model_args",
            f"pretrained={MODEL},max_gen_toks=16",
            "--include_path",
            str(tasks),
            "--tasks",
            "gsm8k_cot_recur_local",
            "--recurrences",
            "1",
            "--limit",
            "2",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| gsm8k_cot_recur_local |" in (out / "table.md").read_text()
