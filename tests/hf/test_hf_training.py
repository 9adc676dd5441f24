"""The HF export as a transformers model: training semantics, Trainer, gradient checkpointing, PEFT,
offload, beam search, inputs_embeds, hidden states, resizing (docs/hf.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf_util import BLOCK_TITAN_RECUR, EXPORT_MEAN, batch, load
from tests.tiny_models import make_model_dir
from titan_recur import greedy_generate, load_model
from titan_recur.hf.export import export_hf
from titan_recur.models.loss import cross_entropy_loss
from titan_recur.training.recurrence import RecurrenceSampler


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def exported_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_training")
    model_dir = make_model_dir(folder / "tied", tie_embeddings=True)
    export_hf(load_model(model_dir), folder / "hf", tokenizer_folder=model_dir, mean_recurrence=EXPORT_MEAN)
    return folder / "hf"


def core_block_calls(model) -> tuple[list[bool], object]:
    """Grad mode of every call of the first core block (one call per iteration), and the hook handle."""
    calls: list[bool] = []
    handle = model.model.core.blocks[0].register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    return calls, handle


def gradients(model, ids: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(ids, labels=ids, **kwargs).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_training_forward_samples_depth_like_the_trainer(tiny_hf_export: Path) -> None:
    """Train mode + grad, no depth given: (n, k) drawn by titan_recur's sampler (seeded by the draw count);
    an int r runs its last min(r, backprop_depth) iterations with grad; eval mode runs r without grad."""
    model = load(tiny_hf_export).train()
    calls, handle = core_block_calls(model)
    ids = batch()
    sampler = RecurrenceSampler()
    for step in range(3):
        calls.clear()
        grads = gradients(model, ids)
        n, k = sampler.sample(EXPORT_MEAN, 8, step=step)
        assert calls == [False] * n + [True] * k, step
        assert set(grads) == {name for name, _ in model.named_parameters()}
    assert model.depth_draws == 3
    for kwargs, expected in (
        (dict(num_steps=10), [False] * 2 + [True] * 8),
        (dict(num_steps=(1, 2)), [False, True, True]),
    ):
        calls.clear()
        gradients(model, ids, **kwargs)
        assert calls == expected, kwargs
    model.config.backprop_depth = 2
    calls.clear()
    gradients(model, ids, num_steps=5)
    assert calls == [False] * 3 + [True] * 2
    model.eval()
    calls.clear()
    grads = gradients(model, ids, num_steps=4)
    assert calls == [False] * 4 and not any(name.startswith("model.core.") for name in grads)
    handle.remove()


TRAINER_SCRIPT = (
    BLOCK_TITAN_RECUR
    + """
import json, sys, torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
export, out = sys.argv[1], sys.argv[2]
ids = torch.randint(3, 512, (6, 12), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in ids]
results = {}
for checkpointing in (False, True):
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                             gradient_checkpointing=checkpointing, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
    results[checkpointing] = {
        "unchanged": [name for name, p in model.named_parameters() if torch.equal(p.detach(), before[name])],
        "parameters": sorted(before), "depth_draws": model.depth_draws,
        "checkpointing": model.model.core.iteration.gradient_checkpointing,
    }
results["titan_recur_imported"] = any(m.split(".")[0] == "titan_recur" for m in sys.modules)
json.dump(results, open(out + "/result.json", "w"))
"""
)


@pytest.mark.slow
def test_trainer_trains_every_part_in_a_fresh_process(tiny_hf_export: Path, tmp_path: Path) -> None:
    """transformers.Trainer, 3 steps, with and without gradient checkpointing, in a process that cannot
    import titan_recur: every parameter tensor changes."""
    argv = [sys.executable, "-c", TRAINER_SCRIPT, str(tiny_hf_export), str(tmp_path)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "result.json").read_text())
    assert results.pop("titan_recur_imported") is False
    for checkpointing, result in results.items():
        assert result["checkpointing"] == (checkpointing == "true") and result["depth_draws"] == 3
        parts = {name.split(".")[1] for name in result["parameters"]}
        assert parts == {"embed_tokens", "prelude", "core", "coda", "norm", "lm_head"}
        assert "model.core.adapter.weight" in result["parameters"]
        assert result["unchanged"] == [], checkpointing


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_hf_export: Path, reentrant: bool) -> None:
    """Per core iteration: backward recomputes each grad iteration (block calls n + 2k), gradients unchanged."""
    model = load(tiny_hf_export).train()
    ids = batch()
    calls, handle = core_block_calls(model)
    steps = dict(num_steps=(2, 3), state_init="zero")
    plain = gradients(model, ids, **steps)
    assert len(calls) == 5
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls.clear()
    checkpointed = gradients(model, ids, **steps)
    assert len(calls) == 2 + 2 * 3
    assert checkpointed.keys() == plain.keys() and len(plain) == len(list(model.parameters()))
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=0, msg=name)
    handle.remove()


def test_peft_lora_trains_merges_and_reloads(tiny_hf_export: Path, tmp_path: Path) -> None:
    """LoRA on q/v and on the adapter: loss falls over 10 steps, the adapter's LoRA changes the output,
    merge + save_pretrained + reload gives the trained model's logits."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "adapter"])
    model = get_peft_model(load(tiny_hf_export), config)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(".core.adapter.lora_A" in name for name in trainable)
    assert all("lora_" in name for name in trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = batch(shape=(4, 12))
    model.train()
    losses = []
    for _ in range(10):
        loss = model(input_ids=ids, labels=ids, num_steps=(1, 2)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids, num_steps=3).logits
        adapter_lora = model.base_model.model.model.core.adapter.lora_B["default"].weight
        saved = adapter_lora.clone()
        adapter_lora.zero_()
        without_adapter_lora = model(input_ids=ids, num_steps=3).logits
        adapter_lora.copy_(saved)
    assert (trained - without_adapter_lora).abs().max() > 1e-3
    merged = model.merge_and_unload()
    assert type(merged.model.core.adapter) is torch.nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(merged(ids, num_steps=3).logits, trained, atol=1e-5, rtol=0)
    merged.save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        reloaded = load(tmp_path / "merged").eval()(ids, num_steps=3).logits
    torch.testing.assert_close(reloaded, trained, atol=1e-5, rtol=0)


def test_save_pretrained_keeps_the_card_and_seals_the_folder(tiny_hf_export: Path, tmp_path: Path, caplog) -> None:
    """A fine-tuned export saved with save_pretrained (what Trainer and a merged PEFT model call) keeps the
    model card, marked as saved after loading, and a manifest: it reloads verified, without the
    "unverified" warning every fine-tuned folder gave."""
    model = load(tiny_hf_export)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # fine-tuned
    model.save_pretrained(tmp_path / "tuned")
    card = (tmp_path / "tuned" / "README.md").read_text()
    source_card = (tiny_hf_export / "README.md").read_text()
    assert (
        card.startswith("---\n")
        and f"Saved with `save_pretrained` from the model loaded from `{tiny_hf_export}`" in card
    )
    assert source_card.split("---\n", 2)[2].strip() in card  # the source's card follows the notice
    manifest = json.loads((tmp_path / "tuned" / "manifest.json").read_text())
    assert manifest["kind"] == "hf_export" and {"config.json", "model.safetensors", "README.md"} <= set(
        manifest["files"]
    )
    with caplog.at_level("WARNING"):
        reloaded = load(tmp_path / "tuned")
    assert reloaded.checksums_verified and "unverified" not in caplog.text
    torch.testing.assert_close(reloaded.model.norm.weight, model.model.norm.weight)
    again = tmp_path / "tuned_again"
    reloaded.save_pretrained(again)  # the card of a saved folder is not marked twice
    assert (again / "README.md").read_text().count("Saved with `save_pretrained`") == 1


# Device maps of the 280 KB export: a CPU budget that keeps only the embedding in memory, and every
# other module on disk but the prelude and the coda.
OFFLOAD_CASES = {
    "max_memory": dict(device_map="auto", max_memory={"cpu": "150KB"}),
    "explicit": dict(
        device_map={
            "model.embed_tokens": "disk",
            "model.prelude": "cpu",
            "model.core": "disk",
            "model.coda": "cpu",
            "model.norm": "disk",
            "model.lm_head": "disk",
        }
    ),
}


@pytest.mark.parametrize("tied, case", [(False, "max_memory"), (True, "max_memory"), (False, "explicit")])
def test_disk_offload_gives_the_in_memory_logits(
    tiny_hf_export: Path, exported_tied: Path, tmp_path: Path, tied: bool, case: str
) -> None:
    """accelerate disk offload: the core (adapter included) on disk, and the logits and hidden states of the
    in-memory model."""
    folder = exported_tied if tied else tiny_hf_export
    ids = batch()
    with torch.no_grad():
        expected = load(folder).eval()(ids, output_hidden_states=True)
        offloaded = load(folder, offload_folder=str(tmp_path), **OFFLOAD_CASES[case]).eval()
        assert offloaded.hf_device_map["model.core"] == "disk"
        assert offloaded.model.core.adapter.weight.device.type == "meta"
        output = offloaded(ids, output_hidden_states=True)
        torch.testing.assert_close(output.logits, expected.logits, atol=1e-5, rtol=0)
        assert len(output.hidden_states) == len(expected.hidden_states) == 1 + 1 + EXPORT_MEAN + 1
        torch.testing.assert_close(output.hidden_states, expected.hidden_states, atol=1e-5, rtol=0)


def test_beam_search_reorders_the_cache(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """num_beams=3 with the cache equals it without (every step recomputed); num_beams=1 is greedy."""
    model = load(tiny_hf_export).eval()
    ids = batch(shape=(2, 6))
    common = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    cached = model.generate(ids, num_beams=3, use_cache=True, **common)
    uncached = model.generate(ids, num_beams=3, use_cache=False, **common)
    assert torch.equal(cached, uncached)
    greedy = model.generate(ids, num_beams=1, **common)[:, ids.shape[1] :]
    assert torch.equal(greedy, greedy_generate(load_model(tiny_model_dir), ids, 8, num_steps=EXPORT_MEAN))
    assert not torch.equal(cached[:, ids.shape[1] :], greedy)  # the beams found other continuations


def test_inputs_embeds_and_hidden_states(tiny_hf_export: Path) -> None:
    model = load(tiny_hf_export).eval()
    ids = batch()
    with torch.no_grad():
        by_ids = model(ids, num_steps=4, output_hidden_states=True)
        by_embeds = model(inputs_embeds=model.get_input_embeddings()(ids), num_steps=4)
        torch.testing.assert_close(by_embeds.logits, by_ids.logits, atol=0, rtol=0)
        hidden = by_ids.hidden_states
        args = model.model.args
        assert len(hidden) == 1 + args.n_prelude + 4 + args.n_coda
        torch.testing.assert_close(model.get_output_embeddings()(hidden[-1]), by_ids.logits, atol=1e-6, rtol=0)
        # The core entries are the states after each iteration: a shallower run's are a prefix of them.
        shallow = model(ids, num_steps=2, output_hidden_states=True).hidden_states
        first_core = 1 + args.n_prelude
        for i in range(first_core + 2):
            torch.testing.assert_close(shallow[i], hidden[i], atol=0, rtol=0)
    generated = model.generate(
        inputs_embeds=model.get_input_embeddings()(ids),
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(
        generated[:, -5:],
        model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)[:, ids.shape[1] :],
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_resize_token_embeddings(tiny_hf_export: Path, exported_tied: Path, tmp_path: Path, tied: bool) -> None:
    model = load(exported_tied if tied else tiny_hf_export).eval()
    vocab = model.config.vocab_size
    ids = batch()
    with torch.no_grad():
        before = model(ids).logits
    model.resize_token_embeddings(vocab + 8)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embeddings.weight.shape[0] == head.weight.shape[0] == vocab + 8
    assert (head.weight is embeddings.weight) == tied
    with torch.no_grad():
        after = model(ids).logits
        torch.testing.assert_close(after[..., :vocab], before, atol=1e-6, rtol=0)
    model.save_pretrained(tmp_path / "resized")
    reloaded = load(tmp_path / "resized").eval()
    assert reloaded.config.titan_recur["vocab_size"] == vocab + 8
    assert (reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight) == tied
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, after, atol=1e-6, rtol=0)


def test_tied_export_declares_tying_the_transformers_way(exported_tied: Path, tmp_path: Path) -> None:
    model = load(exported_tied)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path / "saved")
    from safetensors.torch import load_file

    assert "model.lm_head.weight" not in load_file(str(tmp_path / "saved" / "model.safetensors"))


def test_training_loss_matches_titan_recur(tiny_hf_export: Path, tiny_model_dir: Path) -> None:
    """A training forward at fixed (n, k) computes titan_recur's loss and gradients."""
    hf = load(tiny_hf_export).train()
    ours = load_model(tiny_model_dir).train()
    ids = batch()
    loss = hf(ids, labels=ids, num_steps=(1, 2), state_init="zero").loss
    expected = cross_entropy_loss(ours(ids, (1, 2), state_init="zero")[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    loss.backward()
    expected.backward()
    ours_grads = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        torch.testing.assert_close(p.grad, ours_grads[name.removeprefix("model.")].grad, atol=1e-6, rtol=0)
