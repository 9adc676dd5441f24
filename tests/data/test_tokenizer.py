"""Tokenizer backends on tiny assets built here: ids match the reference libraries; BOS/EOS; errors."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import sentencepiece
import tiktoken
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from titan_recur import load_tokenizer
from titan_recur.data.tokenizer import (
    LLAMA3_PATTERN,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    check_vocab,
)

CORPUS = [
    "The cat sat on the mat. The dog sat on the log.",
    "Two plus two equals four; three times three is nine.",
    "Thinking deeper: recurrence in depth, then the coda.",
    "Unicode too: café, naïve, 数学, emoji 🙂.",
]
SAMPLES = [
    "The theory of the cat, then the mat.",
    "  leading spaces and\nnew lines\n\n",
    "café 数学 🙂 <|begin_of_text|> <s> </s>",
    "",
]


def write_corpus(folder: Path) -> Path:
    path = folder / "corpus.txt"
    path.write_text("\n".join(CORPUS * 20) + "\n")
    return path


def build_hf(folder: Path, config: dict | None, bos_template: bool = False) -> Path:
    """A byte-level BPE tokenizer.json (+ tokenizer_config.json) trained on the corpus."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(write_corpus(folder))], trainer)
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def build_sentencepiece(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        input=str(write_corpus(folder)),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=300,
        byte_fallback=True,
        model_type="bpe",
        minloglevel=2,
    )
    return folder


LLAMA3_MERGES = [b"th", b"the", b" the", b"at", b" c", b" cat", b"in", b"ing", b" s", b"at."]


def llama3_ranks() -> dict[bytes, int]:
    ranks = {bytes([i]): i for i in range(256)}
    for merge in LLAMA3_MERGES:
        ranks[merge] = len(ranks)
    return ranks


def build_tiktoken(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in llama3_ranks().items()]
    (folder / "tokenizer.model").write_text("\n".join(lines) + "\n")
    return folder


def test_hf_backend_matches_transformers_and_round_trips(tmp_path):
    config = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "add_bos_token": False}
    folder = build_hf(tmp_path / "olmo", config)
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    for text in SAMPLES:
        ids = tok.encode(text, bos=False, eos=False)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # OLMo-2 style: no BOS added, EOS <|endoftext|>
    assert (tok.add_bos, tok.eos_id, tok.bos_id, tok.pad_id) == (False, 0, 0, None)
    assert tok.encode("cat", bos=False, eos=True)[-1] == 0
    assert tok.vocab_size == 320


def test_hf_backend_bos_from_config_or_post_processor(tmp_path):
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True}
    tok = load_tokenizer(build_hf(tmp_path / "llama", config))
    assert (tok.add_bos, tok.bos_id, tok.eos_id, tok.pad_id) == (True, 1, 2, 3)
    ids = tok.encode("the cat", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == "<s>the cat</s>"
    # no add_bos_token key: follow the tokenizer's own post-processor
    implicit = {"bos_token": "<s>", "eos_token": "</s>"}
    assert load_tokenizer(build_hf(tmp_path / "with_template", implicit, bos_template=True)).add_bos
    assert not load_tokenizer(build_hf(tmp_path / "no_template", implicit)).add_bos


def test_hf_backend_needs_an_eos(tmp_path):
    with pytest.raises(ValueError, match="eos_token"):
        load_tokenizer(build_hf(tmp_path / "x", None))


def test_sentencepiece_backend_matches_sentencepiece(tmp_path):
    folder = build_sentencepiece(tmp_path / "tinyllama")
    tok = load_tokenizer(folder)
    assert isinstance(tok, SentencePieceTokenizer)
    ref = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    for text in SAMPLES:
        ids = tok.encode(text, bos=False, eos=False)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == ref.decode(ref.encode(text))
    assert tok.decode(tok.encode(SAMPLES[0], bos=False, eos=False)) == SAMPLES[0]
    assert (tok.add_bos, tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (True, 1, 2, None, 300)
    ids = tok.encode("the cat", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and ids[1:-1] == ref.encode("the cat")


def test_tiktoken_backend_matches_tiktoken_with_llama3_specials(tmp_path):
    tok = load_tokenizer(build_tiktoken(tmp_path / "llama3"))
    assert isinstance(tok, TiktokenTokenizer)
    n_base = 256 + len(LLAMA3_MERGES)
    ref = tiktoken.Encoding(name="ref", pat_str=LLAMA3_PATTERN, mergeable_ranks=llama3_ranks(), special_tokens={})
    for text in SAMPLES:
        ids = tok.encode(text, bos=False, eos=False)
        assert ids == ref.encode_ordinary(text) and tok.decode(ids) == text
    merged = [256 + LLAMA3_MERGES.index(b" the"), 256 + LLAMA3_MERGES.index(b" cat")]
    assert tok.encode(" the cat", bos=False, eos=False) == merged
    # Meta's layout: begin/end of text first, eot_id at +9, 256 specials in all
    specials = tok.special_tokens
    assert specials["<|begin_of_text|>"] == n_base and specials["<|end_of_text|>"] == n_base + 1
    assert specials["<|start_header_id|>"] == n_base + 6 and specials["<|eot_id|>"] == n_base + 9
    assert specials["<|reserved_special_token_2|>"] == n_base + 11
    assert specials["<|reserved_special_token_246|>"] == n_base + 255 and len(specials) == 256
    assert (tok.add_bos, tok.bos_id, tok.eos_id, tok.pad_id) == (True, n_base, n_base + 1, None)
    assert tok.vocab_size == n_base + 256
    ids = tok.encode("cat", bos=True, eos=True)
    assert ids[0] == n_base and ids[-1] == n_base + 1
    assert tok.decode(ids) == "<|begin_of_text|>cat<|end_of_text|>"


def test_tiktoken_long_runs_are_split_and_round_trip(tmp_path):
    tok = load_tokenizer(build_tiktoken(tmp_path / "llama3"))
    text = "the cat " * 2000 + " " * 60_000 + "x" * 30_000 + " end"
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_missing_tokenizer_files_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(tmp_path)
    message = str(e.value)
    assert str(tmp_path) in message and "tokenizer.json" in message and "tokenizer.model" in message
    assert "\n" not in message


def test_check_vocab_allows_padding_and_refuses_overflow(tmp_path):
    tok = load_tokenizer(build_sentencepiece(tmp_path / "sp"))
    check_vocab(tok, 300)
    check_vocab(tok, 384)  # a padded embedding is fine
    with pytest.raises(ValueError, match="vocab mismatch.*up to 299.*vocab_size is 256"):
        check_vocab(tok, 256)
