"""The exported code on the oldest supported transformers (4.57, the .venv-hf4 overlay of tools/compat_env.sh)
and on the pinned 5.x, each in a process that cannot import titan_recur: titan_recur's logits exactly,
greedy, beam and assisted generation, the tokenizer without a prompt, a training step with gradient checkpointing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf_util import BLOCK_TITAN_RECUR, left_padded_batch
from titan_recur import greedy_generate, load_model

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / ".venv-hf4"

SCRIPT = (
    BLOCK_TITAN_RECUR
    + """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
export, out = sys.argv[1], sys.argv[2]
inputs = torch.load(out + "/inputs.pt")
ids, mask = inputs["ids"], inputs["mask"]
model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True).eval()
result = {"version": transformers.__version__}
with torch.no_grad():
    logits = {r: model(ids, attention_mask=mask, num_steps=r).logits for r in (1, 3)}
common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
greedy = model.generate(ids, **common)[:, ids.shape[1]:]
beams = [model.generate(ids, num_beams=3, use_cache=cache, **common).tolist() for cache in (True, False)]
result["beams_equal_without_cache"] = beams[0] == beams[1]
# Assisted decoding by the same export at depth 1 (one row: transformers assists batch 1 only) crops the caches.
assistant = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, num_steps=1).eval()
row = {**common, "attention_mask": mask[-1:]}
assisted = model.generate(ids[-1:], assistant_model=assistant, **row)
result["assisted_equals_greedy"] = torch.equal(assisted, model.generate(ids[-1:], **row))
# transformers 5 reads the model config (custom code) to pick a tokenizer: trust_remote_code=False skips
# the question; 4.x reads tokenizer_config.json only.
kwargs = {"trust_remote_code": False} if transformers.__version__.startswith("5.") else {}
tokenizer = AutoTokenizer.from_pretrained(export, **kwargs)
result["tokenizer"] = [type(tokenizer).__name__, tokenizer("What is 3 + 4?").input_ids]
# What users pass straight on (docs/hf.md's recipes): the tokenizer's output, and a collated Trainer batch.
encoded = tokenizer("What is 3 + 4?", return_tensors="pt")
result["model_inputs"] = sorted(encoded.keys())
with torch.no_grad():
    model(**encoded)
model.generate(**encoded, max_new_tokens=2)
from transformers import DataCollatorForLanguageModeling
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
collated = DataCollatorForLanguageModeling(tokenizer, mlm=False)([tokenizer(t) for t in ("a b c", "What is 3 + 4?")])
result["trainer_loss"] = float(model(**collated).loss)
model.train()
grads = []
for checkpointing in (False, True):
    if checkpointing:  # transformers 5's name; 4.57 has only gradient_checkpointing_enable (5.x: deprecated alias)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.zero_grad()
    model(ids, labels=ids, num_steps=(1, 2), state_init="zero").loss.backward()
    grads.append([p.grad.clone() for p in model.parameters()])
result["every_parameter_gets_grad"] = all(g.abs().sum() > 0 for g in grads[0])
result["checkpointed_grads_equal"] = all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(*grads))
model.zero_grad()
model(ids, labels=ids).loss.backward()  # no depth given: drawn by the sampler
result["sampled_step_trains_the_core"] = all(p.grad is not None for p in model.model.core.parameters())
model.save_pretrained(out + "/saved")  # as Trainer does: the card kept, a manifest written
saved = AutoModelForCausalLM.from_pretrained(out + "/saved", trust_remote_code=True)
result["saved_reloads_verified"] = saved.checksums_verified
result["saved_card_notices"] = open(out + "/saved/README.md").read().count("Saved with `save_pretrained`")
torch.save({"logits": logits, "greedy": greedy}, out + "/outputs.pt")
json.dump(result, open(out + "/result.json", "w"))
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("version", ["4.57", "5"])
def test_export_runs_on_transformers(
    tiny_hf_export: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    version: str,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if version == "4.57":
        if not (OVERLAY / "transformers").is_dir():
            pytest.fail(f"{OVERLAY} is missing: build it with `bash tools/compat_env.sh` (tools/setup_env.sh does)")
        env["PYTHONPATH"] = str(OVERLAY)
    ids, mask = left_padded_batch()
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_hf_export), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "custom code" not in done.stdout + done.stderr  # no trust_remote_code prompt
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["version"].startswith(version + ".")
    outputs = torch.load(tmp_path / "outputs.pt")
    reference = load_model(tiny_model_dir)
    with torch.no_grad():
        for r in (1, 3):
            assert torch.equal(outputs["logits"][r], reference(ids, r, attention_mask=mask, state_init="zero")), r
    assert torch.equal(outputs["greedy"], greedy_generate(reference, ids, 6, attention_mask=mask, num_steps=3))
    assert result["beams_equal_without_cache"] and result["assisted_equals_greedy"]
    from titan_recur.data.tokenizer import load_tokenizer

    expected_ids = load_tokenizer(tiny_model_dir).encode("What is 3 + 4?", bos=True, eos=False)
    tokenizer_class = "PreTrainedTokenizerFast" if version == "4.57" else "TokenizersBackend"
    assert result["tokenizer"] == [tokenizer_class, expected_ids]
    assert result["model_inputs"] == ["attention_mask", "input_ids"] and result["trainer_loss"] > 0
    assert result["every_parameter_gets_grad"] and result["checkpointed_grads_equal"]
    assert result["sampled_step_trains_the_core"]
    assert result["saved_reloads_verified"] and result["saved_card_notices"] == 1
