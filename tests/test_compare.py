"""tools/compare.py on two tiny real runs (recurrent and static): FLOPs vs tools/flops.py, scores vs direct evaluation."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from titan_recur.compare import EvalSettings, compare, read_run, write_report
from titan_recur.eval.sweep import heldout_batches
from titan_recur.eval import validation_losses
from titan_recur.models.generate import greedy_generate
from titan_recur.models.io import load_model
from titan_recur.surgery import ConvertOptions, convert, plan_layers
from titan_recur.tokenizer import load_tokenizer
from titan_recur.train import main as train_main

REPO = Path(__file__).resolve().parents[1]
TINY_LLAMA = REPO / "assets" / "tiny_llama"
RECURRENCES = [1, 2]
LIMIT = 6


def load_tool(name: str):
    """A tools/ script imported in-process (cheaper than a subprocess)."""
    spec = importlib.util.spec_from_file_location(f"{name}_tool", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def train_config(path: Path, model: Path, data: Path, recurrent: bool) -> Path:
    """4 steps of 4 x 64 tokens: recurrent in 2 micro-steps of 2 sequences (global batch 4), static in one of 4."""
    if recurrent:
        batch = "local_batch_size = 2\nglobal_batch_size = 4\n"
        recurrence = 'mean_recurrence = 4\nbackprop_depth = 2\ncurriculum = "1-sqrt"\nwarmup_fraction = 0.5\n'
    else:
        batch, recurrence = "local_batch_size = 4\n", 'mean_recurrence = 1\ncurriculum = "none"\n'
    path.write_text(
        f'[model]\npath = "{model}"\n'
        f'[training]\nsteps = 4\n{batch}seq_len = 64\nac_mode = "none"\n'
        f"[recurrence]\n{recurrence}"
        '[optimizer]\nlr = 0.004\nadamw_lr = 0.002\n'
        "[checkpoint]\ninterval = 2\nkeep_latest_k = 0\n"
        "[metrics]\nlog_freq = 1\nenable_tensorboard = false\n"
        f'[[data.sources]]\nname = "task"\npath = "{data}"\nkind = "jsonl"\n'
    )
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The depth task, and two 4-step single-process runs on it: tiny_llama retrofitted (1,2,1) and static."""
    root = tmp_path_factory.mktemp("compare")
    task = root / "task"
    assert load_tool("make_depth_task").main(
        ["--out", str(task), "--max-steps", "2", "--train-examples", "400", "--eval-examples", "3"]) == 0
    out = {"task": task}
    for name, plan, recurrent in (("recurrent", plan_layers(8, (1, 2, 1)), True),
                                  ("static", plan_layers(8, static=True), False)):
        model = root / f"{name}_model"
        convert(TINY_LLAMA, model, plan, ConvertOptions(adapter_init="random"))
        config = train_config(root / f"{name}.toml", model, task / "train.jsonl", recurrent)
        assert train_main(["--config", str(config), "--job.dump_folder", str(root / name)]) == 0
        out[name] = root / name
    return out


def test_flops_equal_tools_flops_and_the_paper_formula(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    flops_tool = load_tool("flops")
    for name in ("recurrent", "static"):
        run = read_run(runs[name], checkpoints=True)
        assert (run.world_size, run.step, run.flops.micro_steps) == (1, 4, 2 if name == "recurrent" else 1)
        assert run.flops.tokens_per_step == 4 * 64
        assert [p.step for p in run.points] == [2, 4] and run.points[-1].path.name == "final_model"
        for point in run.points:
            flops_tool.main(["--config", str(runs[name] / "config.json"), "--at-step", str(point.step), "--json"])
            expected = json.loads(capsys.readouterr().out)
            assert run.training_flops(point.step) == {"paper": expected["paper_flops"], "full": expected["full_flops"]}
    # Independently of both: a static run costs 6 x tokens x non-embedding parameters (the HF model's layers + norm).
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(TINY_LLAMA)
    non_embedding = sum(p.numel() for p in hf.model.layers.parameters()) + hf.model.norm.weight.numel()
    static = read_run(runs["static"])
    assert static.training_flops(4)["paper"] == pytest.approx(6 * 4 * (4 * 64) * non_embedding, rel=1e-12)


def test_world_size_is_checked(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="written by 1 rank"):
        read_run(runs["static"], world_size=2)
    # Without checkpoints: a batch that does not split, or logged tokens that give a wrong world size away.
    for name in ("recurrent", "static"):
        shutil.copytree(runs[name], tmp_path / name, ignore=shutil.ignore_patterns("checkpoints"))
        assert read_run(tmp_path / name).world_size == 1
    with pytest.raises(ValueError, match="not a multiple"):  # 2 sequences x 4 ranks > the global batch of 4
        read_run(tmp_path / "recurrent", world_size=4)
    with pytest.raises(ValueError, match="pass the run's --world-size"):  # no global batch: 4 x 2 ranks per step
        read_run(tmp_path / "static", world_size=2)


@pytest.fixture(scope="module")
def report(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    task = runs["task"]
    settings = EvalSettings(
        recurrences=RECURRENCES, tasks=[str(task / "depth_chain_validation.yaml")], data=str(task / "validation.jsonl"),
        loss_batches=2, loss_batch_size=2, seq_len=32, batch_size=4, max_gen_toks=4, limit=LIMIT, device="cpu",
    )
    calls = []
    result = compare([read_run(runs["recurrent"], checkpoints=True, label="rec"), read_run(runs["static"])],
                     settings, progress=lambda total: lambda: calls.append(total))
    assert calls == [2 * 2 + 1] * 5  # (2 recurrent models x 2 r) + 1 static evaluation
    out = tmp_path_factory.mktemp("compare_out")
    write_report(result, out)
    return result, out


def direct_exact_match(model_dir: Path, rows: list[dict], r: int) -> float:
    """Greedy decoding one prompt at a time; the last number before a stop string vs the answer."""
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    hits = 0
    for row in rows:
        ids = torch.tensor([tokenizer.encode(row["question"], bos=True, eos=False)])
        tokens = greedy_generate(model, ids, 4, num_steps=r, eos_id=tokenizer.eos_id)[0].tolist()
        text = tokenizer.decode(tokens[: tokens.index(tokenizer.eos_id)] if tokenizer.eos_id in tokens else tokens)
        text = re.split("\n|Question:", text)[0]
        numbers = re.findall(r"-?[0-9]+", text)
        hits += bool(numbers) and numbers[-1] == row["answer"]
    return hits / len(rows)


def test_report_scores_equal_direct_evaluation(runs: dict[str, Path], report: tuple[dict, Path]) -> None:
    result, _ = report
    recurrent, static = result["runs"]
    assert (recurrent["label"], recurrent["recurrent"], static["recurrent"]) == ("rec", True, False)
    assert [p["step"] for p in recurrent["points"]] == [2, 4] and [p["step"] for p in static["points"]] == [4]
    assert list(static["points"][0]["results"]) == ["1"]  # r changes nothing for a static model
    rows = [json.loads(line) for line in (runs["task"] / "validation.jsonl").read_text().splitlines()][:LIMIT]
    tokenizer = load_tokenizer(runs["recurrent"] / "final_model")
    batches = list(heldout_batches(tokenizer, seq_len=32, batch_size=2, num_batches=2,
                                   data=str(runs["task"] / "validation.jsonl")))
    for run, model_dir in ((recurrent, runs["recurrent"] / "final_model"), (static, runs["static"] / "final_model")):
        for r, entry in run["points"][-1]["results"].items():
            assert entry["loss"] == pytest.approx(validation_losses(load_model(model_dir), batches, [int(r)], "cpu")
                                                  [int(r)], rel=1e-6)
            score = entry["tasks"]["depth_chain_validation"]["exact_match,flexible-extract"]
            assert score == pytest.approx(direct_exact_match(model_dir, rows, int(r)))
    assert all(math.isfinite(p["flops"]["full"]) and p["flops"]["full"] > p["flops"]["paper"] > 0
               for run in result["runs"] for p in run["points"])


def test_report_files(report: tuple[dict, Path]) -> None:
    result, out = report
    assert json.loads((out / "compare.json").read_text()) == result
    md = (out / "compare.md").read_text()
    assert "## held-out loss" in md and "## depth_chain_validation exact_match,flexible-extract" in md
    assert md.count("| rec |") == 2 * 2 and md.count("(static: same at every r)") == 2
    for name in ("loss", "depth_chain_validation"):
        for kind in ("vs_r", "vs_flops"):
            assert (out / f"{name}_{kind}.png").stat().st_size > 5000


@pytest.mark.parametrize("argv, words", [
    (["/nonexistent", "--data", "{data}"], ["not a training run"]),
    (["{static}"], ["nothing to measure"]),
    (["{static}", "--task", "no_such_task_xyz"], ["unknown task"]),
    (["{static}", "--data", "/nonexistent.jsonl"], ["--data"]),
    (["{static}", "--recurrences", "0,2", "--data", "{data}"], ["--recurrences"]),
    (["{static}", "{static}", "--labels", "a", "--data", "{data}"], ["--labels"]),
    (["{static}", "--world-size", "2", "--data", "{data}"], ["written by 1 rank"]),
])
def test_cli_errors_are_one_line(runs, tmp_path, capsys, argv: list[str], words: list[str]) -> None:
    tool = load_tool("compare")
    data = str(runs["task"] / "validation.jsonl")
    argv = [a.replace("{static}", str(runs["static"])).replace("{data}", data) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        tool.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compare.py: error:"), lines
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_end_to_end(runs, tmp_path, capsys) -> None:
    tool = load_tool("compare")
    out = tmp_path / "out"
    assert tool.main([str(runs["recurrent"]), str(runs["static"]), "--data", str(runs["task"] / "validation.jsonl"),
                      "--recurrences", "1,4", "--loss-batches", "1", "--loss-batch-size", "2", "--seq-len", "32",
                      "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "## held-out loss" in printed and "wrote" in printed
    result = json.loads((out / "compare.json").read_text())
    assert [run["label"] for run in result["runs"]] == ["recurrent", "static"]
    assert list(result["runs"][0]["points"][0]["results"]) == ["1", "4"]
