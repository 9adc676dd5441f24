"""Document masking (training.attention_mask = "document"): a packed row computes what each of its documents
computes alone, through the recurrent core, activation checkpointing and compile.

The oracle is the same model run on each document alone (fp32, deterministic zero state init).
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import tiny_args, tiny_model
from titan_recur.data.loader import document_ids
from titan_recur.models import model as model_module
from titan_recur.models.model import RecurrentLM, document_positions
from titan_recur.training.parallelize import apply_activation_checkpointing, apply_compile

VOCAB = 97
EOS = 2
ATOL = 1e-5


def build() -> RecurrentLM:
    return tiny_model(tiny_args(VOCAB, max_seq_len=64, state_init="zero"))


def document(length: int, seed: int) -> torch.Tensor:
    """A document as packed: ``length`` tokens that are not EOS, then EOS."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(3, VOCAB, (length,), generator=g), torch.tensor([EOS])])


def packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One row (1, T) of whole documents, and the documents."""
    docs = [document(n, seed + i) for i, n in enumerate(lengths)]
    return torch.cat(docs)[None], docs


def per_token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token losses of each position that has a next token in its document (the EOS's target is the next
    document's first token, which a document alone does not have)."""
    return F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:], reduction="none")


def test_document_ids_start_after_each_eos() -> None:
    ids = torch.tensor([[5, EOS, 7, 8, EOS, EOS, 9], [EOS, 4, 4, 4, 4, 4, 4]])
    assert document_ids(ids, EOS).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert document_positions(document_ids(ids, EOS)).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("num_steps", [1, 4])
def test_packed_row_loss_equals_each_document_alone(num_steps: int) -> None:
    """Per token, to 1e-5; causal attention over the same row does not (the defect this switch removes)."""
    model = build().eval()
    row, docs = packed([5, 9, 3, 6])
    with torch.no_grad():
        masked = model(row, num_steps, document_ids=document_ids(row, EOS))
        causal = model(row, num_steps)
        start = 0
        for i, doc in enumerate(docs):
            alone = model(doc[None], num_steps)
            end = start + len(doc)
            torch.testing.assert_close(masked[:, start:end], alone, atol=ATOL, rtol=0)
            expected = per_token_losses(alone, doc[None])
            torch.testing.assert_close(
                per_token_losses(masked[:, start:end], row[:, start:end]), expected, atol=ATOL, rtol=0
            )
            if i > 0:
                assert not torch.allclose(causal[:, start:end], alone, atol=1e-3), "causal attention crossed documents"
            start = end


def test_training_forward_and_gradients_match_documents_alone_with_checkpointing() -> None:
    """A training forward (n no-grad + k grad iterations) under per-iteration checkpointing: the packed row's
    summed loss and its gradients are those of its documents run alone, summed."""
    model = build().train()
    apply_activation_checkpointing(model, "per_iteration")
    row, docs = packed([7, 4, 11])
    labels = torch.cat([row[:, 1:], torch.full((1, 1), -100)], dim=1)
    labels[0, torch.cumsum(torch.tensor([len(d) for d in docs]), 0) - 1] = -100  # each EOS: no next token alone
    loss = model(row, (2, 2), labels=labels, document_ids=document_ids(row, EOS))
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone_loss = sum(model(d[None, :-1], (2, 2), labels=d[None, 1:]) for d in docs)
    alone_loss.backward()
    torch.testing.assert_close(loss, alone_loss, atol=ATOL, rtol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, atol=ATOL, rtol=1e-5, msg=name)


def test_mask_is_built_once_per_forward_whatever_the_depth() -> None:
    model = build().eval()
    row, _ = packed([5, 9])
    built = mock.Mock(wraps=model_module.build_attention_mask)
    with mock.patch.object(model_module, "build_attention_mask", built), torch.no_grad():
        model(row, 8, document_ids=document_ids(row, EOS))
    assert built.call_count == 1


def test_document_ids_are_refused_with_a_cache() -> None:
    model = build().eval()
    row, _ = packed([5])
    with pytest.raises(ValueError, match="whole packed rows"):
        model.attention_context(row, None, None, model.new_cache(1, 16, 1), document_ids(row, EOS))


@pytest.mark.slow
def test_compiled_blocks_do_not_recompile_for_another_document_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parallelize recipe (checkpointing, then compile of each block and the core iteration): once a step
    has warmed the no-grad and grad graphs, rows with other document boundaries reuse them, and the loss
    equals eager's."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    eager, compiled = build().train(), build().train()
    for model in (eager, compiled):
        apply_activation_checkpointing(model, "per_iteration")
    apply_compile(compiled)
    layouts = [([5, 9, 3, 6], 0), ([2, 12, 10], 1), ([26], 2)]
    for i, (lengths, seed) in enumerate(layouts):
        row, _ = packed(lengths, seed)
        assert row.shape[1] == 27
        labels = torch.roll(row, -1, dims=1)
        losses = []
        for model in (eager, compiled):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                loss = model(row, (2, 2), labels=labels, document_ids=document_ids(row, EOS))
                loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=ATOL, rtol=1e-5)
