"""Pretraining from scratch with the trainer: a model of its own architecture, random init, no source folder.

Oracle: transformers' LlamaForCausalLM, configured by hand from the same numbers, started from the
trainer's initial weights and trained by a plain PyTorch loop (AdamW, clipping) on batches packed by
hand from the tokenizer file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer

from titan_recur.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "assets" / "tokenizer"
BOS, EOS = 1, 2
DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 32, 2, 4, 2, 64, 512
SEQ_LEN, BATCH, STEPS, LR = 32, 2, 3, 3e-3


def scratch_args(dump: Path, data: str) -> list[str]:
    args = {
        "job.dump_folder": str(dump),
        "model.init": "random",
        "model.dim": DIM,
        "model.n_layers": LAYERS,
        "model.n_heads": HEADS,
        "model.n_kv_heads": KV_HEADS,
        "model.ffn_dim": FFN,
        "model.vocab_size": VOCAB,
        "training.steps": STEPS,
        "training.local_batch_size": BATCH,
        "training.seq_len": SEQ_LEN,
        "training.ac_mode": "none",
        "recurrence.mean_recurrence": 1,
        "recurrence.curriculum": "none",
        "optimizer.name": "adamw",
        "optimizer.adamw_lr": LR,
        "optimizer.adamw_weight_decay": 0.1,
        "optimizer.adamw_eps": 1e-8,
        "lr_scheduler.warmup_fraction": 0,
        "lr_scheduler.decay_fraction": 0,
        "data.tokenizer": str(TOKENIZER),
        "data.sources.0.path": data,
        "data.sources.0.kind": "jsonl",
        "metrics.enable_tensorboard": "false",
        "checkpoint.enable": "false",
    }
    return [token for key, value in args.items() for token in (f"--{key}", str(value))]


def hand_batches(docs: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[BOS] doc EOS concatenated, cut into rows of seq_len + 1; inputs and next-token labels per step."""
    hf = HFTokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    stream = [t for d in docs for t in (BOS, *hf.encode(d, add_special_tokens=False).ids, EOS)]
    row = SEQ_LEN + 1
    rows = torch.tensor([stream[i * row : (i + 1) * row] for i in range(STEPS * BATCH)])
    return [(rows[s * BATCH : (s + 1) * BATCH, :-1], rows[s * BATCH : (s + 1) * BATCH, 1:]) for s in range(STEPS)]


def hf_name(name: str) -> str:
    """The trainer's static model names -> LlamaForCausalLM's (written here, not taken from the export)."""
    if name.startswith("prelude."):
        return "model.layers." + name.removeprefix("prelude.")
    return name if name == "lm_head.weight" else "model." + name


def test_from_scratch_run_equals_a_plain_pytorch_loop(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from titan_recur.cli.train import main
    from titan_recur.storage.model_io import architecture_args
    from titan_recur.training.build import initial_full_state

    docs = [json.loads(line)["text"] for line in (REPO / "assets" / "corpus" / "general.jsonl").open()][:20]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    argv = scratch_args(tmp_path / "run", str(data))
    assert main(argv) == 0

    cfg = load_config(None, argv)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    reference = LlamaForCausalLM(config)
    reference.load_state_dict({hf_name(k): v for k, v in initial_full_state(cfg, architecture_args(cfg.model)).items()})
    reference.train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for input_ids, labels in hand_batches(docs):
        loss = F.cross_entropy(reference(input_ids).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    trained = load_file(str(tmp_path / "run" / "final_model" / "model.safetensors"))
    expected = reference.state_dict()
    assert {hf_name(k) for k in trained} == set(expected)
    # Float rounding in the forward (~1e-7) reaches the weights through Adam's division by sqrt(v): 1e-5 is
    # rounding next to the 3 x lr = 9e-3 that three steps move a weight.
    for name, tensor in trained.items():
        torch.testing.assert_close(
            tensor, expected[hf_name(name)], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    initial = initial_full_state(cfg, architecture_args(cfg.model))
    moved = max((tensor - initial[name]).abs().max().item() for name, tensor in trained.items())
    assert moved > 100 * 1e-5  # three steps moved the weights far beyond the tolerance

    # The run's final model exports as an ordinary HF Llama folder that loads without titan_recur.
    hf_folder = tmp_path / "hf"
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "export_hf.py"), str(tmp_path / "run" / "final_model"), str(hf_folder)],
        check=True,
        capture_output=True,
    )
    assert json.loads((hf_folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = LlamaForCausalLM.from_pretrained(hf_folder).eval()
    probe = hand_batches(docs)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(probe).logits, reference.eval()(probe).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model.ffn_dim": None}, "training from scratch needs model.ffn_dim too"),
        ({"model.path": "somewhere"}, "drop model.path and model.preset"),
        ({"model.n_heads": 3}, "model.dim (32) must be a multiple of model.n_heads (3)"),
        ({"model.n_kv_heads": 3}, "model.n_heads (4) must be a multiple of model.n_kv_heads (3)"),
        ({"model.shape": "1,1,1"}, "model.shape must be P,R,C counts summing to model.n_layers (2)"),
        ({"model.init": "load"}, "has no weights: set model.init = 'random'"),
    ],
)
def test_bad_architecture_is_one_line(tmp_path, overrides, expected):
    argv = scratch_args(tmp_path, "x.jsonl")
    for key, value in overrides.items():
        i = argv.index(f"--{key}") if f"--{key}" in argv else None
        if i is not None:
            del argv[i : i + 2]
        if value is not None:
            argv += [f"--{key}", str(value)]
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")) as err:
        load_config(None, argv)
    assert "\n" not in str(err.value)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_training(tmp_path, capsys):
    from titan_recur.cli.train import main

    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    argv = scratch_args(tmp_path / "run", str(data))
    argv[argv.index("--model.vocab_size") + 1] = "100"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocab" in err[0]
    assert not (tmp_path / "run").exists()
