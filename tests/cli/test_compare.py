"""The compare command (titan_recur/cli/compare.py, tools/compare.py) and tools/reproduce_mini.sh: the quick miniature run once (the effect asserted on it), its two real 2-rank runs
(recurrent and static) checked against tools/flops.py, the paper's formula and direct evaluation."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.cli_util import exit_code
from tests.torchrun_util import load_tool
from titan_recur.cli import compare as compare_command
from titan_recur.data.tokenizer import load_tokenizer
from titan_recur.eval.comparison import EvalSettings, compare, read_run
from titan_recur.inference.engine import greedy_generate
from titan_recur.storage.model_io import load_model

pytestmark = pytest.mark.slow  # every test shares the quick miniature run (~2 min)

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "assets" / "perm_llama"
QUICK_RECURRENCES = ["1", "4"]  # tools/reproduce_mini.sh --quick
TASKS = tuple(f"perm_{n}" for n in range(7, 13))  # --quick evaluates the long chains only
METRIC = "exact_match,flexible-extract"
TOKENIZER = REPO / "assets" / "tokenizer"


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bash tools/reproduce_mini.sh --quick: every stage, both arms trained on 2 ranks, the comparison written."""
    out = tmp_path_factory.mktemp("mini") / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        ["bash", "tools/reproduce_mini.sh", "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def report(mini: Path) -> dict:
    return json.loads((mini / "compare" / "compare.json").read_text())


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder in seconds, for the command line's checks: the trainer's config.json of a 3-step run on the
    tiny recurrent model, that model as its final_model, no metrics.jsonl and no checkpoint."""
    from titan_recur.config import JobConfig, config_to_json

    run = tmp_path_factory.mktemp("tiny_run") / "run"
    run.mkdir()
    cfg = JobConfig()
    cfg.model.path = str(REPO / "assets" / "tiny_llama_recurrent")
    cfg.training.steps, cfg.training.seq_len = 3, 32
    (run / "config.json").write_text(config_to_json(cfg))
    shutil.copytree(cfg.model.path, run / "final_model")
    return run


@pytest.fixture(scope="module")
def depth_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tools/make_depth_task.py's files for two lengths, 3 questions each: per-length YAMLs and the group perm.yaml."""
    out = tmp_path_factory.mktemp("depth_task")
    argv = ["--out", str(out), "--eval-lengths", "6-7", "--train-examples", "10", "--eval-examples", "3"]
    assert load_tool("make_depth_task").main(argv) == 0
    return out


def test_the_effect_reproduces_on_its_own_run(mini: Path, report: dict) -> None:
    """The paper's two claims, measured on this run (not on stored numbers): on chains longer than any the source
    solved, the retrofitted model gains accuracy with test-time depth, and at its compute-matched FLOPs it beats
    the source post-trained without recurrence."""
    recurrent, static = report["runs"]
    long_chains = {}
    for run, r in ((recurrent, "1"), (recurrent, "4"), (static, "1")):
        scores = run["points"][-1]["results"][r]["tasks"]
        long_chains[(run["label"], r)] = sum(scores[t][METRIC] for t in TASKS) / len(TASKS)
    at_r1, at_r4, baseline = (
        long_chains[("recurrent_s0", "1")],
        long_chains[("recurrent_s0", "4")],
        long_chains[("static_x1_s0", "1")],
    )
    assert at_r4 > at_r1 + 0.15, long_chains
    assert at_r4 > baseline + 0.15, long_chains
    assert recurrent["flops"]["paper"] == pytest.approx(static["flops"]["paper"], rel=0.01)  # matched
    summary = json.loads((mini / "summary" / "summary.json").read_text())
    final = summary["arms"]["recurrent"]["points"][-1]["results"]
    assert final["4"]["long"]["mean"] == pytest.approx(at_r4) and final["1"]["long"]["mean"] == pytest.approx(at_r1)
    assert summary["arms"]["static_x1"]["points"][-1]["results"]["1"]["long"]["mean"] == pytest.approx(baseline)
    loss = {r: recurrent["points"][-1]["results"][r]["loss"] for r in QUICK_RECURRENCES}
    assert loss["4"] < loss["1"]  # the answer-only held-out loss falls with depth too


def test_pipeline_stages_and_matched_steps(mini: Path, report: dict) -> None:
    assert csv_stages(mini) == [
        "task",
        "convert_recurrent",
        "convert_static",
        "match",
        "train_static_x1_s0",
        "train_recurrent_s0",
        "compare",
        "summarize",
        "total",
    ]
    recurrent, static = report["runs"]
    assert (recurrent["recurrent"], static["recurrent"]) == (True, False)
    assert recurrent["world_size"] == static["world_size"] == 2
    matched = json.loads((mini / "flops_match.json").read_text())["matched_steps"]
    assert static["steps"] == round(matched["paper"]) and matched["full"] > 0
    assert [p["step"] for p in recurrent["points"]] == [60, 120]  # the halfway checkpoint and the final model
    assert list(recurrent["points"][-1]["results"]) == QUICK_RECURRENCES
    assert list(static["points"][-1]["results"]) == ["1"]  # r changes nothing for a static model
    for run in report["runs"]:
        for point in run["points"]:
            for entry in point["results"].values():
                assert set(entry["tasks"]) == set(TASKS) and all(0 <= entry["tasks"][t][METRIC] <= 1 for t in TASKS)


def test_a_resumed_call_ends_with_the_uninterrupted_result(mini: Path, report: dict, tmp_path: Path) -> None:
    """reproduce_mini.sh --resume after a call stopped in the static run's second half (its final model, later
    checkpoints and the later stages' rows removed): the finished stages are kept, the run continues from its
    halfway checkpoint, and the comparison equals the uninterrupted call's. In place (a checkpoint names its
    data by path), then the uninterrupted output is put back for the other tests."""
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(mini, uninterrupted)
    try:
        resume_after_an_interruption(mini, report)
    finally:
        shutil.rmtree(mini)
        uninterrupted.rename(mini)


def resume_after_an_interruption(out: Path, report: dict) -> None:
    stages_before = csv_stages(out)
    run = out / "runs" / "static_x1_s0"
    steps = sorted(int(p.name.removeprefix("step-")) for p in (run / "checkpoints").glob("step-*"))
    shutil.rmtree(run / "final_model")
    for step in steps[1:]:  # the planned checkpoints after the first (halfway, rounded down) and the last
        shutil.rmtree(run / "checkpoints" / f"step-{step}")
    for folder in ("compare", "summary"):
        shutil.rmtree(out / folder)
    later = ("train_static_x1_s0", "compare", "summarize", "total")
    rows = (out / "timings.tsv").read_text().splitlines(keepends=True)
    (out / "timings.tsv").write_text("".join(row for row in rows if row.split("\t")[0] not in later))
    proc = subprocess.run(
        ["bash", "tools/reproduce_mini.sh", "--quick", "--resume", "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for stage in ("task", "convert_recurrent", "convert_static", "match", "train_recurrent_s0"):
        assert f"== {stage}: finished by an earlier call, kept" in proc.stderr
    assert f"resumed from {run / 'checkpoints' / f'step-{steps[0]}'} at step {steps[0]}" in proc.stdout
    resumed = json.loads((out / "compare" / "compare.json").read_text())
    assert [r["points"] for r in resumed["runs"]] == [r["points"] for r in report["runs"]]
    assert sorted(csv_stages(out)) == sorted(stages_before)  # each stage once
    calls = (out / "calls.tsv").read_text().splitlines()
    assert len(calls) == 3 and calls[-1].endswith("\t0")  # the header, the first call and this one


def csv_stages(folder: Path) -> list[str]:
    with (folder / "timings.tsv").open() as f:
        return [row["stage"] for row in csv.DictReader(f, delimiter="\t")]


def test_flops_equal_tools_flops_and_the_paper_formula(mini: Path, report: dict, capsys: pytest.CaptureFixture) -> None:
    """Every evaluated step of both runs: the report's FLOPs are what tools/flops.py prints for the run's config."""
    from titan_recur.cli import flops as flops_tool

    for run in report["runs"]:
        config = Path(run["folder"]) / "config.json"
        for point in run["points"]:
            flops_tool.main(["--config", str(config), "--world-size", "2", "--at-step", str(point["step"]), "--json"])
            expected = json.loads(capsys.readouterr().out)
            assert point["flops"] == {"paper": expected["paper_flops"], "full": expected["full_flops"]}
        assert run["flops"] == run["points"][-1]["flops"] and run["points"][-1]["step"] == run["steps"]
    # Independently of both: a static run costs 6 x tokens x non-embedding parameters (the HF model's layers + norm).
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(SOURCE)
    non_embedding = sum(p.numel() for p in hf.model.layers.parameters()) + hf.model.norm.weight.numel()
    static = report["runs"][1]
    assert static["tokens_per_step"] == 16 * 64
    assert static["flops"]["paper"] == pytest.approx(6 * static["steps"] * 16 * 64 * non_embedding, rel=1e-12)
    assert all(p["flops"]["full"] > p["flops"]["paper"] > 0 for run in report["runs"] for p in run["points"])


def direct_exact_match(model_dir: Path, rows: list[dict], r: int) -> float:
    """Greedy decoding one prompt at a time; the last number of the text before a newline vs the answer."""
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    hits = 0
    for row in rows:
        ids = torch.tensor([tokenizer.encode(row["prompt"], bos=True, eos=False)])
        tokens = greedy_generate(model, ids, 2, num_steps=r, eos_id=tokenizer.eos_id)[0].tolist()
        text = tokenizer.decode(tokens[: tokens.index(tokenizer.eos_id)] if tokenizer.eos_id in tokens else tokens)
        numbers = re.findall(r"-?[0-9]+", text.split("\n")[0])
        hits += bool(numbers) and numbers[-1] == row["answer"]
    return hits / len(rows)


def hand_answer_loss(model_dir: Path, validation: Path, r: int, rows: int = 16, seq_len: int = 64) -> float:
    """The answer-only loss written out: records packed [BOS] prompt completion EOS from the tokenizer file, the
    first ``rows`` rows of seq_len + 1, mean -log p over the completion tokens and EOS."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    ids, keep = [], []
    for line in validation.read_text().splitlines():
        record = json.loads(line)
        prompt = hf.encode(record["prompt"], add_special_tokens=False).ids
        completion = hf.encode(record["completion"], add_special_tokens=False).ids
        ids += [1, *prompt, *completion, 2]
        keep += [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)
    width = seq_len + 1
    x = torch.tensor([ids[i * width : (i + 1) * width] for i in range(rows)])
    scored = torch.tensor([keep[i * width : (i + 1) * width] for i in range(rows)])[:, 1:]
    with torch.no_grad():
        logp = torch.log_softmax(load_model(model_dir)(x[:, :-1], r).double(), dim=-1)
    nll = -logp.gather(-1, x[:, 1:, None])[..., 0]
    return float(nll[scored].mean())


def test_scores_equal_direct_evaluation(mini: Path, report: dict) -> None:
    """The final models' harness exact match and answer-only loss at each r, recomputed without the harness or the
    data pipeline."""
    task = mini / "task"
    for run in report["runs"]:
        model_dir = Path(run["folder"]) / "final_model"
        for r, entry in run["points"][-1]["results"].items():
            assert entry["loss"] == pytest.approx(
                hand_answer_loss(model_dir, task / "validation.jsonl", int(r)), rel=1e-5
            )
            for name in TASKS:
                rows = [json.loads(line) for line in (task / f"eval_{name.split('_')[-1]}.jsonl").open()]
                assert entry["tasks"][name][METRIC] == pytest.approx(direct_exact_match(model_dir, rows, int(r)))


def test_report_files(mini: Path, report: dict) -> None:
    out = mini / "compare"
    md = (out / "compare.md").read_text()
    assert "## held-out loss" in md and f"## perm_12 {METRIC}" in md
    quantities = 1 + len(TASKS)
    assert md.count("| recurrent_s0 |") == quantities * 2  # every quantity x 2 evaluated recurrent models
    assert md.count("(static: same at every r)") == quantities * len(report["runs"][1]["points"])
    for name in ("loss", *TASKS):
        for kind in ("vs_r", "vs_flops"):
            assert (out / f"{name}_{kind}.png").stat().st_size > 5000
    summary = (mini / "summary" / "summary.md").read_text()
    assert (
        "## Accuracy on the long chains (7-12 operators)" in summary and "| static_x1 (static), 1 seed(s) |" in summary
    )
    assert ": held out (none in it) at lengths 7-12." in summary  # counted against the run's train.jsonl
    for name in ("long_vs_r", "long_vs_flops"):
        assert (mini / "summary" / f"{name}.png").stat().st_size > 5000


def test_world_size_is_checked(mini: Path, tmp_path: Path) -> None:
    runs = mini / "runs"
    with pytest.raises(ValueError, match="written by 2 rank"):
        read_run(runs / "static_x1_s0", world_size=1)
    # Without checkpoints: a batch that does not split, or logged tokens that give a wrong world size away.
    for name in ("recurrent_s0", "static_x1_s0"):
        shutil.copytree(runs / name, tmp_path / name, ignore=shutil.ignore_patterns("checkpoints"))
    assert read_run(tmp_path / "recurrent_s0").world_size == 1  # no checkpoint: 1 unless given; same tokens/step
    with pytest.raises(ValueError, match="must be a multiple"):  # 8 sequences x 4 ranks > the global batch of 16
        read_run(tmp_path / "recurrent_s0", world_size=4)
    config = json.loads((tmp_path / "static_x1_s0" / "config.json").read_text())
    config["training"]["global_batch_size"] = None  # then the batch is 8 x ranks: 1 rank halves the logged tokens
    (tmp_path / "static_x1_s0" / "config.json").write_text(json.dumps(config))
    assert read_run(tmp_path / "static_x1_s0", world_size=2).flops.tokens_per_step == 16 * 64
    with pytest.raises(ValueError, match="pass the run's --world-size"):
        read_run(tmp_path / "static_x1_s0", world_size=1)


def test_in_process_loss_only_with_progress(mini: Path) -> None:
    """compare() without tasks: the loss alone, one progress tick per (model, r)."""
    task = mini / "task"
    settings = EvalSettings(
        recurrences=[1, 8],
        data=str(task / "validation.jsonl"),
        loss_batches=1,
        loss_batch_size=2,
        seq_len=32,
        device="cpu",
    )
    calls = []
    result = compare(
        [read_run(mini / "runs" / "recurrent_s0"), read_run(mini / "runs" / "static_x1_s0")],
        settings,
        progress=lambda total: lambda: calls.append(total),
    )
    assert calls == [2 + 1] * 3  # final recurrent model x 2 r + one static evaluation
    recurrent, static = result["runs"]
    assert list(recurrent["points"][0]["results"]) == ["1", "8"] and list(static["points"][0]["results"]) == ["1"]
    assert "tasks" not in recurrent["points"][0]["results"]["8"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["/nonexistent", "--data", "{data}"], ["not a training run"]),
        (["{static}"], ["nothing to measure"]),
        (["{static}", "--task", "/nonexistent/task.yaml"], ["no such task file"]),
        (["{static}", "--data", "/nonexistent.jsonl"], ["--data"]),
        (["{static}", "--recurrences", "0,2", "--data", "{data}"], ["--recurrences"]),
        (["{static}", "--recurrences", "2,100000", "--data", "{data}"], ["--recurrences 100000", "1024"]),
        (["{static}", "{static}", "--labels", "a", "--data", "{data}"], ["--labels"]),
        (["{static}", "--world-size", "1", "--data", "{data}"], ["written by 2 rank"]),
    ],
)
def test_cli_errors_are_one_line(mini, tmp_path, capsys, argv: list[str], words: list[str]) -> None:
    tool = compare_command
    data = str(mini / "task" / "validation.jsonl")
    argv = [a.replace("{static}", str(mini / "runs" / "static_x1_s0")).replace("{data}", data) for a in argv]
    assert exit_code(tool.main, [*argv, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titan-recur-compare: error:"), lines
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_prints_the_table(mini, tmp_path, capsys) -> None:
    tool = compare_command
    out = tmp_path / "out"
    assert (
        tool.main(
            [
                str(mini / "runs" / "recurrent_s0"),
                str(mini / "runs" / "static_x1_s0"),
                "--labels",
                "rec,stat",
                "--data",
                str(mini / "task" / "validation.jsonl"),
                "--recurrences",
                "1,4",
                "--loss-batches",
                "1",
                "--loss-batch-size",
                "2",
                "--seq-len",
                "32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "## held-out loss" in printed and "| rec |" in printed and "wrote" in printed
    result = json.loads((out / "compare.json").read_text())
    assert [run["label"] for run in result["runs"]] == ["rec", "stat"]


def test_bench_task_decodes_the_harness_answers(mini: Path, report: dict, capsys) -> None:
    """tools/bench_generate.py task (teacher-forced through the cache, exact at full sharing) gives the harness's
    exact match per length at the same r; latest sharing keeps the static model's cache size."""
    bench = load_tool("bench_generate")
    model = mini / "runs" / "recurrent_s0" / "final_model"
    bench.main(
        [
            "task",
            "--checkpoint",
            str(model),
            "--task-dir",
            str(mini / "task"),
            "--lengths",
            "7-12",
            "--num-steps",
            "4",
            "--recurrences",
            "1",
            "--kv-sharing-modes",
            "latest",
            "--thresholds",
            "kl:1e-3",
        ]
    )
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| setting")
    }
    assert set(rows) == {"full r=1", "full r=4", "latest r=4", "full r=4, warm start", "exit kl < 0.001 (max 4)"}
    scores = report["runs"][0]["points"][-1]["results"]
    for r in QUICK_RECURRENCES:
        per_length = [float(cell) for cell in rows[f"full r={r}"][1:7]]
        assert per_length == pytest.approx([scores[r]["tasks"][t][METRIC] for t in TASKS], abs=1e-9)
    assert float(rows["full r=4"][7]) == 4.0 and float(rows["exit kl < 0.001 (max 4)"][7]) <= 4.0
    assert int(rows["latest r=4"][8].replace(",", "")) == int(rows["full r=1"][8].replace(",", ""))


def test_bench_speculative_decodes_the_plain_tokens_faster_per_iteration(mini: Path, capsys) -> None:
    """tools/bench_generate.py speculative on the miniature: every setting's tokens equal plain decoding's, the
    answers (exact match) too, and drafting spends fewer core iterations per token than r."""
    bench = load_tool("bench_generate")
    model = mini / "runs" / "recurrent_s0" / "final_model"
    argv = ["speculative", "--checkpoint", str(model), "--task-dir", str(mini / "task"), "--limit", "2"]
    argv += ["--new-tokens", "12", "--recurrences", "4", "--draft-steps", "1,2", "--lookaheads", "3"]
    bench.main([*argv, "--batch-sizes", "1,2", "--rounds", "1"])
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| batch")
    ]
    assert [(row[0], row[2]) for row in rows] == [
        (bsz, name) for bsz in ("1", "2") for name in ("plain", "draft 1, lookahead 3", "draft 2, lookahead 3")
    ]
    for row in rows:
        assert row[5] == "yes" and row[8] == rows[0][8], row  # the plain tokens, so the plain answers
        if row[2] != "plain":
            assert 0 <= float(row[6]) <= 1 and float(row[7]) < 4, row


def test_a_task_group_yaml_is_accepted(tiny_run: Path, depth_task: Path, tmp_path: Path, capsys) -> None:
    """--task OUT/perm.yaml, the group make_depth_task.py --help says to pass: its tasks resolve from its folder."""
    out = tmp_path / "out"
    argv = [str(tiny_run), "--task", str(depth_task / "perm.yaml"), "--recurrences", "1", "--max-gen-toks", "2"]
    assert compare_command.main([*argv, "--out", str(out)]) == 0
    scores = json.loads((out / "compare.json").read_text())["runs"][0]["points"][0]["results"]["1"]["tasks"]
    assert {"perm", "perm_6", "perm_7"} <= set(scores)
    assert all(0 <= scores[t][METRIC] <= 1 for t in ("perm_6", "perm_7"))
    assert "## perm_6" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--seq-len", "0"], ["--seq-len must be >= 1, got 0"]),
        (["--seq-len", "-3"], ["--seq-len must be >= 1, got -3"]),
        (["--seq-len", "100000"], ["--seq-len 100000 exceeds", "max_seq_len 2048", "{run}"]),
    ],
)
def test_cli_bounds_are_one_line_before_any_model_loads(tiny_run, tmp_path, capsys, argv, words) -> None:
    data = str(REPO / "assets" / "corpus" / "math.jsonl")
    assert exit_code(compare_command.main, [str(tiny_run), "--data", data, *argv, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titan-recur-compare: error:"), lines
    assert all(w.replace("{run}", str(tiny_run)) in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out").exists()


def test_an_empty_metrics_file_is_refused_not_read_as_one_rank(tiny_run, tmp_path, capsys) -> None:
    """An empty metrics.jsonl cannot confirm the run's ranks: one line asking for --world-size; given, it is used."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "metrics.jsonl").write_text("")
    data = str(REPO / "assets" / "corpus" / "math.jsonl")
    assert exit_code(compare_command.main, [str(run), "--data", data, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{run / 'metrics.jsonl'} has no step records" in lines[0], lines
    assert "--world-size" in lines[0] and not (tmp_path / "out").exists()
    assert read_run(run, world_size=2).world_size == 2


def compare_into(run: Path, out: Path, *extra: str) -> int:
    """The compare command on ``run``: the loss of one row at r=1 into ``out``; its exit code."""
    data = str(REPO / "assets" / "corpus" / "math.jsonl")
    argv = [str(run), "--data", data, "--recurrences", "1", "--loss-batches", "1", "--loss-batch-size", "1"]
    return exit_code(compare_command.main, [*argv, "--seq-len", "16", "--out", str(out), *extra])


def test_out_keeps_an_earlier_result_without_force(tiny_run, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert compare_into(tiny_run, out) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"compare.json", "compare.md", "loss_vs_r.png", "loss_vs_flops.png"} <= set(first)
    capsys.readouterr()
    code = compare_into(tiny_run, out)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"{out / 'compare.json'} exists; pass --force to replace it" in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    compare_into(tiny_run, out, "--force")
    assert json.loads((out / "compare.json").read_text())["runs"][0]["label"] == "run"
    # Not compare's own files: refused even with --force; a file given as --out is never replaced.
    (out / "compare.json").write_text('{"other": 1}\n')
    (tmp_path / "notes.txt").write_text("mine\n")
    for target, words in ((out, "it is not a compare result"), (tmp_path / "notes.txt", "is not a folder")):
        assert compare_into(tiny_run, target, "--force") == 2
        assert words in capsys.readouterr().err
    assert (out / "compare.json").read_text() == '{"other": 1}\n' and (tmp_path / "notes.txt").read_text() == "mine\n"


def test_the_loss_packs_rows_as_the_run_trained(tiny_run, tmp_path) -> None:
    """A run trained with training.attention_mask = "document" is scored on rows packed the same way: each
    document attends to itself, positions restarting (it was always "causal", whatever the run trained with)."""
    from titan_recur.eval.sweep import heldout_batches, loss_sweep

    losses = {}
    for mask in ("causal", "document"):
        run = tmp_path / mask
        shutil.copytree(tiny_run, run)
        config = json.loads((run / "config.json").read_text())
        config["training"]["attention_mask"] = mask
        (run / "config.json").write_text(json.dumps(config))
        assert compare_into(run, tmp_path / f"out_{mask}", "--seq-len", "128") == 0
        report = json.loads((tmp_path / f"out_{mask}" / "compare.json").read_text())
        losses[mask] = report["runs"][0]["points"][0]["results"]["1"]["loss"]
    model = load_model(tiny_run / "final_model")
    batches = heldout_batches(
        load_tokenizer(tiny_run / "final_model"),
        seq_len=128,
        batch_size=1,
        num_batches=1,
        data=str(REPO / "assets" / "corpus" / "math.jsonl"),
        attention_mask="document",
    )
    expected = loss_sweep(model, batches, [1], "cpu")["loss"]["1"]
    assert losses["document"] == pytest.approx(expected, abs=1e-6)
    assert abs(losses["document"] - losses["causal"]) > 1e-3, losses


def test_workers_give_the_same_report(tiny_run, depth_task, tmp_path, capsys) -> None:
    """--workers 2 evaluates the models in two spawned processes: the report equals one process's, number for
    number; a model that fails to load in a worker fails the command with its one line (exit 2), the models not
    started are dropped."""
    runs = []
    for name in ("a", "b", "c"):
        shutil.copytree(tiny_run, tmp_path / name)
        runs.append(str(tmp_path / name))
    data = str(REPO / "assets" / "corpus" / "math.jsonl")
    argv = [*runs, "--task", str(depth_task / "perm_7.yaml"), "--limit", "4", "--max-gen-toks", "2"]
    argv += ["--data", data, "--recurrences", "1,2", "--loss-batches", "1", "--loss-batch-size", "2", "--seq-len", "32"]
    reports = {}
    for workers in ("1", "2"):
        assert compare_command.main([*argv, "--workers", workers, "--out", str(tmp_path / workers)]) == 0
        reports[workers] = json.loads((tmp_path / workers / "compare.json").read_text())
    assert reports["2"] == reports["1"]
    assert {"loss", "tasks"} <= set(reports["1"]["runs"][2]["points"][0]["results"]["2"])
    weights = tmp_path / "b" / "final_model" / "model.safetensors"
    data_bytes = bytearray(weights.read_bytes())
    data_bytes[-64:] = bytes(64)  # same size, other weights: the checksum fails when a worker loads them
    weights.write_bytes(bytes(data_bytes))
    capsys.readouterr()
    assert exit_code(compare_command.main, [*argv, "--workers", "2", "--out", str(tmp_path / "broken")]) == 2
    assert "model.safetensors: checksum mismatch" in capsys.readouterr().err
    assert not (tmp_path / "broken" / "compare.json").exists()
