"""Held-out GSM8K-style questions of a training config's data as an lm-eval-harness task.

    python tools/make_math_task.py --config TRAIN.toml --out DIR [--questions N] [--max-gen-toks 64]

The questions are the documents of the bundled math format (``Question: ...\\nAnswer: ...\\n#### 42``,
assets/corpus/math.jsonl) in the config's validation split, which training never reads (the hash split
of ``data.validation_fraction``, or ``[[data.validation_sources]]``). That is checked here rather than
trusted: every training document of the config is read, and an evaluation question whose text occurs
in any of them (the same question with another worked answer, say) is dropped and counted. Writes under
DIR:
  questions.jsonl  "prompt" (``Question: ...\\nAnswer:``), "answer" (the number after ####), "question"
  math_heldout.yaml  the task: zero-shot, greedy until a blank line or the next question, exact match of
                   the last number generated with the answer (flexible-extract, as GSM8K is scored)
  task.json        counts: held-out math documents, questions dropped for occurring in training, written
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from make_depth_task import task_yaml  # a sibling: tools/ is sys.path[0] for a script

from titan_recur.cli.kit import OneLineParser
from titan_recur.config import load_config
from titan_recur.data.loader import heldout_documents, training_documents

TASK_NAME = "math_heldout"
_PROBLEM = re.compile(r"Question: (?P<question>.+?)\nAnswer: (?P<work>.+)\n#### (?P<answer>-?[0-9][0-9,]*)\s*$", re.S)
_QUESTION = re.compile(r"Question: (.+?)\nAnswer:", re.S)
# Greedy generation stops at a blank line, at the next question (a model that goes on to invent one)
# or at the end-of-text tokens of the common chat formats.
STOP = ("\n\n", "Question:", "<|im_end|>", "<|endoftext|>", "</s>")


def problem(doc: object) -> dict[str, str] | None:
    """The question and answer of a math-format document; None for any other document."""
    match = _PROBLEM.match(doc) if isinstance(doc, str) else None
    if match is None:
        return None
    question = match["question"].strip()
    return {
        "prompt": f"Question: {question}\nAnswer:",
        "answer": match["answer"].replace(",", ""),
        "question": question,
    }


def training_questions(config_data) -> set[str]:
    """The question text of every training document that has one."""
    return {
        m.group(1).strip()
        for doc in training_documents(config_data)
        if isinstance(doc, str)
        for m in _QUESTION.finditer(doc)
    }


def held_out_questions(config_data, limit: int) -> tuple[list[dict[str, str]], dict[str, int]]:
    """Up to ``limit`` distinct held-out questions that no training document contains, and the counts."""
    seen = training_questions(config_data)
    rows: dict[str, dict[str, str]] = {}
    counts = {"held_out_math_documents": 0, "dropped_in_training": 0, "dropped_repeated": 0}
    for doc in heldout_documents(config_data):
        row = problem(doc)
        if row is None:
            continue
        counts["held_out_math_documents"] += 1
        if row["question"] in seen:
            counts["dropped_in_training"] += 1
        elif row["question"] in rows:
            counts["dropped_repeated"] += 1
        elif len(rows) < limit:
            rows[row["question"]] = row
    counts["questions"] = len(rows)
    return list(rows.values()), counts


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="make_math_task.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, type=Path, help="the training config (its data and split)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist or be empty)")
    parser.add_argument("--questions", type=int, default=200, help="at most this many questions (default 200)")
    parser.add_argument("--max-gen-toks", type=int, default=64, help="generation budget per question (default 64)")
    args = parser.parse_args(argv)
    if args.questions < 1 or args.max_gen_toks < 1:
        parser.error("--questions and --max-gen-toks take an integer >= 1")
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out} exists and is not an empty folder")
    try:
        rows, counts = held_out_questions(load_config(str(args.config)).data, args.questions)
    except ValueError as err:
        parser.error(str(err))
    if not rows:
        parser.error(
            f"the validation split of {args.config} holds no question of the math format (Question/Answer/####)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "questions.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (args.out / f"{TASK_NAME}.yaml").write_text(task_yaml(TASK_NAME, data, args.max_gen_toks, STOP))
    (args.out / "task.json").write_text(json.dumps({"config": str(args.config), **counts}, indent=2) + "\n")
    print(
        f"wrote {counts['questions']} held-out questions to {data} ({counts['dropped_in_training']} dropped: "
        f"their text occurs in a training document) and the task {args.out / TASK_NAME}.yaml"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
