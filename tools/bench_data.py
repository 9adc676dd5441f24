"""Benchmark the data pipeline: tokens/s of one loader process for tokenize+pack with each tokenizer
backend, and for pre-tokenized parquet.

Tokenizers of a realistic size (--vocab) are trained on the corpus here, so nothing is downloaded:
a byte-level BPE tokenizer.json (HF tokenizers), the same merges written as a Llama-3-format
tiktoken file, and a sentencepiece BPE model. The figure "per core" is tokens per CPU second of
the loader process (num_workers = 0, so the process is the whole pipeline).

    python tools/bench_data.py                      # assets/corpus/general.jsonl, seq_len 1024
    python tools/bench_data.py --corpus my.jsonl --seconds 10
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import time
from pathlib import Path

from titan_recur.cli.prepare_data import parse_args, prepare
from titan_recur.config import Data, DataSource
from titan_recur.data.loader import LoaderGeometry, build_dataloader
from titan_recur.data.tokenizer import load_tokenizer


def _texts(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line.strip()]


def build_hf(texts: list[str], vocab: int, folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": specials[0], "add_bos_token": False}))
    return folder


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to chr(256 + i)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def build_tiktoken(hf_folder: Path, folder: Path) -> Path:
    """The byte-level BPE vocabulary as Llama-3 tiktoken ranks (GPT-2 byte alphabet mapped back to bytes)."""
    to_byte = _byte_decoder()
    vocab = json.loads((hf_folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted((rank, token) for token, rank in vocab.items() if token != "<|endoftext|>")
    ranks = [bytes(to_byte[c] for c in token) for _, token in tokens]
    folder.mkdir(parents=True)
    lines = [f"{base64.b64encode(token).decode()} {i}" for i, token in enumerate(ranks)]
    (folder / "tokenizer.model").write_text("\n".join(lines) + "\n")
    return folder


def build_sentencepiece(corpus_txt: Path, vocab: int, folder: Path) -> Path:
    import sentencepiece

    folder.mkdir(parents=True)
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus_txt),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return folder


def measure(cfg: Data, tokenizer_folder: Path, seq_len: int, batch: int, seconds: float) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second) of one loader process."""
    tok = load_tokenizer(tokenizer_folder)
    it = iter(build_dataloader(cfg, tok, LoaderGeometry(seq_len, batch)))
    next(it)  # open the sources
    tokens, wall, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        tokens += next(it)["input_ids"].numel() + batch
    return tokens / (time.perf_counter() - wall), tokens / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="assets/corpus/general.jsonl", help="jsonl with a 'text' field.")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="Rows per batch.")
    parser.add_argument("--vocab", type=int, default=16000, help="Vocabulary size of the trained tokenizers.")
    parser.add_argument("--seconds", type=float, default=5.0, help="Measuring time per case.")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    corpus = Path(args.corpus).resolve()
    texts = _texts(corpus)
    source = Data(sources=[DataSource(path=str(corpus), kind="jsonl")])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "corpus.txt").write_text("\n".join(texts))
        hf = build_hf(texts, args.vocab, tmp / "hf")
        cases = {
            "HF tokenizers (tokenizer.json)": hf,
            "tiktoken (Llama-3 tokenizer.model)": build_tiktoken(hf, tmp / "tiktoken"),
            "sentencepiece (tokenizer.model)": build_sentencepiece(tmp / "corpus.txt", args.vocab, tmp / "sp"),
        }
        print(f"corpus {corpus.name}: {len(texts)} documents, {sum(map(len, texts)):,} chars; seq_len {args.seq_len}")
        for name, folder in cases.items():
            wall, cpu = measure(source, folder, args.seq_len, args.batch, args.seconds)
            print(f"tokenize+pack  {name:36s} {wall:>12,.0f} tokens/s  {cpu:>12,.0f} tokens/CPU-s")
        prepare(
            parse_args(
                [
                    "--tokenizer",
                    str(hf),
                    "--path",
                    str(corpus),
                    "--seq-len",
                    str(args.seq_len),
                    "--out",
                    str(tmp / "pre"),
                    "--workers",
                    "1",
                ]
            )
        )
        pre = Data(sources=[DataSource(path=str(tmp / "pre" / "*.parquet"), kind="tokenized")])
        wall, cpu = measure(pre, hf, args.seq_len, args.batch, args.seconds)
        print(f"pre-tokenized  {'parquet rows':36s} {wall:>12,.0f} tokens/s  {cpu:>12,.0f} tokens/CPU-s")


if __name__ == "__main__":
    main()
