"""The next-token loss: the chunked head + cross-entropy equals the plain one, in value and gradient."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import tiny_args, tiny_model
from titan_recur.models.loss import (
    IGNORE_INDEX,
    chunked_cross_entropy_sum,
    count_labels,
    cross_entropy_loss,
    cross_entropy_sum,
)


def test_sum_and_mean_agree_and_ignore_labels():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = IGNORE_INDEX
    assert int(count_labels(labels)) == 8
    torch.testing.assert_close(cross_entropy_sum(logits, labels) / 8, cross_entropy_loss(logits, labels))
    by_hand = -sum(
        torch.log_softmax(logits[b, t], -1)[labels[b, t]] for b in range(2) for t in range(5) if labels[b, t] >= 0
    )
    torch.testing.assert_close(cross_entropy_sum(logits, labels), by_hand, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_equals_plain_in_value_and_gradient(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(3, 17, 32, requires_grad=True)
    weight = torch.randn(101, 32, requires_grad=True)
    labels = torch.randint(0, 101, (3, 17))
    labels[1, 3:9] = IGNORE_INDEX
    plain = cross_entropy_sum(hidden @ weight.T, labels)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    chunked = chunked_cross_entropy_sum(hidden, weight, labels, chunk)
    chunked_grads = torch.autograd.grad(chunked, (hidden, weight))
    torch.testing.assert_close(chunked, plain, atol=1e-5, rtol=1e-6)
    for got, want in zip(chunked_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def count_saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves for backward (a tensor saved twice counts once)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(saved.values()), out


def test_chunked_loss_saves_no_logits():
    """What autograd keeps for backward: the plain loss holds the (tokens x vocab) logits, the chunked one none."""
    hidden = torch.randn(512, 16, requires_grad=True)
    weight = torch.randn(4096, 16, requires_grad=True)
    labels = torch.randint(0, 4096, (512,))
    logits_bytes = 512 * 4096 * 4
    plain, _ = count_saved_bytes(lambda: cross_entropy_sum(hidden @ weight.T, labels))
    chunked, _ = count_saved_bytes(lambda: chunked_cross_entropy_sum(hidden, weight, labels, 64))
    assert plain >= logits_bytes
    assert chunked < logits_bytes / 8


def peak_live_bytes(fn) -> int:
    """Peak bytes of live CPU tensors while fn runs, above those alive before it (torch.profiler's timeline)."""
    import json
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    totals = [sum(row) for row in sizes]
    return max(totals) - totals[0]


def test_chunked_backward_holds_one_weight_gradient_and_a_few_chunks():
    """Backward's transient memory: the weight gradient once plus one (chunk x vocab) buffer (no (vocab x dim)
    temporary per chunk, no chunk kept alive into the next); the plain loss needs several full (tokens x vocab)."""
    tokens, dim, vocab, chunk = 512, 64, 4096, 64
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    weight_bytes, chunk_logits_bytes = vocab * dim * 4, chunk * vocab * 4
    chunked = peak_live_bytes(lambda: chunked_cross_entropy_sum(hidden, weight, labels, chunk).backward())
    plain = peak_live_bytes(lambda: cross_entropy_sum(hidden @ weight.T, labels).backward())
    assert chunked <= weight_bytes + chunk_logits_bytes + 2 * hidden.numel() * 4, (chunked, weight_bytes)
    assert plain >= 2 * tokens * vocab * 4


@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_path_equals_logits_path(tie):
    model = tiny_model(tiny_args(97, adapter_init="random", tie_embeddings=tie), std=0.1)
    ids = torch.randint(0, 97, (2, 12))
    labels = torch.randint(0, 97, (2, 12))

    def loss_and_grads(**kwargs):
        model.zero_grad()
        loss = model(ids, (1, 2), state_init="zero", labels=labels, **kwargs)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    reference = cross_entropy_sum(model(ids, (1, 2), state_init="zero"), labels)
    reference.backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for kwargs in ({}, {"loss_chunk_tokens": 5}):
        loss, grads = loss_and_grads(**kwargs)
        torch.testing.assert_close(loss, reference.detach(), atol=1e-5, rtol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], atol=1e-5, rtol=1e-5, msg=name)
