"""Loss masking: prompt-completion records and pre-tokenized labels.

The oracle of every test is the tokenizer file itself, read with HF `tokenizers` (not the project's
tokenizer wrapper), and a loss written out by hand from log-softmax.
"""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from titan_recur.config import ConfigError, Data, DataSource, load_config
from titan_recur.data.loader import DataError, LoaderGeometry, build_dataloader, check_data_config
from titan_recur.data.tokenizer import load_tokenizer
from titan_recur.models.loss import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "assets" / "tokenizer"
BOS, EOS = 1, 2  # assets/tokenizer's <|begin_of_text|>, <|end_of_text|>
SEQ_LEN = 16
RECORDS = [("3 a b a =", " 5"), ("0 b =", " 2"), ("7 a a b b =", " 1"), ("Question: what is 4 + 4?", " 8")]


def write_records(path: Path, records: list[tuple[str, str]], repeat: int = 1) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in records * repeat))
    return str(path)


def expected_stream(records: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """[BOS] prompt completion EOS per record, concatenated; labels -100 on BOS and the prompt."""
    hf = HFTokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    ids, labels = [], []
    for prompt, completion in records:
        p = hf.encode(prompt, add_special_tokens=False).ids
        c = hf.encode(completion, add_special_tokens=False).ids
        ids += [BOS, *p, *c, EOS]
        labels += [IGNORE_INDEX] * (1 + len(p)) + [*c, EOS]
    return ids, labels


def masked_loader(data: Data, batch: int = 2, seq_len: int = SEQ_LEN):
    return build_dataloader(data, load_tokenizer(TOKENIZER), LoaderGeometry(seq_len, batch))


def records_source(path: str, **kwargs) -> DataSource:
    return DataSource(name="qa", path=path, kind="jsonl", format="prompt_completion", **kwargs)


def test_prompt_tokens_get_the_ignore_label(tmp_path):
    repeat = 6
    path = write_records(tmp_path / "qa.jsonl", RECORDS, repeat)
    ids, labels = expected_stream(RECORDS * repeat)
    row = SEQ_LEN + 1
    batches = list(islice(iter(masked_loader(Data(sources=[records_source(path)]))), len(ids) // row // 2))
    inputs = torch.cat([b["input_ids"] for b in batches])
    got_labels = torch.cat([b["labels"] for b in batches])
    for i in range(inputs.shape[0]):
        assert inputs[i].tolist() == ids[i * row : (i + 1) * row - 1]
        assert got_labels[i].tolist() == labels[i * row + 1 : (i + 1) * row]
    assert (got_labels != IGNORE_INDEX).sum() < got_labels.numel() / 2  # most of the stream is prompt


def test_a_text_source_keeps_the_loss_on_every_token(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": c, "text": p + c}) + "\n" for p, c in RECORDS * 4))
    batch = next(iter(masked_loader(Data(sources=[DataSource(path=str(path), kind="jsonl")]))))
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])


def tiny_config(tmp_path: Path, data_path: str, steps: int, **overrides: str) -> list[str]:
    """A from-scratch static model on prompt-completion records: the trainer's command line."""
    args = {
        "job.dump_folder": str(tmp_path / "run"),
        "model.init": "random",
        "model.dim": "32",
        "model.n_layers": "2",
        "model.n_heads": "2",
        "model.ffn_dim": "64",
        "model.vocab_size": "512",
        "training.steps": str(steps),
        "training.local_batch_size": "2",
        "training.seq_len": str(SEQ_LEN),
        "training.ac_mode": "none",
        "recurrence.mean_recurrence": "1",
        "recurrence.curriculum": "none",
        "optimizer.name": "adamw",
        "data.tokenizer": str(TOKENIZER),
        "data.sources.0.path": data_path,
        "data.sources.0.kind": "jsonl",
        "data.sources.0.format": "prompt_completion",
        "metrics.log_freq": "1",
        "metrics.enable_tensorboard": "false",
        "checkpoint.interval": "2",
        "checkpoint.keep_latest_k": "0",
        **overrides,
    }
    return [token for key, value in args.items() for token in (f"--{key}", value)]


def test_masked_loss_equals_a_hand_computation(tmp_path):
    """The loss the trainer logs at step 1 (initial weights) is the mean CE over the completion tokens and EOS."""
    from titan_recur.cli.train import main
    from titan_recur.models.model import RecurrentLM
    from titan_recur.storage.model_io import architecture_args
    from titan_recur.training.build import initial_full_state

    path = write_records(tmp_path / "qa.jsonl", RECORDS, 6)
    argv = tiny_config(tmp_path, path, steps=1)
    assert main(argv) == 0
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]

    cfg = load_config(None, argv)
    model = RecurrentLM(architecture_args(cfg.model))
    model.load_state_dict(initial_full_state(cfg, model.args))
    ids, labels = expected_stream(RECORDS * 6)
    row = SEQ_LEN + 1
    x = torch.tensor([ids[i * row : (i + 1) * row - 1] for i in range(2)])
    y = [labels[i * row + 1 : (i + 1) * row] for i in range(2)]
    with torch.no_grad():
        logp = torch.log_softmax(model(x, 1).double(), dim=-1)
    terms = [-logp[b, t, y[b][t]] for b in range(2) for t in range(SEQ_LEN) if y[b][t] != IGNORE_INDEX]
    assert len(terms) == 6  # the answers of three records, each with its EOS, fall in these two rows
    assert logged == pytest.approx(float(sum(terms) / len(terms)), rel=1e-5)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_with_masked_packing_is_exact(tmp_path, num_workers):
    path = write_records(tmp_path / "qa.jsonl", RECORDS, 25)
    data = Data(sources=[records_source(path, shuffle_buffer=8)], num_workers=num_workers)
    reference = list(islice(iter(masked_loader(data)), 60))  # several epochs
    first = masked_loader(data)
    it = iter(first)
    head = [next(it) for _ in range(23)]
    resumed = masked_loader(data)
    resumed.load_state_dict(first.state_dict())
    tail = list(islice(iter(resumed), 37))
    for got, want in zip(head + tail, reference, strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])


def test_trainer_resume_on_masked_data_is_bit_identical(tmp_path):
    """Resumed from its step-2 checkpoint (data position mid-row, inside a record), a run retrains steps 3-4 to
    the same weights."""
    from safetensors.torch import load_file

    from titan_recur.cli.train import main

    path = write_records(tmp_path / "qa.jsonl", RECORDS, 6)
    weights = tmp_path / "run" / "final_model" / "model.safetensors"
    assert main(tiny_config(tmp_path, path, steps=4)) == 0
    whole = load_file(str(weights))
    assert main(tiny_config(tmp_path, path, steps=4, **{"checkpoint.load_step": "2"})) == 0
    resumed = load_file(str(weights))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.slow
@pytest.mark.parametrize("seq_len_flag", [[], ["--seq-len", str(SEQ_LEN)]], ids=["v2-stream", "v1-rows"])
def test_pretokenized_labels_give_the_records_rows(tmp_path, seq_len_flag):
    path = write_records(tmp_path / "qa.jsonl", RECORDS, 10)
    out = tmp_path / "tok"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "prepare_data.py"),
            "--tokenizer",
            str(TOKENIZER),
            "--path",
            path,
            "--kind",
            "jsonl",
            "--format",
            "prompt_completion",
            "--out",
            str(out),
            "--workers",
            "1",
            *seq_len_flag,
        ],
        check=True,
        capture_output=True,
    )
    tokenized = Data(sources=[DataSource(path=str(out / "*.parquet"), kind="tokenized")])
    records = Data(sources=[records_source(path)])
    for got, want in zip(
        islice(iter(masked_loader(tokenized)), 5), islice(iter(masked_loader(records)), 5), strict=True
    ):
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])


def test_pretokenized_labels_outside_the_vocabulary_are_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = list(range(3, 3 + SEQ_LEN + 1))
    pq.write_table(
        pa.table({"input_ids": [row], "labels": [[IGNORE_INDEX] * SEQ_LEN + [9999]]}), tmp_path / "rows.parquet"
    )
    data = Data(sources=[DataSource(name="rows", path=str(tmp_path / "rows.parquet"), kind="tokenized")])
    with pytest.raises(DataError, match=r"label 9999 outside the tokenizer's vocabulary") as err:
        next(iter(masked_loader(data, batch=1)))
    assert "\n" not in str(err.value)


def test_records_without_their_fields_are_one_line(tmp_path, capsys):
    """A file without the field: one line before training (exit 2, nothing written); a record without it among
    complete ones: one line when it is read."""
    from titan_recur.cli.train import main

    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"prompt": "3 a ="}) + "\n")
    assert main(tiny_config(tmp_path, str(path), steps=1)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "field 'completion' not found" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()

    path.write_text(json.dumps({"prompt": "3 a =", "completion": " 4"}) + "\n" + json.dumps({"prompt": "3 b ="}) + "\n")
    data = Data(sources=[records_source(str(path))])
    check_data_config(data, load_tokenizer(TOKENIZER), SEQ_LEN)  # the first record is complete
    with pytest.raises(DataError, match=r"a record without the 'completion' field") as err:
        next(iter(masked_loader(data)))
    assert "\n" not in str(err.value)


def test_records_need_a_format_with_fields():
    with pytest.raises(ConfigError, match="format 'prompt_completion' needs records with fields"):
        load_config(
            None,
            [
                "--model.path",
                "x",
                "--data.sources.0.path",
                "a.txt",
                "--data.sources.0.kind",
                "text",
                "--data.sources.0.format",
                "prompt_completion",
            ],
        )


# Each record: a 42-token prompt and a 1-token answer. Packed into steps of 2 rows of 16 labels, steps 1 and 5
# hold no completion token: every label of the step is IGNORE_INDEX.
LONG_PROMPTS = [(" ".join(["a b"] * 20) + " =", " 5")]


def test_a_step_without_a_labelled_token_is_skipped_and_counted(tmp_path, capsys):
    """It raised ZeroDivisionError at the same step on every rerun (training, and validation on such data)."""
    from tests.tiny_runs import read_checkpoint
    from titan_recur.cli.train import main

    path = write_records(tmp_path / "qa.jsonl", LONG_PROMPTS, 8)
    held_out = write_records(tmp_path / "held_out.jsonl", LONG_PROMPTS, 8)
    validation = {
        "validation.enable": "true",
        "validation.interval": "2",
        "validation.steps": "1",
        "data.validation_sources.0.path": held_out,
        "data.validation_sources.0.kind": "jsonl",
        "data.validation_sources.0.format": "prompt_completion",
    }
    assert main(tiny_config(tmp_path, path, steps=6, **validation)) == 0
    out = capsys.readouterr().out
    for step in (1, 5):
        assert f"no labelled token in the global batch of step {step} (every label is ignored" in out, out
    assert "step skipped (1 so far)" in out and "step skipped (2 so far)" in out
    assert "validation at step 2 skipped: no labelled token in its 1 batches" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 3, 4, 6]
    final = read_checkpoint(tmp_path / "run" / "checkpoints" / "step-6", tmp_path)
    assert final["train"]["skipped_steps"] == 2 and final["train"]["step"] == 6
