"""The analyze-layers command (titan_recur/cli/analyze_layers.py, convert/layer_analysis.py): layer selection
analysis: statistics against transformers, rankings on near-identity layers, losses
equal to tools/convert_hf.py + `python -m titan_recur.eval loss`, bad input."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_recur.cli import analyze_layers, convert
from titan_recur.cli.eval import main as eval_main
from titan_recur.convert.layer_analysis import (
    InMemoryWeights,
    build_model,
    candidate_plans,
    layer_statistics,
    static_plan,
)
from titan_recur.convert.surgery import read_source

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets"
DATA = str(ASSETS / "corpus" / "general.jsonl")
# 3 batches x 4 rows x 32 tokens (rows rounded up from --tokens 384).
CALIBRATION = ["--data", DATA, "--seq-len", "32", "--batch-size", "4", "--tokens", "384"]
EVAL_BATCHES = ["--batches", "3", "--batch-size", "4", "--seq-len", "32"]
# What makes a block near-identity: Llama's residual branches end in o_proj / down_proj; OLMo-2's
# end in a post-norm, whose weight scales them (scaling o_proj would be undone by that norm).
NEAR_IDENTITY_TENSORS = {
    "llama": ("self_attn.o_proj.weight", "mlp.down_proj.weight"),
    "olmo2": ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
}


ANALYZE = analyze_layers
CONVERT = convert


def near_identity_copy(asset: str, layers: list[int], folder: Path) -> Path:
    """A copy of a pretrained tiny asset whose ``layers`` have their residual branches scaled by 1e-3."""
    shutil.copytree(ASSETS / asset, folder)
    kind = "olmo2" if "olmo2" in asset else "llama"
    weights = load_file(str(folder / "model.safetensors"))
    for layer in layers:
        for name in NEAR_IDENTITY_TENSORS[kind]:
            weights[f"model.layers.{layer}.{name}"] *= 1e-3
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def llama_2_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """assets/tiny_llama (8 layers) with layers 2 and 3 near-identity."""
    return near_identity_copy("tiny_llama", [2, 3], tmp_path_factory.mktemp("analysis") / "llama_2_3")


@pytest.fixture(scope="module")
def olmo2_1_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """assets/tiny_olmo2 (6 layers) with layers 1 and 2 near-identity."""
    return near_identity_copy("tiny_olmo2", [1, 2], tmp_path_factory.mktemp("analysis") / "olmo2_1_2")


def analyze(source: Path, out: Path, *args: str) -> dict:
    assert ANALYZE.main([str(source), *CALIBRATION, "--out", str(out), *args]) == 0
    return json.loads((out / "layer_analysis.json").read_text())


@pytest.fixture(scope="module")
def llama_2_2_2(llama_2_3, tmp_path_factory) -> tuple[dict, str, Path]:
    """The report, printed tables and output folder of --recommend 2,2,2 on llama_2_3."""
    out, printed = tmp_path_factory.mktemp("llama_2_2_2"), io.StringIO()
    with contextlib.redirect_stdout(printed):
        report = analyze(llama_2_3, out, "--recommend", "2,2,2")
    return report, printed.getvalue(), out


def two_smallest(values: list[float]) -> set[int]:
    return set(sorted(range(len(values)), key=lambda i: values[i])[:2])


def eval_loss(model: Path, out: Path, recurrences: str) -> dict[str, float]:
    argv = ["loss", "--checkpoint", str(model), "--data", DATA, *EVAL_BATCHES, "--recurrences", recurrences]
    assert eval_main([*argv, "--out", str(out)]) == 0
    return json.loads((out / "validation_loss.json").read_text())["loss"]


def convert_candidate(row: dict, out: Path, *extra: str) -> Path:
    """Run the command the tool printed for this candidate, into ``out``."""
    python, script, source, _, *flags = row["command"].split()
    assert (python, script) == ("python", "tools/convert_hf.py")
    CONVERT.run([source, str(out), *flags, *extra])
    return out


# ---------------------------------------------------------------- statistics against transformers


@pytest.mark.parametrize("name", ["llama", "olmo2"])
def test_statistics_match_transformers_hidden_states(tiny_hf_checkpoint, name):
    """Cosines, angular distances and norms of titan_recur's static model equal those of HF's hidden states."""
    from transformers import AutoModelForCausalLM

    folder = tiny_hf_checkpoint(name)
    source = read_source(folder)
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    model = build_model(source, static_plan(source.n_layers), InMemoryWeights.load(source, "cpu", torch.float32))
    stats = layer_statistics(model, [{"input_ids": ids}])

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    last: list[torch.Tensor] = []
    hf.model.layers[-1].register_forward_hook(lambda m, i, out: last.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        hidden = hf(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    # HF's last hidden state is after the final norm; the residual stream leaving the last layer is hooked.
    streams = [h.double().flatten(0, 1) for h in (*hidden[:-1], last[0])]
    assert len(streams) == source.n_layers + 1 == stats.n_layers + 1 and stats.tokens == 48
    for i, x in enumerate(streams):
        assert float(stats.norms[i]) == pytest.approx(float(x.norm(dim=-1).mean()), rel=1e-5)
        for j, y in enumerate(streams):
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1).clamp(-1, 1)
            assert float(stats.cosine[i, j]) == pytest.approx(float(cos.mean()), abs=1e-5)
            assert float(stats.angular[i, j]) == pytest.approx(float(torch.arccos(cos).mean()) / math.pi, abs=1e-4)


# ---------------------------------------------------------------- rankings and losses


def test_llama_near_identity_layers_rank_most_droppable(llama_2_2_2):
    """Layers 2-3 made near-identity: every criterion picks them; --recommend 2,2,2 keeps core 4-5."""
    report, printed, out = llama_2_2_2
    layers = report["layers"]
    assert two_smallest([row["block_influence"] for row in layers]) == {2, 3}
    assert two_smallest([abs(row["drop_loss_increase"]) for row in layers]) == {2, 3}
    assert all(row["drop_loss_increase"] > 1e-2 for row in layers if row["layer"] not in (2, 3))
    assert report["most_redundant_spans"][1]["layers"] == [2, 3]
    assert (
        report["angular_distance"][2][1]
        < 1e-2
        < min(r[1] for i, r in enumerate(report["angular_distance"][:-1]) if i != 2)
    )
    ranked = report["candidates"]["ranked"]
    assert report["candidates"]["total"] == len(ranked) == 3  # core 2-3, 3-4 or 4-5 between 0-1 and 6-7
    best = ranked[0]
    assert (best["core"], best["dropped"], best["angular_rank"], best["paper_placement"]) == ([4, 5], [2, 3], 1, True)
    assert best["loss_identity_r1"] == pytest.approx(report["source_loss"], abs=1e-3)
    assert all(row["loss_identity_r1"] > best["loss_identity_r1"] + 1e-2 for row in ranked[1:])
    assert best["command"] in printed and "--prelude 0-1 --core 4-5 --coda 6-7" in best["command"]
    import matplotlib.image

    for plot in ("influence.png", "angular_distance.png"):
        assert matplotlib.image.imread(out / plot).shape[0] > 100


def test_candidate_losses_equal_convert_hf_and_eval_loss(llama_2_2_2, tmp_path):
    """The tool's in-memory losses are what the printed convert command + the eval CLI measure."""
    report = llama_2_2_2[0]
    for i, row in enumerate(report["candidates"]["ranked"]):
        model = convert_candidate(row, tmp_path / f"identity_{i}")
        assert eval_loss(model, tmp_path / f"eval_{i}", "1")["1"] == pytest.approx(row["loss_identity_r1"], abs=1e-5)
    row = report["candidates"]["ranked"][1]
    model = convert_candidate(row, tmp_path / "random", "--adapter-init", "random", "--seed", "0")
    losses = eval_loss(model, tmp_path / "eval_random", "1,2,4")
    assert losses == pytest.approx(row["loss_random"], abs=1e-5)
    assert len(set(round(v, 3) for v in losses.values())) == 3  # the random adapter makes r matter


def test_budget_enumerates_every_shape_and_measures_the_most_redundant(llama_2_3, tmp_path, capsys):
    """--budget 6 on 8 layers: 10 shapes x 3 core placements; the four that drop exactly 2-3 come first."""
    report = analyze(llama_2_3, tmp_path / "out", "--budget", "6", "--measure", "5")
    candidates = report["candidates"]
    assert candidates["total"] == math.comb(5, 2) * (8 - 6 + 1) and candidates["measured"] == 5
    ranked = candidates["ranked"]
    assert sum("loss_identity_r1" in row for row in ranked) == 5
    # Every (P, R, C, core start) that drops just 2-3: all keep the same layers in order, so the same loss.
    drop_2_3 = {
        ((*range(p),), (*range(s, s + r),), (*range(8 - c, 8),))
        for p in range(1, 5)
        for r in range(1, 5)
        for c in [6 - p - r]
        if c >= 1
        for s in range(p, 8 - c - r + 1)
        if {*range(p, s), *range(s + r, 8 - c)} == {2, 3}
    }
    assert len(drop_2_3) == 4
    assert {(tuple(row["prelude"]), tuple(row["core"]), tuple(row["coda"])) for row in ranked[:4]} == drop_2_3
    assert sorted(row["angular_rank"] for row in ranked[:4]) == [1, 2, 3, 4]
    assert all(row["loss_identity_r1"] == pytest.approx(report["source_loss"], abs=1e-3) for row in ranked[:4])
    assert ranked[4]["loss_identity_r1"] > ranked[0]["loss_identity_r1"] + 1e-2
    assert "30 candidate surgeries; the 5 with the smallest angular score" in capsys.readouterr().out


def test_olmo2_post_norm_blocks(olmo2_1_2, tmp_path):
    """OLMo-2 layers 1-2 near-identity (post-norm weights scaled): --recommend 1,2,1 keeps core 3-4."""
    report = analyze(olmo2_1_2, tmp_path / "out", "--recommend", "1,2,1")
    assert report["architecture"] == "Olmo2ForCausalLM"
    assert two_smallest([row["block_influence"] for row in report["layers"]]) == {1, 2}
    assert two_smallest([abs(row["drop_loss_increase"]) for row in report["layers"]]) == {1, 2}
    assert report["most_redundant_spans"][1]["layers"] == [1, 2]
    best = report["candidates"]["ranked"][0]
    assert (best["core"], best["dropped"], best["angular_rank"]) == ([3, 4], [1, 2], 1)
    assert best["loss_identity_r1"] == pytest.approx(report["source_loss"], abs=1e-3)
    model = convert_candidate(best, tmp_path / "best")
    assert eval_loss(model, tmp_path / "eval", "1")["1"] == pytest.approx(best["loss_identity_r1"], abs=1e-5)


def test_candidate_plans_place_the_core_between_prelude_and_coda():
    plans = candidate_plans(22, [(4, 8, 4)])
    assert [p.core[0] for p in plans] == list(range(4, 11))
    paper = plans[-1]  # the paper's TinyLlama 4,8,4
    assert (paper.prelude, paper.core, paper.coda, paper.dropped) == (
        tuple(range(4)),
        tuple(range(10, 18)),
        tuple(range(18, 22)),
        tuple(range(4, 10)),
    )


# ---------------------------------------------------------------- bad input


def not_llama(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
    return folder


@pytest.mark.parametrize(
    "source, args, message",
    [
        ("olmo2", ["--recommend", "3,2,2"], "shape 3,2,2 needs 7 layers; the source has 6"),
        ("olmo2", ["--recommend", "2,0,2"], "the core is empty"),
        ("olmo2", ["--recommend", "4x4"], "--recommend '4x4': expected P,R,C"),
        ("olmo2", ["--budget", "7"], "budget 7 is larger than the model: the source has 6 layers"),
        ("olmo2", ["--budget", "2"], "budget 2 is too small"),
        ("olmo2", ["--tokens", "0"], "--tokens must be >= 1"),
        ("olmo2", ["--data", "missing.jsonl"], "no file matches 'missing.jsonl'"),
        ("gpt2", [], "unsupported architecture 'GPT2LMHeadModel'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(olmo2_1_2, tmp_path, capsys, source, args, message):
    folder = olmo2_1_2 if source == "olmo2" else not_llama(tmp_path / "gpt2")
    out = tmp_path / "out"
    assert ANALYZE.main([str(folder), *CALIBRATION, *args, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert captured.err.startswith("titan-recur-analyze-layers: error: ") and not out.exists()


def test_a_full_disk_leaves_nothing_and_the_rerun_writes(olmo2_1_2, tmp_path, capsys):
    """--out on a full disk: one line, and no result file left (an empty layer_analysis.json made the rerun refuse
    it without --force); with space, the same command writes all three."""
    from tests.disk_util import fill_disk, tmpfs

    disk = tmp_path / "tmpfs"
    argv = [str(olmo2_1_2), *CALIBRATION, "--out", str(disk / "out")]
    with tmpfs(disk):
        fill_disk(disk / "filler", leave=0)
        code, err = ANALYZE.main(argv), capsys.readouterr().err
        left = sorted(p.name for p in (disk / "out").iterdir())
        (disk / "filler").unlink()
        again = ANALYZE.main(argv)
        written = sorted(p.name for p in (disk / "out").iterdir())
    assert code == 2 and err.count("\n") == 1 and "No space left on device" in err, err
    assert left == [], left
    assert again == 0 and written == ["angular_distance.png", "influence.png", "layer_analysis.json"]


def test_progress_bars_count_layers(tiny_hf_checkpoint, capsys):
    from titan_recur.convert.layer_analysis import drop_one_losses

    source = read_source(tiny_hf_checkpoint("olmo2"))
    batches = [{"input_ids": torch.arange(3, 19)[None], "labels": torch.arange(4, 20)[None]}]
    losses = drop_one_losses(source, InMemoryWeights.load(source, "cpu", torch.float32), batches, progress=True)
    assert len(losses) == 6 and "drop each layer: 100%" in capsys.readouterr().err


def test_help_names_both_selections(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ANALYZE.main(["--help"])
    printed = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert all(flag in printed for flag in ("--recommend P,R,C", "--budget K", "--measure", "--tokens"))
