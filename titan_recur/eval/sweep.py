"""Offline validation-loss sweep over test recurrences: held-out batches in, JSON + PNG plot out."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from titan_recur.config import Data, DataSource, load_config
from titan_recur.data import build_dataloader
from titan_recur.eval.loss import mean_losses, validation_loss_sums
from titan_recur.models.model import RecurrentLM
from titan_recur.progress import progress
from titan_recur.tokenizer import Tokenizer

JSON_NAME = "validation_loss.json"
PLOT_NAME = "validation_loss.png"
_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def data_source(path: str, text_field: str = "text") -> Data:
    """A one-source data config for a held-out file (or glob): jsonl/json, parquet, else plain text."""
    kind = _KINDS.get(Path(path).suffix, "text")
    return Data(sources=[DataSource(name=Path(path).name, path=path, kind=kind, text_field=text_field)])


def heldout_batches(
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    data: str | None = None,
    text_field: str = "text",
    config: str | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """``num_batches`` packed batches: every document of ``data``, or the validation split of a train config.

    The validation split is the documents the trainer held out (``data.validation_fraction`` > 0),
    packed as in training from the config's final data mixture.
    """
    if (data is None) == (config is None):
        raise ValueError("give the held-out data: either --data PATH or --config TRAIN_TOML (its validation split)")
    if min(seq_len, batch_size, num_batches) < 1:
        raise ValueError(f"seq_len, batch_size and batches must be >= 1, got {seq_len}, {batch_size}, {num_batches}")
    if data is not None:
        data_cfg, split, seed = data_source(data, text_field), "train", 0
    else:
        cfg = load_config(config)
        data_cfg, split, seed = cfg.data, "validation", cfg.job.seed
    loader = build_dataloader(
        data_cfg, tokenizer, seq_len=seq_len, local_batch_size=batch_size, rows_per_step=batch_size,
        dp_rank=0, dp_world=1, seed=seed, split=split,
    )
    return itertools.islice(iter(loader), num_batches)


def loss_sweep(
    model: RecurrentLM,
    batches: Iterator[dict[str, torch.Tensor]],
    recurrences: Sequence[int],
    device: torch.device | str,
    state_init: str | None = None,
    num_batches: int | None = None,
) -> dict[str, Any]:
    """The report: loss per recurrence (token-weighted), token count, and the settings.

    ``num_batches``: how many ``batches`` yields, for the progress bar.
    """
    state_init = state_init or model.args.eval_state_init
    batches = progress(batches, desc=f"loss at r={','.join(map(str, recurrences))}", unit="batch", total=num_batches)
    sums = validation_loss_sums(model, batches, recurrences, device, state_init)
    losses = mean_losses(sums)
    return {
        "recurrences": list(losses),
        "loss": {str(r): loss for r, loss in losses.items()},
        "tokens": next(iter(sums.values()))[1],
        "state_init": state_init,
        "effective_depth": {str(r): model.args.effective_depth(r) for r in losses},
    }


def plot_losses(losses: dict[int, float], path: Path, title: str) -> None:
    """Loss vs test recurrence on a log2 x axis."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the loss plot needs matplotlib: pip install -e '.[eval]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    rs = sorted(losses)
    ax.plot(rs, [losses[r] for r in rs], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rs, [str(r) for r in rs])
    ax.set_xlabel("test recurrence r")
    ax.set_ylabel("validation loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(report: dict[str, Any], out: str | Path, title: str) -> tuple[Path, Path]:
    """Write validation_loss.json and validation_loss.png into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out / JSON_NAME, out / PLOT_NAME
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot_losses({int(r): v for r, v in report["loss"].items()}, plot_path, title)
    return json_path, plot_path
