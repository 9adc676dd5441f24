"""The next-token loss: one definition for training, validation, evaluation and the HF export."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """``cross_entropy_sum(hidden @ weight.T, labels)`` without ever holding the full logits.

    The head matmul and the loss run ``chunk_tokens`` tokens at a time, and each chunk is recomputed
    in backward instead of saved, so peak memory holds one chunk's logits (fp32 + grad) rather than
    (B, T, V) of them: at Llama-3's vocabulary (128,256) and 8 x 1,024 tokens that is 4 GiB of fp32
    logits alone. Costs one extra head matmul per token in backward.
    """
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total = total + checkpoint(_head_loss_sum, hidden[rows], weight, labels[rows], use_reentrant=False)
    return total


def _head_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_sum(F.linear(hidden, weight), labels)
