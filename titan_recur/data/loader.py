"""Packed, mixed, phased, rank-split and exactly resumable training data.

``datasets`` only reads each source (streaming, one reader per rank x dataloader worker, split by
``split_dataset_by_node``); the mixture, the phases and the packing live in ``PackedDataset``, a
stateful ``IterableDataset`` whose state goes through torchdata's ``StatefulDataLoader``. We do
not use ``datasets.interleave_datasets`` or shuffle buffers: their resume is not exact.

Each source packs its own documents: ``[BOS] doc EOS`` (BOS where the tokenizer adds one)
concatenated and cut into rows of ``seq_len + 1`` tokens; the tokens left over after a row start
the source's next row, so nothing is dropped. Every token travels with its label: the token itself,
or IGNORE_INDEX where it carries no loss (the prompt of a ``prompt_completion`` record, a
pre-tokenized ``labels`` column's -100s), so packing and resume keep the loss mask. Row ``i`` of
a rank belongs to optimizer step ``i // rows_per_step``; the step picks the phase, and a generator seeded by (seed, rank, split, i)
picks the source, so the mixture and the phase switches need no signal from the trainer and
replay identically on resume. Documents whose content hash falls below
``data.validation_fraction`` are held out of training and form the validation split; or
``[[data.validation_sources]]`` name a validation split of their own, read whole.

Training streams loop over a source that runs out; evaluation reads a finite source exactly once
(``single_pass``): the last row of a source is padded (labels IGNORE_INDEX) and the iteration ends
once every source is exhausted.
"""

from __future__ import annotations

import bisect
import codecs
import functools
import glob
import hashlib
import json
import logging
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from titan_recur.config import AttentionMask, Data, DataSource, JobConfig
from titan_recur.data.tokenizer import Tokenizer, tokenizer_probe
from titan_recur.models.loss import IGNORE_INDEX

# `datasets` and `torchdata` are imported where a source is read or a loader built: what reads no data (the
# benchmarks' random batches) runs where they are not installed (a bare GPU machine).
if TYPE_CHECKING:
    import datasets
    from torchdata.stateful_dataloader import StatefulDataLoader

logger = logging.getLogger(__name__)

_BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet", "tokenized": "parquet"}
TOKENS_COLUMN = "input_ids"
LABELS_COLUMN = "labels"  # optional in pre-tokenized data: per-token labels, IGNORE_INDEX (-100) = no loss
_SPLITS = ("train", "validation")
_DOCS_PER_READ = 64  # documents per datasets batch (the resume point is the start of a batch)
_STATE_KEY = "titan_recur_packed_dataset"
# Start-up checks read at most this many documents of a source looking for a non-blank one, and at most
# _HELD_OUT_SCAN (or 50 / validation_fraction, whichever is less) looking for a held-out one.
_FIRST_DOC_SCAN = 10_000
_HELD_OUT_SCAN = 200_000


class DataError(ValueError):
    """Data that cannot be trained on, found while reading it; one line for the user."""


def _source_key(s: DataSource) -> str:
    """Sources that read the same stream share one reader across phases (a later phase continues it)."""
    key = f"{s.kind}:{s.path}:{s.hf_config}:{s.split}:{s.text_field}:{s.sample_by}"
    if s.revision is not None or s.data_files:  # appended only when set: older checkpoints keep their keys
        key += f":{s.revision}:{','.join(s.data_files)}"
    if s.format != "text":
        key += f":{s.format}:{s.prompt_field}:{s.completion_field}"
    return key


def _fields(s: DataSource) -> list[str]:
    """The columns a source's documents are read from (pre-tokenized labels are added when present)."""
    if s.kind == "tokenized":
        return [TOKENS_COLUMN]
    if s.format == "prompt_completion":
        return [s.prompt_field, s.completion_field]
    return [s.text_field]


def _documents(columns: dict[str, list], fields: list[str]) -> list:
    """A read batch as documents: a column's values, or tuples (prompt, completion) / (ids, labels)."""
    return list(columns[fields[0]]) if len(fields) == 1 else list(zip(*(columns[f] for f in fields), strict=True))


def read_documents(ds: datasets.IterableDataset, s: DataSource, batch_size: int) -> Iterator[list]:
    """An opened source's documents (open_source) in batches, in file order."""
    fields = _read_fields(s, ds)
    batches = ds.iter(batch_size=batch_size)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (ValueError, OSError) as err:  # a file that is not UTF-8, a bad JSON line further in
            raise read_error(s, err) from None
        yield _documents(batch, fields)


def _source_files(s: DataSource) -> list[str]:
    """The local files of a source (sorted glob); a pattern that matches nothing is an error."""
    files = sorted(f for f in glob.glob(os.path.expanduser(s.path), recursive=True) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(f"data source {s.name or s.path!r}: no file matches {s.path!r}")
    return files


# Pre-tokenized format v2: a flat token stream (shards of list<int32> chunks of any length, documents packed
# as [BOS] doc EOS) with this metadata file beside the shards; read at any seq_len. v1 (no metadata file):
# rows of exactly seq_len + 1 tokens.
TOKENS_METADATA = "metadata.json"
TOKENS_FORMAT_V2 = "titan_recur.tokens/v2"
# tools/prepare_data.py writes this file into its output folder before the first shard and removes it last: a
# folder that holds it was interrupted, and its shards (complete-looking, v1 without metadata) are part of the data.
TOKENS_UNFINISHED = "UNFINISHED"


def token_stream_metadata(s: DataSource) -> dict[str, Any] | None:
    """The v2 metadata of a pre-tokenized source (next to its first file), or None for v1 rows. Every opening of a
    pre-tokenized source passes here, so here a folder prepare_data did not finish is refused."""
    files = _source_files(s)
    for folder in sorted({Path(f).parent for f in files}):
        if (folder / TOKENS_UNFINISHED).exists():
            raise ValueError(
                f"data source {s.name or s.path!r}: {folder} is an unfinished tools/prepare_data.py output (it was "
                "interrupted, and its shards are only part of the data): rerun the same command, which redoes it"
            )
    path = Path(files[0]).parent / TOKENS_METADATA
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    if meta.get("format") != TOKENS_FORMAT_V2:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {TOKENS_FORMAT_V2!r}")
    return meta


def open_source(s: DataSource) -> datasets.IterableDataset:
    """A streaming ``datasets`` reader of one source, reduced to its text (or input_ids) column."""
    import datasets

    # An early-closed parquet stream otherwise sleeps 5 s in datasets' thread shutdown.
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    # The json builder logs every parse error on its own line; read_error() says it in ours.
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    try:
        if s.kind == "hf":
            try:
                ds = datasets.load_dataset(
                    s.path,
                    name=s.hf_config,
                    split=s.split,
                    streaming=True,
                    revision=s.revision,
                    data_files=s.data_files or None,
                )
            except (OSError, ValueError, FileNotFoundError) as err:  # offline, no such dataset, no such split
                raise ValueError(
                    f"data source {s.name or s.path!r} ({s.kind} {s.path}) cannot be read: "
                    f"{type(err).__name__}: {_first_line(err)}"
                ) from None
        else:
            kwargs = {"sample_by": s.sample_by} if s.kind == "text" else {}
            files = _source_files(s)
            ds = datasets.load_dataset(_BUILDERS[s.kind], data_files=files, split="train", streaming=True, **kwargs)
    except StopIteration:  # the json builder reads a first batch to infer the columns
        raise ValueError(f"data source {s.name or s.path!r}: empty dataset ({s.path})") from None
    fields = _fields(s)
    missing = [f for f in fields if ds.column_names is not None and f not in ds.column_names]
    if missing:
        raise ValueError(
            f"data source {s.name or s.path!r}: field {missing[0]!r} not found in {s.path} (columns: {ds.column_names})"
        )
    return ds.select_columns(_read_fields(s, ds))


def _read_fields(s: DataSource, ds: datasets.IterableDataset) -> list[str]:
    """_fields, plus a pre-tokenized source's labels column when it has one."""
    has_labels = s.kind == "tokenized" and LABELS_COLUMN in (ds.column_names or [])
    return _fields(s) + ([LABELS_COLUMN] if has_labels else [])


class SourceExhausted(Exception):
    """A single-pass source has no document left."""


def _content_bytes(doc: Any) -> bytes:
    if isinstance(doc, tuple):  # (prompt, completion) or (ids, labels)
        return b"\x00".join(_content_bytes(part) for part in doc)
    return doc.encode() if isinstance(doc, str) else np.asarray(doc, dtype=np.int64).tobytes()


def _held_out(doc: Any, fraction: float) -> bool:
    """Deterministic validation membership from the document's content (independent of ranks/workers)."""
    if fraction <= 0:
        return False
    data = _content_bytes(doc)
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return h < fraction * 2**64


def is_empty(doc: Any) -> bool:
    """Blank paragraphs/lines and missing fields are skipped: they would only add BOS/EOS. A prompt-completion
    record is never empty (check_text refuses one without its fields)."""
    return not isinstance(doc, tuple) and (doc is None or not doc.strip())


def check_text(doc: Any, s: DataSource) -> None:
    """A text field must hold strings (a number or a list would only fail later, inside the tokenizer); a
    prompt-completion record must have both fields."""
    if isinstance(doc, tuple):
        for name, value in zip((s.prompt_field, s.completion_field), doc, strict=True):
            if value is None:
                raise DataError(
                    f"data source {s.name or s.path!r}: a record without the {name!r} field "
                    f"(format 'prompt_completion' needs {s.prompt_field!r} and {s.completion_field!r})"
                )
            _check_string(value, name, s)
    elif doc is not None:
        _check_string(doc, s.text_field, s)


def _check_string(value: Any, field: str, s: DataSource) -> None:
    if not isinstance(value, str):
        raise DataError(
            f"data source {s.name or s.path!r}: field {field!r} holds {type(value).__name__} "
            f"{str(value)[:40]!r}, not text"
        )


def check_token_ids(row: list[int], vocab_size: int, where: str, labels: bool = False) -> None:
    """Pre-tokenized ids must be ids of this run's tokenizer (beyond the embedding they crash the step);
    ``labels`` may also hold IGNORE_INDEX."""
    row = [t for t in row if t != IGNORE_INDEX] if labels else row
    if not row:
        return
    low, high = min(row), max(row)
    if low < 0 or high >= vocab_size:
        what = "label" if labels else "token id"
        raise DataError(
            f"{where}: {what} {high if high >= vocab_size else low} outside the tokenizer's vocabulary "
            f"[0, {vocab_size}){' and not -100' if labels else ''} (prepared with another tokenizer?)"
        )


def read_error(s: DataSource, err: Exception) -> DataError:
    """One line for a source that cannot be read; a JSON error names the file and line."""
    where = None
    if isinstance(err, UnicodeDecodeError) and s.kind in ("text", "jsonl"):
        where = _bad_utf8_file(_source_files(s))
    elif s.kind == "jsonl":
        where = _bad_json_line(_source_files(s))
    return DataError(f"data source {s.name or s.path!r}: {where or f'{type(err).__name__}: {_first_line(err)}'}")


def _bad_utf8_file(files: list[str]) -> str | None:
    """'file: not UTF-8 text (byte 0x.. at offset N)' for the first of the files that does not decode."""
    for path in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(path, "rb") as f:
            while True:
                chunk, pending = f.read(1 << 20), len(decoder.getstate()[0])
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as err:
                    position = offset - pending + err.start
                    return f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {position})"
                if not chunk:
                    break
                offset += len(chunk)
    return None


def _bad_json_line(files: list[str]) -> str | None:
    """'file:line: invalid JSON (...)' for the first line of the files that is not a JSON document."""
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line.rstrip("\n"))
                except json.JSONDecodeError as err:
                    return f"{path}:{number}: invalid JSON ({err.msg}, column {err.colno})"
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def encode_document(tokenizer: Tokenizer, doc: str) -> list[int]:
    """A document as packed: BOS where the tokenizer adds one, the text, EOS."""
    return tokenizer.encode(doc, bos=tokenizer.add_bos, eos=True)


def encode_record(tokenizer: Tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """A prompt-completion record as packed, with its labels: [BOS] prompt completion EOS, where BOS and the
    prompt's tokens are IGNORE_INDEX. The two parts are tokenized apart, so the boundary is exact."""
    prompt_ids = tokenizer.encode(prompt, bos=tokenizer.add_bos, eos=False)
    completion_ids = tokenizer.encode(completion, bos=False, eos=True)
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def encode_labelled(tokenizer: Tokenizer, doc: str | tuple[str, str]) -> tuple[list[int], list[int]]:
    """Any text document or record as packed: (ids, labels); a plain document's labels are its ids."""
    if isinstance(doc, tuple):
        return encode_record(tokenizer, *doc)
    ids = encode_document(tokenizer, doc)
    return ids, ids


@dataclass(frozen=True)
class _Reader:
    """Which slice of every source this worker reads: documents split over rank x worker."""

    index: int
    count: int
    validation: bool
    validation_fraction: float  # 0: every document is this reader's (no hash split)
    single_pass: bool = False
    seed: int = 0  # of the sources' shuffle permutations

    def keeps(self, doc: str | list[int]) -> bool:
        return self.validation_fraction <= 0 or _held_out(doc, self.validation_fraction) == self.validation


class _SourceStream:
    """Packed rows of one source for one reader; loops over the source forever, counting epochs
    (or, single_pass, reads it once and then raises SourceExhausted)."""

    def __init__(self, source: DataSource, tokenizer: Tokenizer, seq_len: int, reader: _Reader):
        self.source, self.tokenizer, self.reader = source, tokenizer, reader
        self.row_len = seq_len + 1
        self.name = source.name or source.path
        from datasets.distributed import split_dataset_by_node

        self.ds = split_dataset_by_node(open_source(source), reader.index, reader.count)
        self.fields = _read_fields(source, self.ds)
        # v2 token streams are packed like text (chunks concatenated, cut into rows); v1 rows pass through.
        self.token_stream = source.kind == "tokenized" and token_stream_metadata(source) is not None
        self.epoch, self.epoch_docs = 0, 0
        self.window = -1  # index of the current batch in this epoch (seeds its shuffle permutation)
        self.batch_state: dict | None = None  # datasets state at the start of the current batch
        self.next_state: dict | None = None
        self.docs: list = []
        self.pos = 0
        self.buffer: list[int] = []
        # Only a source that can mask keeps a label per buffered token (IGNORE_INDEX: no loss); for the others
        # a row's labels are its tokens, and packing costs what it did before labels existed.
        self.masked = source.format == "prompt_completion" or LABELS_COLUMN in self.fields
        self.labels: list[int] = []
        self.offset = 0
        self.batches: Iterator[dict] | None = None

    def _open(self) -> None:
        self.ds.set_epoch(self.epoch)
        if self.batch_state is not None:
            self.ds.load_state_dict(self.batch_state)
        self.next_state = self.batch_state
        self.batches = self.ds.iter(batch_size=self.source.shuffle_buffer or _DOCS_PER_READ)

    def _fetch(self) -> None:
        """Read the next batch of documents, starting a new epoch at the end of the source."""
        if self.batches is None:
            self._open()
        batches = cast(Iterator[dict], self.batches)  # _open set it
        try:
            batch = next(batches)
        except (ValueError, OSError) as err:  # e.g. a JSON parse error further into a file
            raise read_error(self.source, err) from None
        except StopIteration:
            if self.epoch_docs == 0:
                split = "validation" if self.reader.validation else "train"
                raise DataError(
                    f"data source {self.name!r}: no {split} documents for reader {self.reader.index} of "
                    f"{self.reader.count} (empty dataset, or fewer documents/files than ranks x workers)"
                ) from None
            if self.reader.single_pass:
                raise SourceExhausted(self.name) from None
            logger.warning(f"data source {self.name!r}: epoch {self.epoch} done, looping over it again")
            self.epoch, self.epoch_docs, self.batch_state, self.window = self.epoch + 1, 0, None, -1
            self._open()
            return self._fetch()
        self.batch_state, self.next_state = self.next_state, self.ds.state_dict()
        self.docs, self.pos, self.window = self._shuffled(_documents(batch, self.fields)), 0, self.window + 1

    def _shuffled(self, docs: list) -> list:
        """The batch in its seeded order: a function of the seed, source, reader, epoch and batch index only,
        so a resumed run re-reads the batch its position is in and sees the same order."""
        if not self.source.shuffle_buffer:
            return docs
        name = int.from_bytes(hashlib.blake2b(_source_key(self.source).encode(), digest_size=8).digest(), "little")
        rng = np.random.default_rng([self.reader.seed, name, self.reader.index, self.epoch, self.window + 1])
        return [docs[i] for i in rng.permutation(len(docs))]

    def _next_doc(self) -> Any:
        while True:
            if self.pos >= len(self.docs):
                self._fetch()
            doc = self.docs[self.pos]
            self.pos += 1
            if self.source.kind != "tokenized":
                check_text(doc, self.source)
                if is_empty(doc):
                    continue
            if self.reader.keeps(doc):
                self.epoch_docs += 1
                return doc

    def next_row(self) -> tuple[list[int], list[int]]:
        """The next row of seq_len + 1 tokens and their labels."""
        if self.source.kind == "tokenized" and not self.token_stream:
            ids, labels = self._tokens(self._next_doc())
            if len(ids) != self.row_len:
                raise DataError(
                    f"data source {self.name!r}: pre-tokenized row of {len(ids)} tokens, expected "
                    f"seq_len + 1 = {self.row_len} (re-run tools/prepare_data.py with this seq_len)"
                )
            return ids, labels
        while len(self.buffer) - self.offset < self.row_len:
            try:
                doc = self._next_doc()
            except SourceExhausted:
                return self._last_row()
            ids, labels = self._tokens(doc)
            self.buffer = self.buffer[self.offset :] + ids
            if self.masked:
                self.labels = self.labels[self.offset :] + labels
            self.offset = 0
        end = self.offset + self.row_len
        row = self.buffer[self.offset : end]
        labels = self.labels[self.offset : end] if self.masked else row
        self.offset = end
        return row, labels

    def _tokens(self, doc: Any) -> tuple[list[int], list[int]]:
        """(ids, labels) of a document: encoded text, or pre-tokenized ids with their labels column if any."""
        if self.source.kind != "tokenized":
            return encode_labelled(self.tokenizer, doc)
        ids, labels = doc if isinstance(doc, tuple) else (doc, doc)
        where = f"data source {self.name!r}"
        if len(labels) != len(ids):
            raise DataError(f"{where}: a pre-tokenized row of {len(ids)} ids has {len(labels)} labels")
        check_token_ids(ids, self.tokenizer.vocab_size, where)
        if labels is not ids:
            check_token_ids(labels, self.tokenizer.vocab_size, f"{where} ({LABELS_COLUMN!r})", labels=True)
        return ids, labels

    def _last_row(self) -> tuple[list[int], list[int]]:
        """A single-pass source's leftover tokens, padded with IGNORE_INDEX (no loss, no label)."""
        rest = self.buffer[self.offset :]
        rest_labels = self.labels[self.offset :] if self.masked else rest
        self.buffer, self.labels, self.offset = [], [], 0
        if len(rest) < 2:  # nothing left that has a next token to predict
            raise SourceExhausted(self.name)
        padding = [IGNORE_INDEX] * (self.row_len - len(rest))
        return rest + padding, rest_labels + padding

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "epoch_docs": self.epoch_docs,
            "window": self.window,
            "batch_state": self.batch_state,
            "pos": self.pos,
            "buffer": self.buffer[self.offset :],
            # Only a source that can mask keeps labels: unmasked data keeps its checkpoints' size.
            "labels": self.labels[self.offset :] if self.masked else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.epoch_docs, self.batch_state = state["epoch"], state["epoch_docs"], state["batch_state"]
        self.buffer, self.offset = list(state["buffer"]), 0
        labels = state.get("labels")  # absent in checkpoints from before labels were kept: unmasked
        self.labels = list(self.buffer if labels is None else labels) if self.masked else []
        self.batches, self.docs, self.pos = None, [], 0
        self.window = state.get("window", 0) - 1 if state["pos"] else state.get("window", -1)
        if state["pos"]:  # re-read the batch the saved position is in
            self._fetch()
            self.pos = state["pos"]


@dataclass(frozen=True)
class _Phase:
    start_step: int
    keys: list[str]
    cum_weights: list[float]


def _phases(cfg: Data, split: str) -> list[tuple[int, list[DataSource]]]:
    """[(start_step, sources)]; validation uses [[data.validation_sources]], else the final mixture (the
    data the run ends on), from step 0."""
    if split == "validation" and cfg.validation_sources:
        return [(0, cfg.validation_sources)]
    if not (cfg.sources or cfg.phases):
        raise ValueError("no training data: set [[data.sources]] or [[data.phases]]")
    if cfg.sources and cfg.phases:
        raise ValueError("set either [[data.sources]] or [[data.phases]], not both")
    if cfg.phases and cfg.phases[0].start_step != 0:
        raise ValueError(f"the first of [[data.phases]] must start at step 0, got {cfg.phases[0].start_step}")
    phases = [(p.start_step, p.sources) for p in cfg.phases] or [(0, cfg.sources)]
    return [(0, phases[-1][1])] if split == "validation" else phases


@dataclass(frozen=True)
class LoaderGeometry:
    """How one data-parallel rank's rows are cut and which ones it reads: rows of ``seq_len`` (+ 1) tokens
    in batches of ``local_batch_size``; ``rows_per_step`` rows per optimizer step (local_batch_size x
    grad-accumulation steps; None = one batch), which select the data phase; the rank's place among
    ``dp_world`` and the shuffle seed."""

    seq_len: int
    local_batch_size: int
    rows_per_step: int | None = None
    dp_rank: int = 0
    dp_world: int = 1
    seed: int = 0

    @classmethod
    def of_run(cls, cfg: JobConfig, dp_rank: int, dp_world: int, grad_accum: int = 1) -> LoaderGeometry:
        """A training run's: its seq_len, batch and seed."""
        t = cfg.training
        return cls(t.seq_len, t.local_batch_size, t.local_batch_size * grad_accum, dp_rank, dp_world, cfg.job.seed)

    @property
    def step_rows(self) -> int:
        return self.local_batch_size if self.rows_per_step is None else self.rows_per_step


class PackedDataset(IterableDataset):
    """Rows of seq_len + 1 tokens: phases of weighted mixtures of packed sources, stateful for resume."""

    def __init__(
        self,
        cfg: Data,
        tokenizer: Tokenizer,
        geometry: LoaderGeometry,
        *,
        split: str = "train",
        single_pass: bool = False,
    ):
        seq_len, local_batch_size, rows_per_step = geometry.seq_len, geometry.local_batch_size, geometry.step_rows
        dp_rank, dp_world, seed = geometry.dp_rank, geometry.dp_world, geometry.seed
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        if split == "validation" and cfg.validation_fraction <= 0 and not cfg.validation_sources:
            raise ValueError(
                "split='validation' needs data.validation_fraction > 0 (documents held out of training) "
                "or [[data.validation_sources]]"
            )
        if rows_per_step % local_batch_size:
            raise ValueError(
                f"rows_per_step ({rows_per_step}) must be a multiple of local_batch_size ({local_batch_size})"
            )
        self.cfg, self.tokenizer, self.seq_len, self.split = cfg, tokenizer, seq_len, split
        self.single_pass = single_pass
        self.batch, self.rows_per_step = local_batch_size, rows_per_step
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.sources: dict[str, DataSource] = {}
        self.phases: list[_Phase] = []
        for start, sources in _phases(cfg, split):
            total = sum(s.weight for s in sources)
            if not sources or not total > 0:
                raise ValueError(f"data phase at step {start}: weights must sum to a positive number, got {total}")
            for s in sources:
                self.sources.setdefault(_source_key(s), s)
            cum = np.cumsum([s.weight / total for s in sources]).tolist()
            self.phases.append(_Phase(start, [_source_key(s) for s in sources], cum))
        self.starts = [p.start_step for p in self.phases]
        self.start_row = 0  # first row index (set when the data restarts after resharding)
        self.rows = 0  # rows yielded by this worker
        self.streams: dict[str, _SourceStream] = {}
        self._pending: dict[str, Any] | None = None

    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def _row_index(self, local: int) -> int:
        """Row index on this rank of this worker's ``local``-th row (workers yield whole batches in turn)."""
        worker, workers = self._worker()
        batch = (local // self.batch) * workers + worker
        return self.start_row + batch * self.batch + local % self.batch

    def _pick(self, row: int, exhausted: set[str]) -> str | None:
        """The source of ``row``; among the sources not yet exhausted (single pass), None when none is left."""
        step = row // self.rows_per_step
        phase = self.phases[bisect.bisect_right(self.starts, step) - 1]
        u = np.random.default_rng([self.seed, self.dp_rank, _SPLITS.index(self.split), row]).random()
        keys, cum = phase.keys, phase.cum_weights
        if exhausted:
            left = [(k, w) for k, w in zip(keys, np.diff([0.0, *cum]), strict=True) if k not in exhausted]
            if not left:
                return None
            keys = [k for k, _ in left]
            cum = np.cumsum([w for _, w in left]).tolist()
            cum = [c / cum[-1] for c in cum]
        return keys[min(bisect.bisect_right(cum, u), len(keys) - 1)]

    def _make_streams(self) -> None:
        worker, workers = self._worker()
        reader = _Reader(
            index=self.dp_rank * workers + worker,
            count=self.dp_world * workers,
            validation=self.split == "validation",
            # A dedicated validation split is read whole; the training split still skips the held-out hashes.
            validation_fraction=0.0
            if self.split == "validation" and self.cfg.validation_sources
            else self.cfg.validation_fraction,
            single_pass=self.single_pass,
            seed=self.seed,
        )
        self.streams = {k: _SourceStream(s, self.tokenizer, self.seq_len, reader) for k, s in self.sources.items()}
        if self._pending is not None:
            self.rows = self._pending["rows"]
            for key, state in self._pending["streams"].items():
                self.streams[key].load_state_dict(state)
            self._pending = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        if not self.streams or self._pending is not None:
            self._make_streams()
        exhausted: set[str] = set()
        while True:
            key = self._pick(self._row_index(self.rows), exhausted)
            if key is None:
                return
            try:
                row = self.streams[key].next_row()
            except SourceExhausted:
                exhausted.add(key)
                continue
            self.rows += 1
            ids, labels = row
            tokens = torch.tensor(ids, dtype=torch.long)
            # (2, seq_len + 1): tokens, labels
            yield torch.stack((tokens, tokens if labels is ids else torch.tensor(labels, dtype=torch.long)))

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            return self._pending
        return {
            _STATE_KEY: 1,
            "rows": self.rows,
            "streams": {k: s.state_dict() for k, s in self.streams.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the streams; those of sources the config no longer has are dropped (the trainer allows
        that only with checkpoint.allow_changes data), new sources start from their beginning."""
        removed = sorted(set(state["streams"]) - set(self.sources))
        if removed:
            logger.warning(f"data: dropping the positions of sources no longer configured: {removed}")
            state = {**state, "streams": {k: v for k, v in state["streams"].items() if k in self.sources}}
        self._pending = state


def _collate(rows: list[torch.Tensor], eos_id: int | None = None) -> dict[str, torch.Tensor]:
    """Inputs and shifted labels; padding (IGNORE_INDEX, the end of a single-pass source) feeds token 0.
    Given ``eos_id``, also each token's document (``document_ids``)."""
    batch = torch.stack(rows)
    input_ids = batch[:, 0, :-1].clamp(min=0)
    out = {"input_ids": input_ids, "labels": batch[:, 1, 1:].contiguous()}
    if eos_id is not None:
        out["document_ids"] = document_ids(input_ids, eos_id)
    return out


def document_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) index of each token's document within its row: every document is packed ending with EOS, so a
    new one starts after each EOS (torchtitan's block_causal rule). The part of a document that the row cut
    continues into the next row is that row's first document. Read from the tokens alone, so the loader's
    state and order are those of causal training."""
    ends = (input_ids == eos_id).long()
    return ends.cumsum(dim=-1) - ends


def _dataset_states(obj: Any) -> Iterator[dict]:
    """Every PackedDataset state nested in a StatefulDataLoader state (one per worker)."""
    if isinstance(obj, dict):
        if _STATE_KEY in obj:
            yield obj
        else:
            for value in obj.values():
                yield from _dataset_states(value)


@functools.cache
def _loader_class() -> type:
    """The run's loader class, built on the first loader: it subclasses torchdata's StatefulDataLoader."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    class DataLoader(StatefulDataLoader):
        """StatefulDataLoader whose state also records the data geometry, to detect resharding on resume."""

        def __init__(self, dataset: PackedDataset, num_workers: int, reshard: str, eos_id: int | None = None):
            with warnings.catch_warnings():  # torchdata calls torch.set_vital, which torch deprecates: not the user's
                warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
                super().__init__(
                    dataset,
                    batch_size=dataset.batch,
                    num_workers=num_workers,
                    collate_fn=functools.partial(_collate, eos_id=eos_id),
                    pin_memory=torch.cuda.is_available(),
                )
            self.reshard = reshard
            self.geometry = {
                "dp_world": dataset.dp_world,
                "num_workers": num_workers,
                "local_batch_size": dataset.batch,
                "rows_per_step": dataset.rows_per_step,
            }

        def state_dict(self) -> dict[str, Any]:
            return {"loader": super().state_dict(), "geometry": self.geometry}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            """Resume exactly; with another geometry, refuse or (data.reshard = 'restart') restart the streams."""
            if state["geometry"] == self.geometry:
                return super().load_state_dict(state["loader"])
            old, loader = state["geometry"], state["loader"]
            step = loader.get("_num_yielded", 0) * old["local_batch_size"] // old["rows_per_step"]
            if self.reshard != "restart":
                raise ValueError(
                    f"the data state was saved with {old}, this run has {self.geometry}: a data position cannot "
                    f"be resharded exactly; set data.reshard = 'restart' to restart the data streams at a new "
                    f"epoch from step {step}"
                )
            epochs = [s["epoch"] for d in _dataset_states(loader) for s in d["streams"].values()]
            self.restart(step, epoch=1 + max(epochs, default=0))

        def restart(self, step: int, epoch: int) -> None:
            """Start every source afresh at ``epoch`` (a deterministic new pass), with rows numbered from ``step``.

            For resuming on another geometry, where no exact position exists; the phases and the mixture
            stay aligned with the optimizer steps.
            """
            logger.warning(f"data: restarting every source at epoch {epoch} from step {step} ({self.geometry})")
            dataset = self.dataset
            dataset.start_row = step * dataset.rows_per_step
            fresh = {"epoch": epoch, "epoch_docs": 0, "batch_state": None, "pos": 0, "buffer": []}  # type: ignore[var-annotated]
            dataset.load_state_dict({_STATE_KEY: 1, "rows": 0, "streams": {k: dict(fresh) for k in dataset.sources}})
            super().load_state_dict({})

    return DataLoader


def build_dataloader(
    cfg_data: Data,
    tokenizer: Tokenizer,
    geometry: LoaderGeometry,
    *,
    split: str = "train",
    single_pass: bool = False,
    attention_mask: AttentionMask = "causal",
) -> StatefulDataLoader:
    """Batches {"input_ids", "labels"} of shape (local_batch_size, seq_len) for one data-parallel rank, with
    "document_ids" (``document_ids``) when ``attention_mask`` is "document".

    ``single_pass``: read every source once, then stop (evaluation); the last batch may have fewer rows.
    """
    dataset = PackedDataset(cfg_data, tokenizer, geometry, split=split, single_pass=single_pass)
    eos_id = tokenizer.eos_id if attention_mask == "document" else None
    return _loader_class()(dataset, num_workers=cfg_data.num_workers, reshard=cfg_data.reshard, eos_id=eos_id)


def heldout_documents(cfg: Data) -> Iterator[str | tuple[str, str]]:
    """The validation split's documents as text (or (prompt, completion) records), each once, alternating
    between its sources.

    The split is ``[[data.validation_sources]]`` (read whole) or, with ``validation_fraction`` > 0, the
    documents of the final mixture whose content hash is held out of training (about 1 / fraction
    documents read per document yielded).
    """
    if cfg.validation_fraction <= 0 and not cfg.validation_sources:
        raise ValueError(
            "the config has no validation split: set data.validation_fraction > 0 or [[data.validation_sources]]"
        )
    sources = _phases(cfg, "validation")[0][1]
    tokenized = [s.name or s.path for s in sources if s.kind == "tokenized"]
    if tokenized:
        raise ValueError(
            f"data source(s) {tokenized} hold pre-tokenized rows, not documents: "
            "evaluate them with `eval loss --config`"
        )
    reader = _Reader(
        0, 1, validation=True, validation_fraction=0.0 if cfg.validation_sources else cfg.validation_fraction
    )
    if len({s.format for s in sources}) > 1:
        raise ValueError(
            "the validation split mixes text documents and prompt-completion records: one file "
            "cannot hold both; evaluate them with `eval loss --config`"
        )
    streams = [_first_documents(s) for s in sources]
    while streams:
        for stream in list(streams):
            doc = next((d for d in stream if not is_empty(d) and reader.keeps(d)), None)
            if doc is None:
                streams.remove(stream)
            else:
                yield doc


def training_documents(cfg: Data) -> Iterator[str | tuple[str, str]]:
    """Every document training reads, source after source over all phases: the complement of
    ``heldout_documents``'s hash split (with ``[[data.validation_sources]]``, every training document). For
    checks that an evaluation set is disjoint from the training data (tools/make_math_task.py)."""
    reader = _Reader(
        0, 1, validation=False, validation_fraction=0.0 if cfg.validation_sources else cfg.validation_fraction
    )
    for _, sources in _phases(cfg, "train"):
        for source in sources:
            yield from (d for d in _first_documents(source) if not is_empty(d) and reader.keeps(d))


def _check_tokenized_files(s: DataSource, seq_len: int, tokenizer: Tokenizer) -> None:
    """v2: the stream's tokenizer is this run's. v1: row lengths. Both: the id range of the first row group of
    each file (cheap, catches a wrong seq_len or tokenizer)."""
    vocab_size = tokenizer.vocab_size
    meta = token_stream_metadata(s)
    if meta is not None and meta.get("tokenizer_probe") != tokenizer_probe(tokenizer):
        raise ValueError(
            f"data source {s.name or s.path!r}: tokenized with another tokenizer (vocab {meta.get('vocab_size')}, "
            f"probe {meta.get('tokenizer_probe')}; this run's: vocab {vocab_size}, probe {tokenizer_probe(tokenizer)}): "
            "re-run tools/prepare_data.py with this run's tokenizer"
        )
    for path in _source_files(s):
        f = pq.ParquetFile(path)
        if TOKENS_COLUMN not in f.schema_arrow.names:
            raise ValueError(f"{path}: no {TOKENS_COLUMN!r} column (columns: {f.schema_arrow.names})")
        if f.num_row_groups == 0:
            continue
        rows = f.read_row_group(0, columns=[TOKENS_COLUMN])[TOKENS_COLUMN]
        lengths = pc.unique(pc.list_value_length(rows))
        bad = [n for n in lengths.to_pylist() if n != seq_len + 1]
        if bad and meta is None:
            raise ValueError(f"{path}: pre-tokenized rows of {bad[0]} tokens, expected seq_len + 1 = {seq_len + 1}")
        ids = pc.min_max(pc.list_flatten(rows)).as_py()
        if ids["min"] is not None:
            check_token_ids([ids["min"], ids["max"]], vocab_size, path)


def _first_documents(s: DataSource) -> Iterator[Any]:
    """The documents of a source from its start; a source that cannot be read is one line."""
    name, fields = s.name or s.path, _fields(s)
    ds = open_source(s)
    read_fields = _read_fields(s, ds)
    rows = iter(ds)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except KeyError as err:  # select_columns on a missing column fails lazily
            raise ValueError(f"data source {name!r}: field {fields[0]!r} not found in {s.path} ({err})") from None
        except (ValueError, OSError) as err:
            raise read_error(s, err) from None
        missing = [f for f in fields if f not in row]
        if missing:
            raise ValueError(f"data source {name!r}: field {missing[0]!r} not found in {s.path}")
        yield _documents({f: [row.get(f)] for f in read_fields}, read_fields)[0]


def check_source(s: DataSource, tokenizer: Tokenizer, seq_len: int, held_out_fraction: float | None = None) -> int:
    """Open a source and read up to its first usable document (or row): missing files, empty or unreadable
    data, absent or non-text fields, and all-blank documents fail here; with ``held_out_fraction``, also a
    source without a held-out document (checked within a bound). Returns that document's token count, as
    packed."""
    name = s.name or s.path
    if s.kind == "tokenized":
        _check_tokenized_files(s, seq_len, tokenizer)
    first, seen = None, 0
    held_out_scan = 0 if held_out_fraction is None else min(_HELD_OUT_SCAN, math.ceil(50 / held_out_fraction))
    for seen, doc in enumerate(_first_documents(s), 1):
        if s.kind != "tokenized":
            check_text(doc, s)
        if s.kind == "tokenized" or not is_empty(doc):
            first = doc if first is None else first
            if held_out_fraction is None or _held_out(doc, held_out_fraction):
                return len(first) if s.kind == "tokenized" else len(encode_labelled(tokenizer, first)[0])
        if seen >= (held_out_scan if first is not None else _FIRST_DOC_SCAN):
            break
    if seen == 0:
        raise ValueError(f"data source {name!r}: empty dataset ({s.path})")
    if first is None:
        raise ValueError(f"data source {name!r}: the first {seen} documents are all blank ({s.path})")
    raise ValueError(
        f"data source {name!r}: no held-out document in its first {seen} documents (data.validation_fraction = "
        f"{held_out_fraction}): validation would have nothing to read"
    )


def check_phase_weights(cfg_data: Data) -> None:
    for start, sources in _phases(cfg_data, "train"):
        total = sum(s.weight for s in sources)
        if not total > 0:
            raise ValueError(f"data phase at step {start}: weights must sum to a positive number, got {total}")


def all_sources(cfg_data: Data) -> list[DataSource]:
    """Every distinct source the run reads: the training phases' and the validation sources."""
    sources = [s for _, phase in _phases(cfg_data, "train") for s in phase] + list(cfg_data.validation_sources)
    return list({_source_key(s): s for s in sources}.values())


def check_data_config(cfg_data: Data, tokenizer: Tokenizer, seq_len: int, validation: bool = False) -> None:
    """Fail before training, with one line, on data the run could not use (``validation``: also for it:
    a hash split needs a held-out document in each source of the final mixture)."""
    check_phase_weights(cfg_data)
    hash_split = validation and cfg_data.validation_fraction > 0 and not cfg_data.validation_sources
    held_out = {_source_key(s) for s in _phases(cfg_data, "validation")[0][1]} if hash_split else set()
    for s in all_sources(cfg_data):
        fraction = cfg_data.validation_fraction if _source_key(s) in held_out else None
        check_source(s, tokenizer, seq_len, fraction)
