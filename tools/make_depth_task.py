"""Generate a task that needs depth and has exact answers (the miniature reproduction's task).

    python tools/make_depth_task.py --out outputs/perm_task [--train-lengths 1-12] [--eval-lengths 1-12] [--seed 0]
    python tools/make_depth_task.py --task mod10 --out outputs/depth_task --max-steps 3

Two tasks:

- perm (default): state tracking under fixed permutations. A start state (0-7) and a chain of
  operators, each naming one of two fixed, non-commuting permutations of the 8 states; the answer is
  the state after applying them left to right: ``3 a b a = 5``. The permutations are drawn from
  --perm-seed until the two generate the alternating group A_8 (non-abelian, so the answer is no
  sum: a chain of k operators takes k dependent updates of a hidden state, the word problem on which
  a fixed-depth transformer runs out of depth as chains grow). One token per state and operator in
  the bundled tokenizer; chance is 1/8.
- mod10: chains of + and - digit operations mod 10 (``Question: 6 + 5 - 7 (mod 10)\\nAnswer: 4``).

Writes under OUT (fixed seeds, deterministic):
  train.jsonl           training records, lengths uniform in --train-lengths (perm) or 1..max_steps (mod10);
                        each with "prompt", "completion" (train them with format = "prompt_completion": the
                        loss on the answer only) and "text" (prompt + completion: the loss on every token)
  validation.jsonl      --eval-examples fresh records per evaluation length, shuffled: the held-out loss
                        (answer-only with `--format prompt_completion`)
  eval_<length>.jsonl   per length: "prompt", "answer", "length", "completion", "text"
  <prefix>_<length>.yaml one lm-eval-harness task per length (greedy generation, exact match), plus
                        <prefix>.yaml, the group of all of them; give the YAMLs to the harness or
                        tools/compare.py as --task
  task.json             the task's parameters (and the permutations)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

STATE_COUNT = 8
OPERATOR_NAMES = "ab"
A8_ORDER = 20160  # |A_8| = 8! / 2
MODULUS = 10


class Parser(argparse.ArgumentParser):
    """Errors as one line on stderr, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


# ----------------------------------------------------------------------------------------- perm


def _is_even(perm: tuple[int, ...]) -> bool:
    seen, transpositions = set(), 0
    for start in range(len(perm)):
        length, i = 0, start
        while i not in seen:
            seen.add(i)
            i, length = perm[i], length + 1
        transpositions += max(length - 1, 0)
    return transpositions % 2 == 0


def group_order(generators: list[tuple[int, ...]]) -> int:
    """Order of the group the permutations generate (closure by breadth-first search; at most |A_8| here)."""
    identity = tuple(range(len(generators[0])))
    seen, frontier = {identity}, [identity]
    while frontier:
        nxt = []
        for g in frontier:
            for h in generators:
                gh = tuple(h[g[i]] for i in range(len(g)))
                if gh not in seen:
                    seen.add(gh)
                    nxt.append(gh)
        frontier = nxt
    return len(seen)


def draw_permutations(seed: int, states: int = STATE_COUNT, count: int = len(OPERATOR_NAMES)) -> list[list[int]]:
    """Even permutations drawn from ``seed`` until they generate A_states (for 8 states: order 20,160)."""
    rng = random.Random(seed)
    full = 1
    for n in range(3, states + 1):
        full *= n  # |A_n| = n! / 2
    while True:
        perms = []
        while len(perms) < count:
            p = list(range(states))
            rng.shuffle(p)
            if _is_even(tuple(p)):
                perms.append(tuple(p))
        if group_order(perms) == full:
            return [list(p) for p in perms]


def perm_example(rng: random.Random, perms: list[list[int]], length: int) -> dict[str, object]:
    """A start state and ``length`` operators; the answer is the state after them, applied left to right."""
    state = rng.randrange(len(perms[0]))
    ops = [rng.randrange(len(perms)) for _ in range(length)]
    prompt = " ".join([str(state), *(OPERATOR_NAMES[o] for o in ops), "="])
    for o in ops:
        state = perms[o][state]
    return {"prompt": prompt, "answer": str(state), "length": length}


# ----------------------------------------------------------------------------------------- mod10


def mod10_example(rng: random.Random, length: int) -> dict[str, object]:
    """A start digit and ``length`` operations (+ or - a digit 1..9); the answer is the result mod 10."""
    value = rng.randrange(MODULUS)
    terms = [str(value)]
    for _ in range(length):
        sign, digit = rng.choice("+-"), rng.randint(1, 9)
        value = (value + digit if sign == "+" else value - digit) % MODULUS
        terms.append(f"{sign} {digit}")
    return {"prompt": f"Question: {' '.join(terms)} (mod {MODULUS})\nAnswer:", "answer": str(value), "length": length}


# ----------------------------------------------------------------------------------------- splits


def record(row: dict[str, object]) -> dict[str, object]:
    """A row with its completion (the answer after one space) and its text (prompt + completion)."""
    completion = f" {row['answer']}"
    return {**row, "completion": completion, "text": f"{row['prompt']}{completion}"}


def generate(
    make: Callable[[random.Random, int], dict[str, object]],
    train_lengths: range,
    eval_lengths: range,
    train_examples: int,
    eval_examples: int,
    seed: int,
) -> dict[str, list[dict]]:
    """Training records, one evaluation split per length, and the shuffled validation file, from one seed.

    Short chains have few distinct questions (perm: 8 x 2^k), so evaluation at a training length
    measures in-distribution accuracy on questions training has mostly seen; longer lengths are fresh.
    """
    rng = random.Random(seed)
    train = [record(make(rng, rng.choice(train_lengths))) for _ in range(train_examples)]
    splits = {f"eval_{n}": [record(make(rng, n)) for _ in range(eval_examples)] for n in eval_lengths}
    validation = [
        {k: row[k] for k in ("prompt", "completion", "text", "length")} for rows in splits.values() for row in rows
    ]
    random.Random(seed + 1).shuffle(validation)
    fields = ("prompt", "completion", "text")
    return {"train": [{k: row[k] for k in fields} for row in train], "validation": validation, **splits}


def task_yaml(name: str, data_file: Path, max_gen_toks: int = 2) -> str:
    """A zero-shot generation task: greedy until a newline, exact match of the last number with the answer."""
    return f"""# Generated by tools/make_depth_task.py: exact match of the last number generated after the prompt.
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data_file.resolve()))}
output_type: generate_until
test_split: test
num_fewshot: 0
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
filter_list:
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def group_yaml(name: str, tasks: list[str]) -> str:
    return "\n".join(
        [
            "# Generated by tools/make_depth_task.py: every evaluation length, averaged over the questions.",
            f"group: {name}",
            "task:",
            *(f"  - {t}" for t in tasks),
            "aggregate_metric_list:",
            "  - metric: exact_match",
            "    aggregation: mean",
            "    weight_by_size: true",
            "metadata:",
            "  version: 1.0",
            "",
        ]
    )


def write(out: Path, splits: dict[str, list[dict]], prefix: str, params: dict[str, object]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written, tasks = [], []
    for split, rows in splits.items():
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        written.append(path)
        if split.startswith("eval_"):
            name = f"{prefix}_{split.removeprefix('eval_')}"
            yaml = out / f"{name}.yaml"
            yaml.write_text(task_yaml(name, path))
            written.append(yaml)
            tasks.append(name)
    group = out / f"{prefix}.yaml"
    group.write_text(group_yaml(prefix, tasks))
    (out / "task.json").write_text(json.dumps(params, indent=2) + "\n")
    return [*written, group, out / "task.json"]


def parse_lengths(text: str) -> range:
    """'7-12' -> range(7, 13); '4' -> range(4, 5)."""
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length or a range A-B, got {text!r}") from None
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"lengths must be 1 <= A <= B, got {text!r}")
    return range(first, last + 1)


def build_parser() -> Parser:
    p = Parser(prog="make_depth_task.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (its task files are replaced)")
    p.add_argument("--task", choices=["perm", "mod10"], default="perm", help="which task (default perm)")
    p.add_argument(
        "--train-lengths",
        type=parse_lengths,
        default=None,
        help="training chain lengths A-B (default: perm 1-12; mod10 1-max_steps)",
    )
    p.add_argument(
        "--eval-lengths",
        type=parse_lengths,
        default=None,
        help="evaluation lengths A-B, one task each (default: perm 1-12; mod10 1-2*max_steps)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=4,
        help="mod10: longest training chain; evaluation runs to 2 x max_steps (default 4)",
    )
    p.add_argument("--train-examples", type=int, default=100_000, help="training records (default 100000)")
    p.add_argument("--eval-examples", type=int, default=100, help="evaluation records per length (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the questions (default 0)")
    p.add_argument("--perm-seed", type=int, default=0, help="perm: seed of the two permutations (default 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.max_steps < 1 or ns.train_examples < 1 or ns.eval_examples < 1:
        parser.error("--max-steps, --train-examples and --eval-examples must be >= 1")
    if ns.task == "perm":
        perms = draw_permutations(ns.perm_seed)
        train_lengths, eval_lengths = ns.train_lengths or range(1, 13), ns.eval_lengths or range(1, 13)
        make, prefix = (lambda rng, n: perm_example(rng, perms, n)), "perm"
        params = {
            "task": "perm",
            "states": STATE_COUNT,
            "operators": list(OPERATOR_NAMES),
            "permutations": perms,
            "perm_seed": ns.perm_seed,
        }
    else:
        train_lengths = ns.train_lengths or range(1, ns.max_steps + 1)
        eval_lengths = ns.eval_lengths or range(1, 2 * ns.max_steps + 1)
        make, prefix, params = mod10_example, "mod10", {"task": "mod10", "modulus": MODULUS}
    params.update(
        train_lengths=[train_lengths[0], train_lengths[-1]],
        eval_lengths=[eval_lengths[0], eval_lengths[-1]],
        train_examples=ns.train_examples,
        eval_examples=ns.eval_examples,
        seed=ns.seed,
    )
    splits = generate(make, train_lengths, eval_lengths, ns.train_examples, ns.eval_examples, ns.seed)
    written = write(ns.out, splits, prefix, params)
    print(
        f"wrote {len(written)} files under {ns.out} ({prefix}: train lengths {train_lengths[0]}-{train_lengths[-1]}, "
        f"evaluation lengths {eval_lengths[0]}-{eval_lengths[-1]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
