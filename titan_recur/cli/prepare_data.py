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

While it writes, OUT holds an UNFINISHED file, removed last: the trainer refuses a folder that holds it (an
interrupted run: complete-looking shards that are only part of the data), and the same command redoes it.

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
import multiprocessing
import os
import re
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from titan_recur.cli.kit import BAD_INPUT, OneLineParser, run_command
from titan_recur.config import DATA_FORMATS, SAMPLE_BY, TEXT_SOURCE_KINDS, DataSource
from titan_recur.data.loader import (
    LABELS_COLUMN,
    TOKENS_COLUMN,
    TOKENS_FORMAT_V2,
    TOKENS_METADATA,
    TOKENS_UNFINISHED,
    check_text,
    encode_labelled,
    is_empty,
    open_source,
    read_documents,
)
from titan_recur.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_probe
from titan_recur.utils.limits import check_allocation, check_at_least

PROG = "titan-recur-prepare-data"
_tokenizer: Tokenizer | None = None


def _init_worker(folder: str) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(folder)


def _encoded_chunks(workers: int, tokenizer_folder: str, chunks: Iterator[list]) -> Iterator[tuple[np.ndarray, int]]:
    """``_encode_chunk`` of each chunk in worker processes, in order, at most two per worker in flight.

    concurrent.futures never replaces a worker: one whose initializer fails or that dies breaks the pool
    (BrokenProcessPool), which ends the command (multiprocessing.Pool respawned such workers forever).
    forkserver, not fork: a fork of a process with threads (torch's, the tokenizer's; a caller's) can
    inherit a lock another thread held and hang; measured under load when called in-process.
    """
    context = multiprocessing.get_context("forkserver")
    try:
        with ProcessPoolExecutor(workers, context, _init_worker, (tokenizer_folder,)) as pool:
            in_flight: deque[Future[tuple[np.ndarray, int]]] = deque()
            for chunk in chunks:
                in_flight.append(pool.submit(_encode_chunk, chunk))
                if len(in_flight) >= 2 * workers:
                    yield in_flight.popleft().result()
            while in_flight:
                yield in_flight.popleft().result()
    except BrokenProcessPool as err:
        raise BrokenProcessPool(f"a tokenizer worker process failed: {err}") from err


def _encode_chunk(docs: list) -> tuple[np.ndarray, int]:
    """The packed (2, tokens) stream of a chunk of documents, ids and labels (int32: cheap to send back), and its
    document count."""
    assert _tokenizer is not None  # the pool's initializer, _init_worker, loaded it
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
        "format": TOKENS_FORMAT_V2,
        "tokenizer_probe": tokenizer_probe(tokenizer),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "documents": "[BOS] doc EOS, concatenated",
        "tokens": tokens,
        "document_count": documents,
        "chunk_tokens": chunk_tokens,
    }
    (out / TOKENS_METADATA).write_text(json.dumps(meta, indent=2) + "\n")


class _Progress:
    """tqdm on a terminal when installed, else (a log file) a line every 10 s."""

    def __init__(self) -> None:
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(unit="tok", unit_scale=True, desc="tokens", file=sys.stderr)
            except ImportError:
                pass
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


def is_prepared_folder(folder: Path) -> bool:
    """A folder this tool wrote: only part-NNNNN.parquet shards, (v2) its metadata.json and, unfinished, its
    UNFINISHED marker."""
    names = [p.name for p in folder.iterdir()]
    own = (TOKENS_METADATA, TOKENS_UNFINISHED)
    return bool(names) and all(re.fullmatch(r"part-\d{5}\.parquet", n) or n in own for n in names)


def is_unfinished(out: Path) -> bool:
    """An output of this tool that was interrupted: redone without --force (nothing in it is worth keeping)."""
    return out.is_dir() and (out / TOKENS_UNFINISHED).exists() and is_prepared_folder(out)


def check_out_folder(out: Path, force: bool) -> None:
    """--out must be empty (or not exist) or an unfinished output of this tool; with --force it may hold an
    earlier output of this tool, nothing else."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()) or is_unfinished(out):
        return
    if not force:
        raise ValueError(f"--out {out} exists and is not empty; pass --force to replace an earlier prepare_data output")
    if not is_prepared_folder(out):
        raise ValueError(
            f"refusing to replace {out} with --force: it holds files prepare_data did not write "
            "(only part-NNNNN.parquet and metadata.json are its own)"
        )


def clear_own_output(out: Path) -> None:
    """Remove an earlier output (checked by ``check_out_folder``), so no stale shard survives a smaller rerun."""
    for path in out.iterdir():
        path.unlink()


def prepare(args: argparse.Namespace) -> None:
    kind = args.kind
    source = DataSource(
        name=args.path,
        path=args.path,
        kind=kind,
        text_field=args.text_field,
        hf_config=args.hf_config,
        split=args.split,
        sample_by=args.sample_by,
        format=args.data_format,
    )
    if args.data_format != "text" and kind == "text":
        raise ValueError("--format prompt_completion needs records: --kind jsonl, parquet or hf")
    for name in ("chunk_tokens", "workers", "rows_per_shard", "docs_per_task", "seq_len", "max_docs"):
        check_at_least(getattr(args, name), f"--{name.replace('_', '-')}")
    labels = args.data_format != "text"
    load_tokenizer(args.tokenizer)  # a missing or unreadable tokenizer: one line before any work
    out = Path(args.out)
    check_out_folder(out, args.force)
    stream = args.seq_len is None  # v2: a flat token stream, readable at any seq_len
    row_len = args.chunk_tokens if stream else args.seq_len + 1
    shard_tokens = args.rows_per_shard * row_len
    # A shard's ids and labels (int32) are gathered in memory before it is written.
    check_allocation(
        shard_tokens * 2 * 4,
        torch.device("cpu"),
        f"a shard of {args.rows_per_shard:,} rows x {row_len:,} tokens",
        hint="lower --rows-per-shard or --chunk-tokens",
    )
    if is_unfinished(out):
        print(f"{out}: an interrupted prepare_data output; redoing it")
    if out.is_dir():
        clear_own_output(out)
    out.mkdir(parents=True, exist_ok=True)
    # Removed last: until then the folder is refused by the trainer (its shards are only part of the data).
    (out / TOKENS_UNFINISHED).write_text("tools/prepare_data.py is writing this folder, or was interrupted\n")
    pending: list[np.ndarray] = []
    n_pending = shards = rows = documents = 0
    progress = _Progress()
    start = time.perf_counter()
    try:
        chunks = _chunks(source, args.docs_per_task, args.max_docs)
        for ids, docs in _encoded_chunks(args.workers, args.tokenizer, chunks):
            progress.update(ids.shape[1])
            pending.append(ids)
            n_pending += ids.shape[1]
            documents += docs
            while n_pending >= shard_tokens:
                flat = np.concatenate(pending, axis=1)
                _write_shard(flat[:, :shard_tokens], row_len, out / f"part-{shards:05d}.parquet", labels)
                pending, n_pending = [flat[:, shard_tokens:]], flat.shape[1] - shard_tokens
                shards, rows = shards + 1, rows + args.rows_per_shard
    finally:
        progress.close()
    flat = np.concatenate(pending, axis=1) if pending else np.zeros((2, 0), np.int32)
    kept = flat.shape[1] if stream else flat.shape[1] // row_len * row_len
    if kept:
        _write_shard(flat[:, :kept], row_len, out / f"part-{shards:05d}.parquet", labels)
        shards, rows = shards + 1, rows + -(-kept // row_len)
    if stream:
        _write_metadata(out, args.tokenizer, progress.total, documents, row_len)
    (out / TOKENS_UNFINISHED).unlink()
    seconds = time.perf_counter() - start
    layout = f"chunks of {row_len} tokens (v2 token stream)" if stream else f"rows of {row_len} tokens (v1)"
    print(
        f"{progress.total:,} tokens of {documents:,} documents -> {rows:,} {layout} in {shards} shards under {out} "
        f"({flat.shape[1] - kept} trailing tokens dropped); {seconds:.1f} s, "
        f"{progress.total / max(seconds, 1e-9):,.0f} tokens/s with {args.workers} workers"
    )


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="Folder with tokenizer.json or tokenizer.model.")
    parser.add_argument("--path", required=True, help="Local file or glob, or a hub dataset id (--kind hf).")
    parser.add_argument("--kind", choices=TEXT_SOURCE_KINDS, default="jsonl", help="Source format.")
    parser.add_argument("--text-field", default="text", help="Column or key holding the text.")
    parser.add_argument(
        "--format",
        dest="data_format",
        choices=DATA_FORMATS,
        default="text",
        help="'text' documents, or 'prompt_completion' records (fields prompt and completion): "
        "writes a labels column with -100 on the prompts (default: text).",
    )
    parser.add_argument("--hf-config", default=None, help="Hub dataset config name (--kind hf).")
    parser.add_argument("--split", default="train", help="Hub dataset split (--kind hf).")
    parser.add_argument(
        "--sample-by",
        choices=SAMPLE_BY,
        default="paragraph",
        help="--kind text: one document per blank-line-separated paragraph, per file, or per line.",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="v1: rows of exactly seq_len + 1 tokens for this seq_len (default: v2, a token stream)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=8192, help="v2: tokens per parquet row (default 8192)")
    parser.add_argument("--out", required=True, help="Empty output folder for part-NNNNN.parquet shards.")
    parser.add_argument(
        "--force",
        action="store_true",
        help="Replace an earlier output of this tool in --out (never a folder with other files).",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="Tokenizer processes (default: all cores).")
    parser.add_argument(
        "--rows-per-shard", type=int, default=100_000, help="Rows (v1) or chunks (v2) per parquet shard."
    )
    parser.add_argument("--docs-per-task", type=int, default=512, help="Documents per task sent to a worker.")
    parser.add_argument("--max-docs", type=int, default=None, help="Stop after this many documents.")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Any OSError (--out, unreadable data) is bad input here (exit 2); a failed tokenizer worker exit 1."""
    return run_command(PROG, lambda: prepare(parse_args(argv)), (*BAD_INPUT, OSError), (BrokenProcessPool,))


if __name__ == "__main__":
    sys.exit(main())
