"""The miniature's depth task: generator, splits and harness tasks (the whole pipeline: tests/test_compare.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def depth_task():
    spec = importlib.util.spec_from_file_location("make_depth_task_tool", REPO / "tools" / "make_depth_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def reference_answer(question: str) -> str:
    """Python's own arithmetic on the expression, then mod 10."""
    expression = question.removeprefix("Question: ").split(" (mod 10)")[0]
    return str(eval(expression) % 10)  # noqa: S307 (digits and +/- only, generated here)


def test_splits_answers_and_lengths(depth_task, tmp_path: Path) -> None:
    assert depth_task.main(["--out", str(tmp_path), "--max-steps", "3", "--train-examples", "300",
                            "--eval-examples", "5", "--seed", "7"]) == 0
    train = read_jsonl(tmp_path / "train.jsonl")
    validation, test = read_jsonl(tmp_path / "validation.jsonl"), read_jsonl(tmp_path / "test.jsonl")
    assert len(train) == 300 and [r["steps"] for r in validation] == [n for n in (1, 2, 3) for _ in range(5)]
    assert [r["steps"] for r in test] == [n for n in (4, 5, 6) for _ in range(5)]
    for row in train:
        question, answer = row["text"].rsplit(" ", 1)
        assert question.endswith("\nAnswer:") and reference_answer(question) == answer
        assert 1 <= question.count(" + ") + question.count(" - ") <= 3
    for row in validation + test:
        assert row["answer"] == reference_answer(row["question"]) and row["text"] == f"{row['question']} {row['answer']}"
        assert row["question"].count(" + ") + row["question"].count(" - ") == row["steps"]
    assert not {r["text"] for r in test} & {r["text"] for r in train}
    again = tmp_path / "again"
    depth_task.main(["--out", str(again), "--max-steps", "3", "--train-examples", "300", "--eval-examples", "5",
                     "--seed", "7"])
    assert all((again / f).read_bytes() == (tmp_path / f).read_bytes() for f in ("train.jsonl", "test.jsonl"))


def test_bad_arguments_exit_2(depth_task, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "x").write_text("keep")
    for argv in (["--max-steps", "0"], ["--pretrain", str(tmp_path / "model")]):
        with pytest.raises(SystemExit) as exit_info:
            depth_task.main(["--out", str(tmp_path / "task"), *argv])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "task").exists() and (tmp_path / "model" / "x").read_text() == "keep"


def test_task_yaml_scores_exact_match(depth_task, tmp_path: Path) -> None:
    """The generated harness task: the last number generated is the answer (an oracle 1, an oracle off by one 0)."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    depth_task.main(["--out", str(tmp_path), "--max-steps", "2", "--train-examples", "10", "--eval-examples", "3"])
    answers = {row["question"]: row["answer"] for row in read_jsonl(tmp_path / "test.jsonl")}

    class Oracle(LM):
        def __init__(self, shift: int) -> None:
            super().__init__()
            self.shift = shift

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return [f" 7 - 2 gives {(int(answers[r.args[0]]) + self.shift) % 10}" for r in requests]

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

    for shift, expected in ((0, 1.0), (1, 0.0)):
        result = simple_evaluate(model=Oracle(shift), tasks=[str(tmp_path / "depth_chain_test.yaml")],
                                 task_manager=TaskManager(include_defaults=False, include_path=str(tmp_path)))
        assert result["results"]["depth_chain_test"]["exact_match,flexible-extract"] == expected
