"""Tokenize and pack a dataset into pre-tokenized parquet shards for the fast "tokenized" data path.

Documents are read in order with the trainer's own reader, tokenized by a pool of processes and
packed exactly as the trainer packs text ([BOS] doc EOS, concatenated). Two formats, both parquet
files with one list<int32> column ``input_ids``:

- v2 (default, no --seq-len): a flat token stream, chunks of --chunk-tokens tokens (the last one
  shorter, nothing dropped), plus OUT/metadata.json (format, tokenizer probe, vocab size, BOS/EOS,
  token and document counts). The trainer packs it into rows at any seq_len, and refuses it at
  start-up, in one line, if the run's tokenizer is not the one it was made with.
- v1 (--seq-len N): rows of exactly N + 1 tokens (a row may span documents; the final partial row
  is dropped), for that seq_len only.

With --format prompt_completion (records with prompt and completion fields) both formats also get a
``labels`` column beside ``input_ids``: the token, or -100 for BOS and the prompt's tokens, so the
trainer's loss is on the completions only, exactly as when it reads the records themselves.

Train on either with

    [[data.sources]]
    path = "OUT/*.parquet"
    kind = "tokenized"

Examples:

    python tools/prepare_data.py --tokenizer models/tinyllama --path "corpus/*.jsonl" --kind jsonl \\
        --out data/corpus
    python tools/prepare_data.py --tokenizer models/llama3_2_1b --path HuggingFaceFW/fineweb-edu \\
        --kind hf --hf-config sample-10BT --out data/fwe --max-docs 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from titan_recur.config import DATA_FORMATS, DataSource
from titan_recur.data.loader import (
    LABELS_COLUMN,
    TOKENS_COLUMN,
    TOKENS_FORMAT_V2,
    TOKENS_METADATA,
    check_text,
    encode_labelled,
    is_empty,
    open_source,
    read_documents,
    tokenizer_probe,
)
from titan_recur.data.tokenizer import Tokenizer, load_tokenizer

_tokenizer: Tokenizer | None = None


def _init_worker(folder: str) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(folder)


def _encode_chunk(docs: list) -> tuple[np.ndarray, int]:
    """The packed (2, tokens) stream of a chunk of documents, ids and labels (int32: cheap to send back), and its
    document count."""
    kept = [d for d in docs if not is_empty(d)]
    pairs = [encode_labelled(_tokenizer, d) for d in kept]
    ids = [t for pair in pairs for t in pair[0]]
    labels = [t for pair in pairs for t in pair[1]]
    return np.asarray([ids, labels], dtype=np.int32).reshape(2, -1), len(kept)


def _chunks(source: DataSource, docs_per_task: int, max_docs: int | None) -> Iterator[list]:
    seen = 0
    for docs in read_documents(open_source(source), source, docs_per_task):
        docs = docs[: None if max_docs is None else max_docs - seen]
        for doc in docs:
            check_text(doc, source)  # a record without its fields: one line here, not a worker's traceback
        seen += len(docs)
        yield docs
        if max_docs is not None and seen >= max_docs:
            return


def _write_shard(flat: np.ndarray, row_len: int, path: Path, labels: bool) -> None:
    """``flat`` (ids; labels) as rows of ``row_len`` tokens (the last one shorter if it does not divide); the
    labels column only when asked for."""
    offsets = pa.array(np.append(np.arange(0, flat.shape[1], row_len), flat.shape[1]).astype(np.int32))
    columns = {TOKENS_COLUMN: pa.ListArray.from_arrays(offsets, pa.array(flat[0]))}
    if labels:
        columns[LABELS_COLUMN] = pa.ListArray.from_arrays(offsets, pa.array(flat[1]))
    pq.write_table(pa.table(columns), path)


def _write_metadata(out: Path, tokenizer_folder: str, tokens: int, documents: int, chunk_tokens: int) -> None:
    tokenizer = load_tokenizer(tokenizer_folder)
    meta = {
        "format": TOKENS_FORMAT_V2, "tokenizer_probe": tokenizer_probe(tokenizer), "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "documents": "[BOS] doc EOS, concatenated",
        "tokens": tokens, "document_count": documents, "chunk_tokens": chunk_tokens,
    }
    (out / TOKENS_METADATA).write_text(json.dumps(meta, indent=2) + "\n")


class _Progress:
    """tqdm when installed, else a line every 10 s."""

    def __init__(self) -> None:
        try:
            from tqdm import tqdm

            self.bar = tqdm(unit="tok", unit_scale=True, desc="tokens", file=sys.stderr)
        except ImportError:
            self.bar = None
        self.total, self.start, self.last = 0, time.perf_counter(), 0.0

    def update(self, n: int) -> None:
        self.total += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.perf_counter() - self.last > 10:
            self.last = time.perf_counter()
            print(f"{self.total:,} tokens, {self.total / (self.last - self.start):,.0f} tokens/s", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def prepare(args: argparse.Namespace) -> None:
    kind = args.kind
    source = DataSource(
        name=args.path, path=args.path, kind=kind, text_field=args.text_field,
        hf_config=args.hf_config, split=args.split, sample_by=args.sample_by, format=args.data_format,
    )
    if args.data_format != "text" and kind == "text":
        raise SystemExit("prepare_data.py: error: --format prompt_completion needs records: --kind jsonl, parquet or hf")
    labels = args.data_format != "text"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.parquet")):
        raise SystemExit(f"{out} already holds parquet files; use an empty folder")
    stream = args.seq_len is None  # v2: a flat token stream, readable at any seq_len
    row_len = args.chunk_tokens if stream else args.seq_len + 1
    shard_tokens = args.rows_per_shard * row_len
    pending: list[np.ndarray] = []
    n_pending = shards = rows = documents = 0
    progress = _Progress()
    start = time.perf_counter()
    with Pool(args.workers, initializer=_init_worker, initargs=(args.tokenizer,)) as pool:
        for ids, docs in pool.imap(_encode_chunk, _chunks(source, args.docs_per_task, args.max_docs)):
            progress.update(ids.shape[1])
            pending.append(ids)
            n_pending += ids.shape[1]
            documents += docs
            while n_pending >= shard_tokens:
                flat = np.concatenate(pending, axis=1)
                _write_shard(flat[:, :shard_tokens], row_len, out / f"part-{shards:05d}.parquet", labels)
                pending, n_pending = [flat[:, shard_tokens:]], flat.shape[1] - shard_tokens
                shards, rows = shards + 1, rows + args.rows_per_shard
    progress.close()
    flat = np.concatenate(pending, axis=1) if pending else np.zeros((2, 0), np.int32)
    kept = flat.shape[1] if stream else flat.shape[1] // row_len * row_len
    if kept:
        _write_shard(flat[:, :kept], row_len, out / f"part-{shards:05d}.parquet", labels)
        shards, rows = shards + 1, rows + -(-kept // row_len)
    if stream:
        _write_metadata(out, args.tokenizer, progress.total, documents, row_len)
    seconds = time.perf_counter() - start
    layout = f"chunks of {row_len} tokens (v2 token stream)" if stream else f"rows of {row_len} tokens (v1)"
    print(
        f"{progress.total:,} tokens of {documents:,} documents -> {rows:,} {layout} in {shards} shards under {out} "
        f"({flat.shape[1] - kept} trailing tokens dropped); {seconds:.1f} s, "
        f"{progress.total / max(seconds, 1e-9):,.0f} tokens/s with {args.workers} workers"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="Folder with tokenizer.json or tokenizer.model.")
    parser.add_argument("--path", required=True, help="Local file or glob, or a hub dataset id (--kind hf).")
    parser.add_argument("--kind", choices=["text", "jsonl", "parquet", "hf"], default="jsonl", help="Source format.")
    parser.add_argument("--text-field", default="text", help="Column or key holding the text.")
    parser.add_argument("--format", dest="data_format", choices=DATA_FORMATS, default="text",
                        help="'text' documents, or 'prompt_completion' records (fields prompt and completion): "
                        "writes a labels column with -100 on the prompts (default: text).")
    parser.add_argument("--hf-config", default=None, help="Hub dataset config name (--kind hf).")
    parser.add_argument("--split", default="train", help="Hub dataset split (--kind hf).")
    parser.add_argument(
        "--sample-by", choices=["paragraph", "document", "line"], default="paragraph",
        help="--kind text: one document per blank-line-separated paragraph, per file, or per line.",
    )
    parser.add_argument("--seq-len", type=int, default=None,
                        help="v1: rows of exactly seq_len + 1 tokens for this seq_len (default: v2, a token stream)")
    parser.add_argument("--chunk-tokens", type=int, default=8192, help="v2: tokens per parquet row (default 8192)")
    parser.add_argument("--out", required=True, help="Empty output folder for part-NNNNN.parquet shards.")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="Tokenizer processes (default: all cores).")
    parser.add_argument("--rows-per-shard", type=int, default=100_000, help="Rows (v1) or chunks (v2) per parquet shard.")
    parser.add_argument("--docs-per-task", type=int, default=512, help="Documents per task sent to a worker.")
    parser.add_argument("--max-docs", type=int, default=None, help="Stop after this many documents.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    prepare(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
