"""Held-out loss at several test recurrences: the trainer's in-loop validation and the offline sweep.

Evaluation is deterministic: the recurrent state starts from zeros (``eval_state_init``), not from
the training-time random draw, so a row's loss depends neither on the RNG nor on the rest of its
batch. Zeros are the mean of the training distribution (std sqrt(2/(5d)), ~0.01 for d = 2048).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from titan_recur.models.args import ModelArgs

IGNORE_INDEX = -100


def eval_state_init(args: ModelArgs) -> str:
    """The state init used at evaluation: 'embed' models keep theirs (deterministic), others start from zeros."""
    return "embed" if args.state_init == "embed" else "zero"


def check_recurrences(recurrences: Sequence[int]) -> list[int]:
    """The recurrences as a list of positive ints, with a clear error otherwise."""
    bad = [r for r in recurrences if isinstance(r, bool) or not isinstance(r, int) or r < 1]
    if not recurrences or bad:
        raise ValueError(f"recurrences must be a non-empty list of integers >= 1, got {list(recurrences)}")
    return list(recurrences)


@torch.no_grad()
def validation_loss_sums(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    recurrences: Sequence[int],
    device: torch.device | str,
    state_init: str | None = None,
) -> dict[int, tuple[float, int]]:
    """Per-rank {r: (summed next-token CE, number of labelled tokens)} over ``batches``, read once.

    ``batches`` yield {"input_ids", "labels"} (labels already shifted, -100 ignored), as the data
    loader does. Works on a plain or FSDP-sharded model (every rank must call it: it only calls
    ``model(...)``); all-reduce the sums and counts across ranks, then ``mean_losses``.
    """
    recurrences = check_recurrences(recurrences)
    state_init = state_init or eval_state_init(model.args)
    sums = {r: torch.zeros((), dtype=torch.float64, device=device) for r in recurrences}
    tokens = 0
    for batch in batches:
        tokens += int((batch["labels"] != IGNORE_INDEX).sum())
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True).flatten()
        for r in recurrences:
            logits = model(input_ids, r, state_init=state_init)
            sums[r] += F.cross_entropy(
                logits.flatten(0, 1).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
            ).double()
    return {r: (float(total), tokens) for r, total in sums.items()}


def mean_losses(sums: dict[int, tuple[float, int]]) -> dict[int, float]:
    """Token-weighted mean loss per recurrence from (sum, count) pairs (after any all-reduce)."""
    if any(count <= 0 for _, count in sums.values()):
        raise ValueError("no labelled tokens in the validation batches")
    return {r: total / count for r, (total, count) in sums.items()}


def validation_losses(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    recurrences: Sequence[int],
    device: torch.device | str,
    state_init: str | None = None,
) -> dict[int, float]:
    """{r: token-weighted mean next-token CE} on this process's batches (no cross-rank reduction)."""
    return mean_losses(validation_loss_sums(model, batches, recurrences, device, state_init))
