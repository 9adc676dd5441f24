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


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The summed next-token loss of final-norm hidden states projected by the head ``weight``; chunk by chunk
    (never the full logits) when chunk_tokens > 0."""
    if chunk_tokens > 0:
        return chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens)
    return cross_entropy_sum(F.linear(hidden, weight), labels)


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """``cross_entropy_sum(hidden @ weight.T, labels)`` without ever holding the full logits.

    The head matmul and the loss run ``chunk_tokens`` tokens at a time in forward and again in
    backward, which writes each chunk's input gradient and adds its weight gradient into one buffer.
    Peak memory holds one chunk's logits and their gradient, instead of (tokens x vocab) of each: at
    Llama-3's vocabulary (128,256) and 8 x 1,024 tokens, 4 GiB of fp32 logits plus 4 GiB of gradient.
    Costs one extra head matmul per token (the recompute).
    """
    return _ChunkedHeadLoss.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk_tokens)


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        compute_dtype = hidden.dtype
        for rows in _chunks(hidden.shape[0], chunk):
            logits = F.linear(hidden[rows], weight)  # under autocast: its dtype, which backward reuses
            compute_dtype = logits.dtype
            total += cross_entropy_sum(logits, labels[rows])
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk, ctx.compute_dtype = chunk, compute_dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, labels = ctx.saved_tensors
        w = weight.to(ctx.compute_dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for rows in _chunks(hidden.shape[0], ctx.chunk):
            _backward_chunk(
                hidden[rows].to(ctx.compute_dtype), w, labels[rows], grad_total, rows, grad_hidden, grad_weight
            )
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None  # type: ignore[assignment]
        return grad_hidden, grad_weight, None, None


def _backward_chunk(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    grad_total: torch.Tensor,
    rows: slice,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor,
) -> None:
    """One chunk's gradients, written in place. A function so that its buffers are freed before the next chunk's
    are allocated (a loop body would keep one chunk's logits alive into the next)."""
    # d(sum of CE)/d(logits) = softmax - onehot(label) on labelled rows, 0 on ignored ones.
    grad_logits = F.linear(h, w).float()
    grad_logits = grad_logits.sub_(grad_logits.amax(dim=-1, keepdim=True)).exp_()  # softmax in place: one buffer
    grad_logits = grad_logits.div_(grad_logits.sum(dim=-1, keepdim=True))
    valid = labels != IGNORE_INDEX
    grad_logits[valid, labels[valid]] -= 1
    grad_logits[~valid] = 0
    grad_logits = grad_logits.mul_(grad_total).to(h.dtype)
    if grad_hidden is not None:
        grad_hidden[rows] = grad_logits @ w
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.T, h)  # no (vocab x dim) temporary
    else:
        grad_weight.add_(grad_logits.T @ h)  # low-precision product accumulated in fp32, no cast copy


def _chunks(total: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, total, size)]
