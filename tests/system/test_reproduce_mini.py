"""The miniature's depth task: generator, splits and harness tasks (the whole pipeline: tests/cli/test_compare.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.torchrun_util import load_tool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def depth_task():
    return load_tool("make_depth_task")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_permutations_generate_a8(depth_task) -> None:
    """Checked with sympy's group theory (torch's own dependency), not the tool's closure."""
    from sympy.combinatorics import Permutation, PermutationGroup

    for seed in (0, 1, 7):
        perms = [Permutation(p) for p in depth_task.draw_permutations(seed)]
        group = PermutationGroup(perms)
        assert group.order() == 20160 and group.is_alternating and not group.is_abelian
        assert perms[0] * perms[1] != perms[1] * perms[0]


def test_perm_splits_answers_and_lengths(depth_task, tmp_path: Path) -> None:
    argv = [
        "--out",
        str(tmp_path),
        "--train-lengths",
        "2-5",
        "--eval-lengths",
        "3-4",
        "--train-examples",
        "400",
        "--eval-examples",
        "6",
        "--seed",
        "7",
        "--perm-seed",
        "3",
    ]
    assert depth_task.main(argv) == 0
    params = json.loads((tmp_path / "task.json").read_text())
    perms = np.array(params["permutations"])
    assert params["permutations"] == depth_task.draw_permutations(3)

    def answer(prompt: str) -> str:  # the permutations as index arrays, composed by numpy
        start, *ops, eq = prompt.split()
        assert eq == "=" and set(ops) <= {"a", "b"}
        state = np.int64(start)
        for op in ops:
            state = perms["ab".index(op)][state]
        return str(state)

    train = read_jsonl(tmp_path / "train.jsonl")
    assert len(train) == 400 and {len(r["prompt"].split()) - 2 for r in train} == {2, 3, 4, 5}
    for row in train:
        assert row["completion"] == f" {answer(row['prompt'])}" and row["text"] == row["prompt"] + row["completion"]
    evaluation = []
    for n in (3, 4):
        rows = read_jsonl(tmp_path / f"eval_{n}.jsonl")
        assert len(rows) == 6 and all(r["length"] == n and r["answer"] == answer(r["prompt"]) for r in rows)
        evaluation += rows
    validation = read_jsonl(tmp_path / "validation.jsonl")
    key = lambda r: (r["prompt"], r["completion"])  # noqa: E731
    assert sorted(map(key, validation)) == sorted(map(key, evaluation))
    assert [r["length"] for r in validation] != sorted(r["length"] for r in validation)  # shuffled
    assert not (tmp_path / "eval_5.jsonl").exists() and (tmp_path / "perm_3.yaml").is_file()
    again = tmp_path / "again"
    depth_task.main([*argv[:1], str(again), *argv[2:]])
    assert all((again / f).read_bytes() == (tmp_path / f).read_bytes() for f in ("train.jsonl", "validation.jsonl"))


def test_evaluation_questions_are_held_out_of_training(depth_task, tmp_path: Path) -> None:
    """The default perm task: no evaluation question of a length with room to hold it out (5-12, and the
    extrapolation split 13-16) occurs in the training file; questions are distinct within a length; task.json
    names the lengths too short to hold out (1-4: 8 x 2^k questions against 100 drawn)."""
    assert depth_task.main(["--out", str(tmp_path)]) == 0
    train = {row["prompt"] for row in read_jsonl(tmp_path / "train.jsonl")}
    params = json.loads((tmp_path / "task.json").read_text())
    assert params["held_out_lengths"] == list(range(5, 17)) and params["not_held_out_lengths"] == [1, 2, 3, 4]
    for n in range(1, 17):
        prompts = [row["prompt"] for row in read_jsonl(tmp_path / f"eval_{n}.jsonl")]
        assert len(prompts) == 100
        if n >= 5:
            assert len(set(prompts)) == 100 and not set(prompts) & train, n
    assert "perm_13" in (tmp_path / "perm_extrapolation.yaml").read_text()
    assert "perm_13" not in (tmp_path / "perm.yaml").read_text()
    assert {row["length"] for row in read_jsonl(tmp_path / "validation.jsonl")} == set(range(1, 13))


def test_arith_trains_on_the_one_step_questions_it_evaluates(depth_task, tmp_path: Path) -> None:
    """Arith length 1 has 230 questions against 100 drawn, and distinct draws take the likeliest first (every
    ``b = a - a``): held out, they left training without those bindings while evaluation asked them. Length 1
    is not held out, and training covers all of its questions."""
    assert depth_task.arith_questions(1) == 230
    assert depth_task.main(["--task", "arith", "--out", str(tmp_path)]) == 0
    params = json.loads((tmp_path / "task.json").read_text())
    assert params["held_out_lengths"] == list(range(2, 17)) and params["not_held_out_lengths"] == [1]
    train = {row["prompt"] for row in read_jsonl(tmp_path / "train.jsonl") if row["prompt"].count(" ; ") == 2}
    evaluated = {row["prompt"] for row in read_jsonl(tmp_path / "eval_1.jsonl")}
    # a start digit and one binding to an earlier variable (``b = a - a``), as the generator spells them
    binds_a_variable = {p for p in evaluated if p.split(" ; ")[1].split()[-1] in depth_task.ARITH_VARIABLES}
    assert binds_a_variable and binds_a_variable <= train
    assert evaluated <= train and len(train) == depth_task.arith_questions(1)


def test_arith_answers_and_bindings(depth_task, tmp_path: Path) -> None:
    """Each arith answer equals the bindings evaluated by Python in order (integers, mod 10 at the end)."""
    argv = ["--task", "arith", "--out", str(tmp_path), "--train-examples", "200", "--eval-examples", "20"]
    assert depth_task.main(argv) == 0
    rows = read_jsonl(tmp_path / "train.jsonl") + read_jsonl(tmp_path / "eval_16.jsonl")
    for row in rows:
        *bindings, question = row["prompt"].split(" ; ")
        scope: dict[str, int] = {}
        for binding in bindings:
            name, expression = binding.split(" = ")
            scope[name] = eval(expression, {}, dict(scope))  # noqa: S307 (digits, variables, + - *)
        variable = question.removesuffix(" mod 10 ?")
        assert row["completion"] == f" {scope[variable] % 10}" and len(bindings) - 1 <= 16
    assert len(read_jsonl(tmp_path / "eval_16.jsonl")) == 20 and (tmp_path / "arith_extrapolation.yaml").is_file()


def test_mod10_task_stays_available(depth_task, tmp_path: Path) -> None:
    assert (
        depth_task.main(
            [
                "--task",
                "mod10",
                "--out",
                str(tmp_path),
                "--max-steps",
                "3",
                "--train-examples",
                "50",
                "--eval-examples",
                "4",
            ]
        )
        == 0
    )
    for row in read_jsonl(tmp_path / "eval_5.jsonl"):
        expression = row["prompt"].removeprefix("Question: ").split(" (mod 10)")[0]
        assert row["answer"] == str(eval(expression) % 10) and row["length"] == 5  # noqa: S307 (digits, +/- only)
    assert (tmp_path / "mod10_6.yaml").is_file() and not (tmp_path / "eval_7.jsonl").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--train-examples", "0"],
        ["--train-lengths", "5-2"],
        ["--eval-lengths", "x"],
        ["--task", "other"],
        ["--eval-lengths", "1-13"],  # overlaps the default extrapolation split 13-16
        ["--task", "arith", "--extrapolation-lengths", "13-20"],  # longer than the variables allow
        ["--train-lengths", "1-"],  # an open range: was read as 1-1
        ["--eval-lengths", "17-65"],  # the bounds (in --help): else a MemoryError or an hour's work
        ["--extrapolation-lengths", "13-1000000000"],
        ["--train-examples", "1000001"],
        ["--eval-examples", "10001"],
        ["--task", "mod10", "--max-steps", "33"],
    ],
)
def test_bad_arguments_exit_2(depth_task, tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        depth_task.main(["--out", str(tmp_path / "task"), *argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "task").exists()


def test_out_that_is_a_file_is_one_line(depth_task, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--out naming a file (or a folder under one) is one line and exit 2, and the file is kept."""
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    for out in (taken, taken / "task"):
        with pytest.raises(SystemExit) as exit_info:
            depth_task.main(["--out", str(out), "--train-examples", "10", "--eval-examples", "2"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and "not a folder" in err, err
    assert taken.read_text() == "keep me"


def test_help_states_the_bounds(depth_task, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        depth_task.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for bound in ("at most 64", "at most 1000000", "at most 10000", "at most 32"):
        assert bound in help_text, bound


def test_task_yamls_score_exact_match(depth_task, tmp_path: Path) -> None:
    """The generated harness tasks: an oracle scores 1, an oracle off by one 0, per length and in the group."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    depth_task.main(["--out", str(tmp_path), "--eval-lengths", "6-7", "--train-examples", "10", "--eval-examples", "3"])
    answers = {row["prompt"]: row["answer"] for n in (6, 7) for row in read_jsonl(tmp_path / f"eval_{n}.jsonl")}

    class Oracle(LM):
        def __init__(self, shift: int) -> None:
            super().__init__()
            self.shift = shift

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return [f" {(int(answers[r.args[0]]) + self.shift) % 8}" for r in requests]

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

    manager = TaskManager(include_defaults=False, include_path=str(tmp_path))
    for shift, expected in ((0, 1.0), (1, 0.0)):
        for tasks, names in (([str(tmp_path / "perm_6.yaml"), "perm_7"], ("perm_6", "perm_7")), (["perm"], ("perm",))):
            result = simple_evaluate(model=Oracle(shift), tasks=tasks, task_manager=manager)
            for name in names:
                assert result["results"][name]["exact_match,flexible-extract"] == expected


def test_flops_to_reach_names_the_smallest_r() -> None:
    """At the fewest FLOPs the recurrent arm is credited with the first r that reaches a target, not the
    largest (r=16 sorted before r=2 as text)."""
    summarize = load_tool("summarize_mini")

    def point(flops: float, step: int, by_r: dict[int, float]) -> dict:
        return {
            "flops": {"paper": flops},
            "step": step,
            "results": {str(r): {"long": {"mean": m}} for r, m in by_r.items()},
        }

    summary = {
        "arms": {
            "recurrent": {"recurrent": True, "points": [point(1e12, 200, {1: 0.4, 2: 0.78, 4: 0.9, 16: 0.9})]},
            "static_x1": {"recurrent": False, "points": [point(2e12, 680, {1: 0.7})]},
        }
    }
    reach = summarize.flops_to_reach(summary)
    assert reach["0.5"]["recurrent"] == {"flops": 1e12, "arm": "recurrent", "step": 200, "r": 2}
    assert reach["0.9"]["recurrent"]["r"] == 4
    assert reach["0.5"]["static"]["step"] == 680 and reach["0.8"]["static"] is None


def fake_report(lengths: range, recurrences: tuple[int, ...] = (1, 4)) -> dict:
    """A compare.json of one recurrent and one static run, one point each, 0.9 exact match on every length."""

    def point(rs: tuple[int, ...]) -> dict:
        tasks = {f"perm_{n}": {"exact_match,flexible-extract": 0.9} for n in lengths}
        results = {str(r): {"tasks": tasks, "loss": 0.3} for r in rs}
        return {"step": 8, "flops": {"paper": 1e12, "full": 1.1e12}, "results": results}

    runs = [
        {"label": "recurrent_s0", "recurrent": True, "train_mean_recurrence": 4, "points": [point(recurrences)]},
        {"label": "static_x1_s0", "recurrent": False, "train_mean_recurrence": 1, "points": [point(recurrences[:1])]},
    ]
    return {"recurrences": list(recurrences), "runs": runs}


def summarize_fake(depth_task, tmp_path: Path, task_argv: list[str], lengths: range, *argv: str) -> Path:
    """make_depth_task with ``task_argv`` into tmp_path/task, a fake report of ``lengths``, summarize_mini with
    ``argv`` into tmp_path/summary (returned)."""
    task, report = tmp_path / "task", tmp_path / "compare.json"
    assert depth_task.main(["--out", str(task), "--train-examples", "50", "--eval-examples", "3", *task_argv]) == 0
    report.write_text(json.dumps(fake_report(lengths)))
    out = tmp_path / "summary"
    load_tool("summarize_mini").main([str(report), "--task", str(task / "task.json"), "--out", str(out), *argv])
    return out


def test_long_lengths_beyond_training_are_one_line(depth_task, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--long 13-16 on a set whose 13-16 are its extrapolation lengths (reported on their own): one line, exit 2,
    nothing written. It labelled 7-12 'short chains' and crashed while plotting (IndexError)."""
    with pytest.raises(SystemExit) as exit_info:
        summarize_fake(depth_task, tmp_path, ["--eval-lengths", "7-12"], range(7, 17), "--long", "13-16")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--long 13-16" in err, err
    assert not (tmp_path / "summary").exists()


def test_only_lengths_below_the_long_ones_are_short(depth_task, tmp_path: Path) -> None:
    """--long 8-10 of 7-12: 7 is short; 11-12, longer, are no 'short chains' (they were labelled so)."""
    out = summarize_fake(depth_task, tmp_path, ["--eval-lengths", "7-12"], range(7, 17), "--long", "8-10")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups"] == {"long": [8, 9, 10], "extrapolation": [13, 14, 15, 16], "short": [7]}
    text = (out / "summary.md").read_text()
    assert "Accuracy on the short chains (7 operators)" in text and "(8-10 operators)" in text
    assert (out / "long_vs_r.png").is_file() and (out / "long_vs_flops.png").is_file()


def test_held_out_lengths_are_counted_in_the_training_file(depth_task, tmp_path: Path) -> None:
    """Another question set (seed 1, lengths 5-8; held out of its own training file, says its task.json)
    summarized against the training file the models saw (--train, seed 0): per length, the summary counts the
    evaluation questions that occur in it (the oracle: the prompts of both files compared here), and calls
    held out only the lengths with none. Without --train it is the set's own train.jsonl."""
    seen = tmp_path / "seen"
    argv = ["--train-lengths", "5-8", "--train-examples", "20000", "--extrapolation-lengths", "none"]
    assert depth_task.main(["--out", str(seen), *argv]) == 0
    task_argv = ["--eval-lengths", "5-8", "--extrapolation-lengths", "none", "--seed", "1"]
    train = seen / "train.jsonl"
    out = summarize_fake(depth_task, tmp_path, task_argv, range(5, 9), "--train", str(train))
    prompts = {row["prompt"] for row in read_jsonl(train)}
    expected = {
        str(n): sum(row["prompt"] in prompts for row in read_jsonl(tmp_path / "task" / f"eval_{n}.jsonl"))
        for n in range(5, 9)
    }
    summary = json.loads((out / "summary.json").read_text())
    assert summary["in_training"] == expected and summary["train_file"] == str(train)
    assert expected["5"] == 3 and summary["held_out_lengths"] == [int(n) for n, c in expected.items() if c == 0]
    assert json.loads((tmp_path / "task" / "task.json").read_text())["held_out_lengths"] == [5, 6, 7, 8]
    text = (out / "summary.md").read_text()
    assert f"training file {train}: " in text and "; in it: 3 of 3 at length" in text, text

    own = summarize_fake(depth_task, tmp_path / "own", task_argv, range(5, 9))
    summary = json.loads((own / "summary.json").read_text())
    assert summary["held_out_lengths"] == [5, 6, 7, 8] and set(summary["in_training"].values()) == {0}


@pytest.mark.parametrize(
    "doc, task",
    [
        ("README.md", "perm"),
        ("docs/results.md", "perm"),
        ("docs/results.md", "perm/source_6000"),
        ("docs/results.md", "arith"),
    ],
)
def test_quoted_result_tables_equal_the_shipped_summary(doc: str, task: str) -> None:
    """The long-chain and extrapolation tables the docs quote are summarize_mini's rendering of the shipped
    summary.json of the task's full run, line for line (a number edited by hand, or a rerun not shipped, fails)."""
    summarize = load_tool("summarize_mini")
    summary = json.loads((REPO / "docs" / "results" / task / "summary.json").read_text())
    text = (REPO / doc).read_text()
    for group in ("long", "extrapolation"):
        table = "\n".join(summarize.group_table(summary, group))
        assert table in text, f"{doc}: the {group} table differs from docs/results/{task}/summary.json"
    held_out_from = {"perm": 5, "arith": 2}[task.split("/")[0]]
    assert summary["groups"]["extrapolation"] == [13, 14, 15, 16]
    assert summary["held_out_lengths"] == list(range(held_out_from, 17))


@pytest.mark.slow
def test_the_quoted_source_accuracy_is_the_source_evaluated(tmp_path: Path) -> None:
    """The exact match of assets/perm_llama at lengths 7-12 that docs/results.md and assets/README.md quote is
    what the commands docs/results.md names give: the task stage's questions, the source converted as it is,
    the harness at r = 1 (the figures quoted before came from no recorded run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    task, source, out = tmp_path / "task", tmp_path / "source", tmp_path / "source_eval"
    commands = [
        ["tools/make_depth_task.py", "--out", str(task), "--train-lengths", "1-12", "--eval-lengths", "1-12"]
        + ["--extrapolation-lengths", "13-16", "--eval-examples", "100", "--seed", "0"],
        ["tools/convert_hf.py", "assets/perm_llama", str(source), "--static"],
        ["-m", "titan_recur.eval", "harness", "--model-args", f"pretrained={source},batch_size=100,max_gen_toks=2"]
        + ["--tasks", str(task / "perm.yaml"), "--recurrences", "1", "--out", str(out)],
    ]
    for argv in commands:
        subprocess.run([sys.executable, *argv], cwd=REPO, env=env, check=True, capture_output=True)
    rows = json.loads((out / "table.json").read_text())
    scores = {r["task"]: r["1"] for r in rows if r["metric"] == "exact_match,flexible-extract"}
    assert [scores[f"perm_{n}"] for n in range(1, 7)] == [1.0] * 6
    quoted = " / ".join(f"{scores[f'perm_{n}']:.2f}" for n in range(7, 13)) + " at 7-12"
    for doc in ("docs/results.md", "assets/README.md"):
        assert quoted in (REPO / doc).read_text(), (doc, quoted)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--install", "--keep-below-gate"], "needs the gate; not with --keep-below-gate"),
        (["--install", "--task", "arith"], "not with --task arith"),
        (["--task", "mod10"], "--task takes perm or arith"),
        (["--attention-mask", "block"], "--attention-mask takes causal or document, got block"),
        (["--threads", "0"], "--threads, --steps and --consolidate-steps take an integer >= 1, got 0"),
        (["--steps", "4k"], "--threads, --steps and --consolidate-steps take an integer >= 1, got 4k"),
        (["--consolidate-steps", "0"], "--threads, --steps and --consolidate-steps take an integer >= 1, got 0"),
    ],
)
def test_make_mini_source_refuses_a_bad_request_before_any_work(argv: list[str], message: str, tmp_path: Path) -> None:
    """A request that could ship an unchecked source (or build nothing) is one line and exit 2, before the
    output folder is made or assets/perm_llama is touched."""
    out = tmp_path / "src"
    result = subprocess.run(
        ["bash", "tools/make_mini_source.sh", "--out", str(out), *argv], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "surgery, message",
    [("--bogus 3", "unrecognized arguments: --bogus 3"), ("--prelude 0 --core 9 --coda 1", "layer 9 is out of range")],
)
def test_reproduce_mini_checks_its_surgery_before_any_work(surgery: str, message: str, tmp_path: Path) -> None:
    """Bad --surgery flags are one line and exit 2 before --out is touched: they were found by the conversion
    stage, after an earlier output had been deleted and the task rebuilt (24 s)."""
    out = tmp_path / "mini"
    out.mkdir()
    (out / "timings.tsv").write_text("an earlier output of the script\n")
    result = subprocess.run(
        ["bash", "tools/reproduce_mini.sh", "--out", str(out), "--surgery", surgery],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("reproduce_mini.sh: error: --surgery") and message in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["timings.tsv"]


def perm_settings(**changed: str) -> str:
    """settings.txt as tools/reproduce_mini.sh writes it for its defaults (perm on assets/perm_llama)."""
    source = REPO / "assets" / "perm_llama"
    weights = b"".join(p.read_bytes() for p in sorted(source.glob("*.safetensors")))
    settings = {
        "task": "perm",
        "source": "assets/perm_llama",
        "source_sha256": hashlib.sha256(weights).hexdigest(),
        "surgery": "--shape 1,2,1",
        "seeds": "0,1,2",
        "steps": "400",
        "eval_examples": "100",
        "static_factors": "1 2 4",
        "attention_mask": "causal",
        "quick": "0",
    }
    return "".join(f"{key}={value}\n" for key, value in {**settings, **changed}.items())


@pytest.mark.parametrize(
    "earlier, argv, message",
    [
        (None, [], "holds no earlier call of this script (settings.txt, timings.tsv); run without --resume"),
        (perm_settings(), ["--steps", "300"], 'other settings (steps "400", now "300"); rerun with the earlier ones'),
        (
            perm_settings(source_sha256="0" * 64),
            ["--attention-mask", "document"],
            f'source_sha256 "{"0" * 64}", now "{perm_settings().split("source_sha256=")[1].split()[0]}"',
        ),
        (perm_settings(), ["--attention-mask", "block"], "--attention-mask takes one of: causal document; got block"),
    ],
)
def test_reproduce_mini_resumes_only_what_it_was_asked_before(
    earlier: str | None, argv: list[str], message: str, tmp_path: Path
) -> None:
    """--resume continues an earlier call only with the same settings and source weights: otherwise one line
    naming what changed, exit 2, and the earlier output untouched."""
    out = tmp_path / "mini"
    out.mkdir()
    (out / "timings.tsv").write_text("stage\twall_s\tuser_s\tsys_s\ntask\t1.0\t1.0\t0.0\n")
    if earlier is not None:
        (out / "settings.txt").write_text(earlier)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = subprocess.run(
        ["bash", "tools/reproduce_mini.sh", "--out", str(out), "--resume", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("reproduce_mini.sh: error: ") and message in result.stderr, result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_a_signal_stops_the_call_and_resume_finishes_it(tmp_path: Path) -> None:
    """SIGTERM to the script's process group once the run's halfway checkpoint is written (the event, not a
    delay): exit 130 with the one line saying how to continue, the call's time recorded; --resume then finishes
    with every stage once and only the planned checkpoints (a checkpoint written on the signal is removed)."""
    out = tmp_path / "mini"
    argv = ["bash", "tools/reproduce_mini.sh", "--seeds", "0", "--steps", "8", "--eval-examples", "1"]
    argv += ["--static-factors", "", "--out", str(out)]
    log = tmp_path / "first.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        halfway = out / "runs" / "recurrent_s0" / "checkpoints" / "step-4"
        while proc.poll() is None and not halfway.is_dir():
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=900) == 130, log.read_text()[-3000:]
    assert "stopped by a signal" in log.read_text() and "--resume" in log.read_text()
    assert (out / "calls.tsv").read_text().splitlines()[-1].endswith("\t130")
    resumed = subprocess.run([*argv, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    checkpoints = sorted(p.name for p in (out / "runs" / "recurrent_s0" / "checkpoints").glob("step-*"))
    assert checkpoints == ["step-4", "step-8"]
    stages = [line.split("\t")[0] for line in (out / "timings.tsv").read_text().splitlines()[1:]]
    assert stages[:4] == ["task", "convert_recurrent", "convert_static", "match"] and stages[-1] == "total"
    assert sorted(stages[4:-1]) == ["compare", "summarize", "train_recurrent_s0"]
    assert (out / "summary" / "summary.json").is_file()
