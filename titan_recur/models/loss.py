"""The next-token loss: one definition for training, validation, evaluation and the HF export."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Label value that carries no loss (padding, the masked prefix of a packed row, ...).
IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the labels that are not IGNORE_INDEX, in fp32.

    Sums (not means) so micro-batches and ranks combine exactly: divide by ``count_labels`` totals.
    """
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def count_labels(labels: torch.Tensor) -> torch.Tensor:
    """How many labels carry loss."""
    return (labels != IGNORE_INDEX).sum()


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over valid (non-ignored) labels, in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
