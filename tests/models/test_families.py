"""The families beyond Llama and OLMo-2 (Qwen2, Qwen3, Mistral) through every tool: each from a tiny random
source built with transformers' own config class (conftest.TINY_HF_CHECKPOINTS), nothing downloaded.

Conversion against transformers' logits, blocks against its decoder layers, FLOPs against torch's counter and
the static export live beside the Llama/OLMo-2 cases in test_surgery.py, test_model.py, test_cost_model.py and
test_export_hf.py; this file adds what a retrofit of each new family then runs.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from tests.tiny_runs import STEPS, WORKER, run_single, worker_args
from tests.torchrun_util import load_tool, run_torchrun
from titan_recur.convert.surgery import ConvertOptions, convert, hf_config_to_model_args, plan_layers, read_source
from titan_recur.hf.export import export_hf
from titan_recur.inference.engine import greedy_generate
from titan_recur.models.args import PRESETS
from titan_recur.models.families import FAMILIES
from titan_recur.storage.model_io import load_model
from titan_recur.training.cost_model import block_params, param_counts

NEW_FAMILIES = ["qwen2", "qwen3", "mistral"]
DATA = str(Path(__file__).resolve().parents[2] / "assets" / "corpus" / "general.jsonl")


@pytest.fixture(scope="module")
def recurrent(tiny_hf_checkpoint, tmp_path_factory):
    """family -> a 2,2,2 retrofit of its tiny source (random adapter, so the core's loop matters)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = tmp_path_factory.mktemp(f"{family}_2_2_2")
            options = ConvertOptions(adapter_init="random", state_init="zero", mean_recurrence=3)
            convert(tiny_hf_checkpoint(family), built[family], plan_layers(6, (2, 2, 2)), options, force=True)
        return built[family]

    return get


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_cost_model_counts_a_block_as_transformers_builds_it(tiny_hf_checkpoint, family):
    from transformers import AutoModelForCausalLM

    source = tiny_hf_checkpoint(family)
    hf = AutoModelForCausalLM.from_pretrained(source)
    plan = plan_layers(read_source(source).n_layers, (2, 2, 2))
    args = hf_config_to_model_args(read_source(source), plan, ConvertOptions())
    assert type(hf).__name__ == FAMILIES[family].architecture
    assert block_params(args) == sum(p.numel() for p in hf.model.layers[0].parameters())


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_hf_export_generates_the_engines_tokens(recurrent, tmp_path, family):
    """The retrofit exported for transformers (trust_remote_code) loads with from_pretrained, and its greedy
    generate gives the engine's tokens at the export's default depth."""
    from transformers import AutoModelForCausalLM

    folder = recurrent(family)
    export_hf(load_model(folder), tmp_path / "hf", tokenizer_folder=folder)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    prompt = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = greedy_generate(load_model(folder), prompt, 8, num_steps=3)
    assert torch.equal(theirs[:, 12:], ours)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_analyze_layers_ranks_the_source(tiny_hf_checkpoint, tmp_path, family):
    analyze = load_tool("analyze_layers")
    args = [str(tiny_hf_checkpoint(family)), "--data", DATA, "--seq-len", "32", "--batch-size", "4"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert analyze.main([*args, "--tokens", "256", "--out", str(tmp_path), "--recommend", "2,2,2"]) == 0
    report = json.loads((tmp_path / "layer_analysis.json").read_text())
    assert report["architecture"] == FAMILIES[family].architecture and len(report["layers"]) == 6


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_retrofit_trains_on_two_ranks_as_on_one(recurrent, tmp_path, family):
    """FSDP2 on 2 ranks (gloo) against one process: the same losses and first-step gradients."""
    extra = ("--optimizer", "adamw", "--ac", "per_iteration", "--steps", str(STEPS))
    single_args, single_out = worker_args(recurrent(family), tmp_path, "single", *extra)
    multi_args, multi_out = worker_args(recurrent(family), tmp_path, "multi", *extra)
    run_single(single_args)
    run_torchrun([WORKER, *multi_args], nproc=2)
    single, multi = torch.load(single_out), torch.load(multi_out)
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    for name, grad in single["grads"][0].items():
        torch.testing.assert_close(multi["grads"][0][name], grad, atol=1e-6, rtol=0, msg=name)
    assert multi["silent_fsdp_modules"] == []


# Published parameter counts of the new families' presets (each model card's safetensors total; all tie
# their embeddings), so a wrong preset field shows here.
PUBLISHED_PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "smollm2-1.7b": 1_711_376_384,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_new_presets_count_the_published_parameters(name):
    preset = PRESETS[name]
    whole_source = preset.model_args(preset.n_layers, 0, 0, tie_embeddings=True)
    assert param_counts(whole_source).total == PUBLISHED_PARAMETERS[name]
    preset.check_shape(preset.default_shape, name)
