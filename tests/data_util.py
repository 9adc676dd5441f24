"""Helpers of the data pipeline tests: small documents of two recognisable sources, a byte-level BPE tokenizer
trained on them, and reading a loader's rows back."""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from titan_recur.config import Data, DataPhase, DataSource

SEQ_LEN = 8
WORDS = "the a cat dog sat on mat two plus equals four sum of".split()


def make_docs(prefix: str, n: int, seed: int = 0) -> list[str]:
    """Documents "<prefix><i> words..."; an upper-case prefix writes upper-case words (to tell sources apart)."""
    rng = random.Random(seed)
    words = [w.upper() for w in WORDS] if prefix.isupper() else WORDS
    return [f"{prefix}{i} " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for i in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> str:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return str(path)


def build_bpe_tokenizer(folder: Path) -> Path:
    """Byte-level BPE (vocab 300) trained on both sources' documents, with BOS <s> (added, Llama style) and EOS
    </s>, saved in ``folder``."""
    (folder / "corpus.txt").write_text("\n".join(make_docs("doc", 200) + make_docs("MATH", 200)))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(folder / "corpus.txt")], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def take(dl, n: int) -> list[dict[str, torch.Tensor]]:
    return list(islice(iter(dl), n))


def full_rows(batches) -> torch.Tensor:
    """(N, seq_len + 1) rows back from {"input_ids", "labels"} batches."""
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == (b["input_ids"].shape[0], SEQ_LEN)
        assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])
    return torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1) for b in batches])


def resume_config(tmp_path, num_workers: int) -> Data:
    web = DataSource(name="web", path=write_jsonl(tmp_path / "web.jsonl", make_docs("doc", 60)), kind="jsonl")
    math = DataSource(name="math", path=write_jsonl(tmp_path / "math.jsonl", make_docs("MATH", 40)), kind="jsonl")
    return Data(
        phases=[DataPhase(0, [web]), DataPhase(20, [web, math])], num_workers=num_workers, validation_fraction=0.1
    )
