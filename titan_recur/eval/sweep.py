"""Offline validation-loss sweep over test recurrences: held-out batches in, JSON + PNG plot out."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from titan_recur.config import AttentionMask, Data, DataFormat, DataSource, load_config
from titan_recur.data.loader import LoaderGeometry, build_dataloader
from titan_recur.data.tokenizer import Tokenizer
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.model_io import write_files_atomically
from titan_recur.training.validation import mean_losses, validation_loss_sums
from titan_recur.utils.plots import figure_vs_r, save_figure
from titan_recur.utils.progress import progress

JSON_NAME = "validation_loss.json"
PLOT_NAME = "validation_loss.png"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_KINDS: dict[str, Literal["jsonl", "parquet"]] = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def data_source(path: str, text_field: str = "text", data_format: DataFormat = "text") -> Data:
    """A one-source data config for a held-out file (or glob): jsonl/json, parquet, else plain text;
    ``data_format`` 'prompt_completion': records whose loss is on the completion only."""
    kind: Literal["text", "jsonl", "parquet"] = _KINDS.get(Path(path).suffix, "text")
    return Data(
        sources=[DataSource(name=Path(path).name, path=path, kind=kind, text_field=text_field, format=data_format)]
    )


def rows_settings(
    config: str | None,
    batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
    ranks: int,
    data_batch_size: int,
    data_seq_len: int,
    attention_mask: AttentionMask | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The rows to evaluate (given values, else the config's in-loop validation geometry, else the --data
    defaults), and the config's in-loop validation settings to print beside them (None without a config).
    The attention mask likewise: given, else the config's training.attention_mask, else "causal"."""
    in_loop, config_mask = None, "causal"
    if config is not None:
        cfg = load_config(config)
        v, t = cfg.validation, cfg.training
        config_mask = t.attention_mask
        in_loop = {
            "enable": v.enable,
            "interval": v.interval,
            "batches": v.steps,
            "batch_size": t.local_batch_size,
            "seq_len": t.seq_len,
            "recurrences": list(v.recurrences),
        }
    defaults = in_loop or {"batches": None, "batch_size": data_batch_size, "seq_len": data_seq_len}
    settings = {
        "batches": batches if batches is not None else defaults["batches"],
        "batch_size": batch_size or defaults["batch_size"],
        "seq_len": seq_len or defaults["seq_len"],
        "data_ranks": ranks,
        "attention_mask": attention_mask or config_mask,
    }
    return settings, in_loop


def is_loss_report(path: Path) -> bool:
    """A file ``eval loss`` writes: its validation_loss.json (a report with per-r losses) or a PNG plot."""
    try:
        if path.suffix == ".png":
            return path.read_bytes()[:8] == PNG_MAGIC
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(report, dict) and {"loss", "effective_depth"} <= set(report)


def is_documents_file(path: Path) -> bool:
    """A file ``eval heldout`` writes: JSON lines of {"text"} or {"prompt", "completion"} records (or empty)."""
    try:
        with open(path) as f:
            first = f.readline()
        record = json.loads(first) if first.strip() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(record, dict) and set(record) in (set(), {"text"}, {"prompt", "completion"})


def write_documents(documents: Iterable[str | tuple[str, str]], out: str | Path, limit: int) -> int:
    """The first ``limit`` documents as jsonl ({"text": ...} per line, a record as {"prompt": ..., "completion":
    ...}), written atomically; returns the count."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0

    def write(path: Path) -> None:
        nonlocal count
        with open(path, "w") as f:
            for doc in itertools.islice(documents, limit):
                row = {"prompt": doc[0], "completion": doc[1]} if isinstance(doc, tuple) else {"text": doc}
                f.write(json.dumps(row) + "\n")
                count += 1

    write_files_atomically({out: write})
    return count


def heldout_batches(
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int | None,
    data: str | None = None,
    text_field: str = "text",
    config: str | None = None,
    ranks: int = 1,
    data_format: DataFormat = "text",
    attention_mask: AttentionMask = "causal",
) -> Iterator[dict[str, torch.Tensor]]:
    """Packed batches of ``data`` (every document), or of the validation split of a train config.

    The data is read once: a finite source ends the batches (the last row and batch may be short)
    instead of starting over. ``num_batches`` caps the batches per rank (None: all of them). With
    ``ranks`` = N the rows are those of the in-loop validation on N data-parallel ranks: rank 0's
    batches, then rank 1's, ... (each rank reads every N-th document). The validation split is the
    documents the trainer held out (``data.validation_fraction`` > 0, or ``[[data.validation_sources]]``),
    packed as in training from the config's final data mixture. ``attention_mask``: as
    training.attention_mask; "document" adds each row's document ids.
    """
    if (data is None) == (config is None):
        raise ValueError("give the held-out data: either --data PATH or --config TRAIN_TOML (its validation split)")
    if min(seq_len, batch_size, ranks, num_batches or 1) < 1:
        raise ValueError(
            f"seq_len, batch_size, batches and ranks must be >= 1, got {seq_len}, {batch_size}, {num_batches}, {ranks}"
        )
    if data is not None:
        data_cfg, split, seed = data_source(data, text_field, data_format), "train", 0
    else:
        cfg = load_config(config)
        data_cfg, split, seed = cfg.data, "validation", cfg.job.seed
    loaders = [
        build_dataloader(
            data_cfg,
            tokenizer,
            LoaderGeometry(seq_len, batch_size, dp_rank=rank, dp_world=ranks, seed=seed),
            split=split,
            single_pass=True,
            attention_mask=attention_mask,
        )
        for rank in range(ranks)
    ]
    return itertools.chain.from_iterable(itertools.islice(iter(loader), num_batches) for loader in loaders)


def loss_sweep(
    model: RecurrentLM,
    batches: Iterator[dict[str, torch.Tensor]],
    recurrences: Sequence[int],
    device: torch.device | str,
    state_init: str | None = None,
    num_batches: int | None = None,
) -> dict[str, Any]:
    """The report: loss per recurrence (token-weighted), token count, and the settings.

    ``num_batches``: the most ``batches`` yields (None: unknown), for the progress bar.
    """
    state_init = state_init or model.args.eval_state_init
    shown = progress(batches, desc=f"loss at r={','.join(map(str, recurrences))}", unit="batch", total=num_batches)
    counted = _Counted(shown)
    sums = validation_loss_sums(model, counted, recurrences, device, state_init)
    losses = mean_losses(sums)
    return {
        "recurrences": list(losses),
        "loss": {str(r): loss for r, loss in losses.items()},
        "tokens": next(iter(sums.values()))[1],
        "batches_read": counted.batches,
        "rows_read": counted.rows,
        "state_init": state_init,
        "effective_depth": {str(r): model.args.effective_depth(r) for r in losses},
    }


class _Counted:
    """Passes batches through, counting batches and rows."""

    def __init__(self, batches: Iterable[dict[str, torch.Tensor]]) -> None:
        self.source, self.batches, self.rows = batches, 0, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.source:
            self.batches += 1
            self.rows += batch["input_ids"].shape[0]
            yield batch


def plot_losses(losses: dict[int, float], path: Path, title: str) -> None:
    """Loss vs test recurrence on a log2 x axis."""
    save_figure(figure_vs_r({"loss": losses}, "validation loss", title), path)


def write_report(report: dict[str, Any], out: str | Path, title: str) -> tuple[Path, Path]:
    """Write validation_loss.json and validation_loss.png into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out / JSON_NAME, out / PLOT_NAME
    losses = {int(r): v for r, v in report["loss"].items()}
    write_files_atomically(
        {
            json_path: lambda path: path.write_text(json.dumps(report, indent=2) + "\n"),
            plot_path: lambda path: plot_losses(losses, path, title),
        }
    )
    return json_path, plot_path
