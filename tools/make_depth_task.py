"""Generate a task that needs depth and has exact answers (the miniature reproduction's tasks).

    python tools/make_depth_task.py --out outputs/perm_task [--train-lengths 1-12] [--eval-lengths 1-12] [--seed 0]
    python tools/make_depth_task.py --task arith --out outputs/arith_task
    python tools/make_depth_task.py --task mod10 --out outputs/depth_task --max-steps 3

Three tasks:

- perm (default): state tracking under fixed permutations. A start state (0-7) and a chain of
  operators, each naming one of two fixed, non-commuting permutations of the 8 states; the answer is
  the state after applying them left to right: ``3 a b a = 5``. The permutations are drawn from
  --perm-seed until the two generate the alternating group A_8 (non-abelian, so the answer is no
  sum: a chain of k operators takes k dependent updates of a hidden state, the word problem on which
  a fixed-depth transformer runs out of depth as chains grow). One token per state and operator in
  the bundled tokenizer; chance is 1/8.
- arith: modular arithmetic in words with variable bindings, closer to the paper's math:
  ``a = 3 ; b = a + 5 ; c = b * 7 ; d = c - a ; d mod 10 ?`` (each step combines the previous variable
  with a digit or an earlier variable); chance is 1/10.
- mod10: chains of + and - digit operations mod 10 (``Question: 6 + 5 - 7 (mod 10)\nAnswer: 4``).

Evaluation questions are distinct within a length and held out of the training file by construction
wherever the length has enough questions: twice as many as are drawn for perm and mod10, ten times for
arith, whose questions are far from equally likely (a training draw that hits one is drawn again).
Shorter lengths (perm: 8 x 2^k questions, so 1-4 at 100 per length; arith: 230 at length 1) are not
held out, and the output and task.json say which lengths are which. Lengths beyond training (the
extrapolation split, perm and arith 13-16 by default) are held out by definition.

Writes under OUT (fixed seeds, deterministic):
  train.jsonl           training records, lengths uniform in --train-lengths (perm, arith) or 1..max_steps (mod10);
                        each with "prompt", "completion" (train them with format = "prompt_completion": the
                        loss on the answer only) and "text" (prompt + completion: the loss on every token)
  validation.jsonl      the evaluation questions of the in-range lengths, shuffled: the held-out loss
                        (answer-only with `--format prompt_completion`)
  eval_<length>.jsonl   per length: "prompt", "answer", "length", "completion", "text"
  <prefix>_<length>.yaml one lm-eval-harness task per length (greedy generation, exact match), plus
                        <prefix>.yaml, the group of the in-range lengths, and <prefix>_extrapolation.yaml, the
                        group of the extrapolation lengths; give the YAMLs to the harness or tools/compare.py
                        as --task
  task.json             the task's parameters (the permutations; which lengths are held out)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STATE_COUNT = 8
OPERATOR_NAMES = "ab"
A8_ORDER = 20160  # |A_8| = 8! / 2
MODULUS = 10
ARITH_VARIABLES = "abcdefghijklmnopq"  # a start binding and up to 16 steps
ARITH_OPERATIONS = "+-*"
ARITH_FACTORS = (3, 7, 9)  # the multipliers: units mod 10
# Bounds of the arguments (in --help): far beyond the miniature's (lengths 1-16, 100,000 records), and small
# enough that the largest request takes a minute and a few GB, not a MemoryError or an hour.
MAX_LENGTH = 64
MAX_TRAIN_EXAMPLES = 1_000_000
MAX_EVAL_EXAMPLES = 10_000


class Parser(argparse.ArgumentParser):
    """Errors as one line on stderr, exit status 2: ``titan_recur.cli.kit.OneLineParser``, kept here because this
    script imports only the standard library (importing titan_recur would load torch for every task it writes)."""

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


def perm_questions(length: int) -> int:
    """Distinct perm questions of a length: a start state and one of the operators per step."""
    return STATE_COUNT * len(OPERATOR_NAMES) ** length


def perm_example(rng: random.Random, perms: list[list[int]], length: int) -> dict[str, object]:
    """A start state and ``length`` operators; the answer is the state after them, applied left to right."""
    state = rng.randrange(len(perms[0]))
    ops = [rng.randrange(len(perms)) for _ in range(length)]
    prompt = " ".join([str(state), *(OPERATOR_NAMES[o] for o in ops), "="])
    for o in ops:
        state = perms[o][state]
    return {"prompt": prompt, "answer": str(state), "length": length}


# ----------------------------------------------------------------------------------------- mod10


def mod10_questions(length: int) -> int:
    """Distinct mod10 questions of a length: a start digit, then a sign and a digit 1-9 per step."""
    return MODULUS * 18**length


def mod10_example(rng: random.Random, length: int) -> dict[str, object]:
    """A start digit and ``length`` operations (+ or - a digit 1..9); the answer is the result mod 10."""
    value = rng.randrange(MODULUS)
    terms = [str(value)]
    for _ in range(length):
        sign, digit = rng.choice("+-"), rng.randint(1, 9)
        value = (value + digit if sign == "+" else value - digit) % MODULUS
        terms.append(f"{sign} {digit}")
    return {"prompt": f"Question: {' '.join(terms)} (mod {MODULUS})\nAnswer:", "answer": str(value), "length": length}


# ----------------------------------------------------------------------------------------- arith


def arith_example(rng: random.Random, length: int) -> dict[str, object]:
    """``a = 3 ; b = a + 5 ; c = b * 7 ; d = c - a ; d mod 10 ?``: a digit bound to a, then ``length``
    bindings, each the previous variable plus or minus a digit 1-9 or an earlier variable, or times 3, 7
    or 9 (units mod 10, so no step forgets the value before it); the answer is the last variable mod 10,
    which needs every binding in order."""
    if length >= len(ARITH_VARIABLES):
        raise ValueError(f"arith chains have at most {len(ARITH_VARIABLES) - 1} steps, got {length}")
    values = [rng.randrange(MODULUS)]
    parts = [f"a = {values[0]}"]
    for step in range(1, length + 1):
        operation = rng.choice(ARITH_OPERATIONS)
        if operation == "*":
            operand = rng.choice(ARITH_FACTORS)
            name = str(operand)
        elif rng.random() < 0.5:
            operand = rng.randint(1, 9)
            name = str(operand)
        else:
            earlier = rng.randrange(step)
            operand, name = values[earlier], ARITH_VARIABLES[earlier]
        previous = values[-1]
        result = {"+": previous + operand, "-": previous - operand, "*": previous * operand}[operation]
        values.append(result % MODULUS)
        parts.append(f"{ARITH_VARIABLES[step]} = {ARITH_VARIABLES[step - 1]} {operation} {name}")
    prompt = " ; ".join([*parts, f"{ARITH_VARIABLES[length]} mod {MODULUS} ?"])
    return {"prompt": prompt, "answer": str(values[-1]), "length": length}


def arith_questions(length: int) -> int:
    """Distinct arith questions of a length: a start digit, then per step + or - with a digit or an earlier
    variable, or * with a unit."""
    return MODULUS * math.prod(2 * (9 + step) + len(ARITH_FACTORS) for step in range(1, length + 1))


@dataclass(frozen=True)
class Task:
    """A task's question maker, the number of distinct questions of each length, its default lengths, and how
    many questions a length needs per evaluation draw for its evaluation questions to be held out of training."""

    name: str
    make: Callable[[random.Random, int], dict[str, object]]
    questions: Callable[[int], int]
    lengths: range = range(1, 13)
    extrapolation: range | None = range(13, 17)
    # Why arith needs more than 2: distinct draws from a skewed distribution take its likeliest questions
    # first (`a = 3 ; b = a - a` has probability 1/60, `a = 3 ; b = a + 5` 1/540). At length 1 the 100 drawn
    # of 230 carry ~70% of the mass; held out, they left training the rare rest (make_mini_source.sh's
    # 1-2 phase: no `b = a + a` or `b = a - a` at all) and evaluated exactly what it never saw.
    hold_out_factor: int = 2


TASK_NAMES = ("perm", "mod10", "arith")


# ----------------------------------------------------------------------------------------- splits


def record(row: dict[str, object]) -> dict[str, object]:
    """A row with its completion (the answer after one space) and its text (prompt + completion)."""
    completion = f" {row['answer']}"
    return {**row, "completion": completion, "text": f"{row['prompt']}{completion}"}


def generate(
    task: Task,
    train_lengths: range,
    eval_lengths: range,
    extrapolation_lengths: range | None,
    train_examples: int,
    eval_examples: int,
    seed: int,
) -> tuple[dict[str, list[dict]], list[int]]:
    """One evaluation split per length (distinct questions wherever the length has enough), the training
    records, and the shuffled validation file (the in-range evaluation questions), from one seed.

    Held out by construction: an evaluation question of a length whose questions are at least
    task.hold_out_factor times as many as the evaluation draws never occurs in the training file (a
    training draw that hits one is redrawn). Shorter lengths have too few questions to hold out (perm:
    8 x 2^k, so 1-4 at 100 questions per length; arith: 230 at length 1): their evaluation measures
    questions training may have seen. Returns the splits and the held-out lengths.
    """
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {}
    held_out_prompts: set[object] = set()
    held_out: list[int] = []
    for n in [*eval_lengths, *(extrapolation_lengths or [])]:
        rows = draw_questions(task, rng, n, eval_examples)
        splits[f"eval_{n}"] = [record(row) for row in rows]
        if n not in train_lengths or task.questions(n) >= task.hold_out_factor * eval_examples:
            held_out.append(n)
            held_out_prompts |= {row["prompt"] for row in rows}
    train: list[dict] = []
    while len(train) < train_examples:
        row = task.make(rng, rng.choice(train_lengths))
        if row["prompt"] not in held_out_prompts:
            train.append(record(row))
    validation = [
        {k: row[k] for k in ("prompt", "completion", "text", "length")}
        for n in eval_lengths
        for row in splits[f"eval_{n}"]
    ]
    random.Random(seed + 1).shuffle(validation)
    fields = ("prompt", "completion", "text")
    return {"train": [{k: row[k] for k in fields} for row in train], "validation": validation, **splits}, held_out


def draw_questions(task: Task, rng: random.Random, length: int, count: int) -> list[dict[str, object]]:
    """``count`` questions of one length, without repeats when the length has that many."""
    if task.questions(length) < count:
        return [task.make(rng, length) for _ in range(count)]
    rows: dict[object, dict[str, object]] = {}
    while len(rows) < count:
        row = task.make(rng, length)
        rows.setdefault(row["prompt"], row)
    return list(rows.values())


def task_yaml(name: str, data_file: Path, max_gen_toks: int = 2, until: tuple[str, ...] = ("\n",)) -> str:
    """A zero-shot generation task: greedy until a newline (or ``until``), exact match of the last number
    generated with the answer."""
    return f"""# Generated by tools/make_depth_task.py (task_yaml): exact match of the last number generated after the prompt.
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
  until: {json.dumps(list(until))}
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
    """The jsonl files, one harness task per evaluation length, the group of the in-range lengths
    (<prefix>.yaml) and of the extrapolation lengths (<prefix>_extrapolation.yaml), and task.json."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    groups: dict[str, list[str]] = {prefix: [], f"{prefix}_extrapolation": []}
    extrapolation = set(params.get("extrapolation_lengths") or [])
    for split, rows in splits.items():
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        written.append(path)
        if split.startswith("eval_"):
            length = int(split.removeprefix("eval_"))
            name = f"{prefix}_{length}"
            yaml = out / f"{name}.yaml"
            yaml.write_text(task_yaml(name, path))
            written.append(yaml)
            groups[f"{prefix}_extrapolation" if length in extrapolation else prefix].append(name)
    for group, tasks in groups.items():
        if tasks:
            (out / f"{group}.yaml").write_text(group_yaml(group, tasks))
            written.append(out / f"{group}.yaml")
    (out / "task.json").write_text(json.dumps(params, indent=2) + "\n")
    return [*written, out / "task.json"]


def parse_lengths(text: str) -> range:
    """'7-12' -> range(7, 13); '4' -> range(4, 5). An open range ('1-') is an error, not '1'."""
    low, dash, high = text.partition("-")
    try:
        first, last = int(low), int(high if dash else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length or a range A-B, got {text!r}") from None
    if not 1 <= first <= last <= MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"lengths must be 1 <= A <= B <= {MAX_LENGTH}, got {text!r}")
    return range(first, last + 1)


def bounded_count(limit: int) -> Callable[[str], int]:
    """An argparse type: an integer from 1 to ``limit``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not 1 <= value <= limit:
            raise argparse.ArgumentTypeError(f"expected 1 to {limit}, got {value}")
        return value

    return parse


def optional_lengths(text: str) -> range:
    """parse_lengths, or 'none': no lengths."""
    return range(0) if text == "none" else parse_lengths(text)


def build_parser() -> Parser:
    p = Parser(prog="make_depth_task.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (its task files are replaced)")
    p.add_argument("--task", choices=list(TASK_NAMES), default="perm", help="which task (default perm)")
    p.add_argument(
        "--train-lengths",
        type=parse_lengths,
        default=None,
        help=f"training chain lengths A-B, at most {MAX_LENGTH} (default: perm and arith 1-12; mod10 1-max_steps)",
    )
    p.add_argument(
        "--eval-lengths",
        type=parse_lengths,
        default=None,
        help=f"evaluation lengths A-B (at most {MAX_LENGTH}), one task each (default: the training lengths; "
        "mod10 1-2*max_steps)",
    )
    p.add_argument(
        "--extrapolation-lengths",
        type=optional_lengths,
        default=None,
        help="lengths beyond training, one task each and their own group (default: perm and arith 13-16; "
        "mod10 none); 'none' for none",
    )
    p.add_argument(
        "--max-steps",
        type=bounded_count(MAX_LENGTH // 2),
        default=4,
        help=f"mod10: longest training chain; evaluation runs to 2 x max_steps (default 4, at most {MAX_LENGTH // 2})",
    )
    p.add_argument(
        "--train-examples",
        type=bounded_count(MAX_TRAIN_EXAMPLES),
        default=100_000,
        help=f"training records (default 100000, at most {MAX_TRAIN_EXAMPLES})",
    )
    p.add_argument(
        "--eval-examples",
        type=bounded_count(MAX_EVAL_EXAMPLES),
        default=100,
        help=f"evaluation records per length (default 100, at most {MAX_EVAL_EXAMPLES})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the questions (default 0)")
    p.add_argument("--perm-seed", type=int, default=0, help="perm: seed of the two permutations (default 0)")
    return p


def build_task(ns: argparse.Namespace) -> tuple[Task, dict[str, object]]:
    """The chosen task and the parameters task.json records about it."""
    if ns.task == "perm":
        perms = draw_permutations(ns.perm_seed)
        params: dict[str, object] = {
            "task": "perm",
            "states": STATE_COUNT,
            "operators": list(OPERATOR_NAMES),
            "permutations": perms,
            "perm_seed": ns.perm_seed,
        }
        return Task("perm", lambda rng, n: perm_example(rng, perms, n), perm_questions), params
    if ns.task == "arith":
        task = Task("arith", arith_example, arith_questions, hold_out_factor=10)
        return task, {"task": "arith", "modulus": MODULUS}
    lengths = range(1, ns.max_steps + 1)
    return Task("mod10", mod10_example, mod10_questions, lengths, None), {"task": "mod10", "modulus": MODULUS}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    existing = next(path for path in (ns.out, *ns.out.parents) if path.exists())
    if not existing.is_dir():
        parser.error(f"--out {ns.out}: {existing} exists and is not a folder")
    task, params = build_task(ns)
    train_lengths = ns.train_lengths or task.lengths
    eval_lengths = ns.eval_lengths or (range(1, 2 * ns.max_steps + 1) if task.name == "mod10" else train_lengths)
    extrapolation = task.extrapolation if ns.extrapolation_lengths is None else ns.extrapolation_lengths
    extrapolation = extrapolation or None
    if extrapolation is not None and set(extrapolation) & set(eval_lengths):
        parser.error("--extrapolation-lengths must not overlap --eval-lengths")
    longest = max([*train_lengths, *eval_lengths, *(extrapolation or [])])
    if task.name == "arith" and longest >= len(ARITH_VARIABLES):
        parser.error(f"arith chains have at most {len(ARITH_VARIABLES) - 1} steps, got {longest}")
    splits, held_out = generate(
        task, train_lengths, eval_lengths, extrapolation, ns.train_examples, ns.eval_examples, ns.seed
    )
    evaluated = [*eval_lengths, *(extrapolation or [])]
    seen = [n for n in evaluated if n not in held_out]
    params.update(
        train_lengths=[train_lengths[0], train_lengths[-1]],
        eval_lengths=[eval_lengths[0], eval_lengths[-1]],
        extrapolation_lengths=list(extrapolation or []),
        held_out_lengths=held_out,
        not_held_out_lengths=seen,
        train_examples=ns.train_examples,
        eval_examples=ns.eval_examples,
        seed=ns.seed,
    )
    written = write(ns.out, splits, task.name, params)
    extra = f", extrapolation {extrapolation[0]}-{extrapolation[-1]}" if extrapolation else ""
    print(
        f"wrote {len(written)} files under {ns.out} ({task.name}: train lengths {train_lengths[0]}-{train_lengths[-1]}, "
        f"evaluation lengths {eval_lengths[0]}-{eval_lengths[-1]}{extra}); evaluation questions held out of training "
        f"at lengths {format_lengths(held_out)}"
        + (
            f"; {'length' if len(seen) == 1 else 'lengths'} {format_lengths(seen)} "
            f"{'has' if len(seen) == 1 else 'have'} too few questions to hold out"
            if seen
            else ""
        )
    )
    return 0


def format_lengths(lengths: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    if not lengths:
        return "none"
    runs: list[list[int]] = []
    for n in sorted(lengths):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


if __name__ == "__main__":
    sys.exit(main())
