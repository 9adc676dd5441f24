"""Adaptive exit's criteria (inference/exit_criteria.py): one registry of classes, each criterion's rule,
buffers updated in place. The engine and the fast path run every criterion in test_engine.py and
test_decode_program.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tiny_models import tiny_args
from titan_recur.inference.exit_criteria import (
    DEFAULT_EXIT_THRESHOLDS,
    EXIT_CRITERIA,
    EXIT_CRITERION_CLASSES,
    ArgmaxCriterion,
    EntropyDiffCriterion,
    ExitCriterion,
    KLCriterion,
    LatentDiffCriterion,
    describe_criteria,
    describe_default_thresholds,
)
from titan_recur.inference.options import GenerationOptions

BSZ, VOCAB = 3, 7


def test_the_registry_is_the_one_list_of_criteria() -> None:
    assert EXIT_CRITERIA == tuple(EXIT_CRITERION_CLASSES) == ("kl", "latent-diff", "entropy-diff", "argmax")
    assert set(EXIT_CRITERION_CLASSES.values()) == set(ExitCriterion.__subclasses__())
    described = describe_default_thresholds()
    for name, criterion in EXIT_CRITERION_CLASSES.items():
        assert criterion.name == name and issubclass(criterion, ExitCriterion)
        assert DEFAULT_EXIT_THRESHOLDS[name] == criterion.default_threshold
        assert f"{name} {criterion.default_threshold:g}" in described
    # Huginn's defaults.
    assert DEFAULT_EXIT_THRESHOLDS == {"kl": 1e-3, "latent-diff": 0.03, "entropy-diff": 1e-3, "argmax": 5.0}
    assert describe_default_thresholds() == "kl 0.001, latent-diff 0.03, entropy-diff 0.001, argmax 5"
    assert describe_criteria("|", "`") == "`kl`|`latent-diff`|`entropy-diff`|`argmax`"


def test_options_take_the_criteria_and_their_defaults_from_the_registry() -> None:
    args = tiny_args(VOCAB, mean_recurrence=4)
    for name, criterion in EXIT_CRITERION_CLASSES.items():
        assert GenerationOptions(exit_criterion=name).resolve(args).exit.threshold == criterion.default_threshold
    with pytest.raises(ValueError, match=f"exit_criterion must be one of {', '.join(EXIT_CRITERIA)}, got 'nope'"):
        GenerationOptions(exit_criterion="nope").resolve(args)


@pytest.mark.parametrize("name", EXIT_CRITERIA)
def test_create_builds_the_named_class_with_buffers_updated_in_place(name: str) -> None:
    initial = torch.randn(BSZ, 4, 8)
    criterion = ExitCriterion.create(name, 0.5, initial, VOCAB)
    assert type(criterion) is EXIT_CRITERION_CLASSES[name] and criterion.threshold == 0.5
    assert criterion.needs_logits == (name != "latent-diff")
    buffers = {k: (v, v.data_ptr()) for k, v in vars(criterion).items() if isinstance(v, torch.Tensor)}
    before = {k: v.clone() for k, (v, _) in buffers.items()}
    state = initial
    for _ in range(3):
        state = state + torch.randn_like(state)
        exits = criterion.exits(state, torch.randn(BSZ, VOCAB))
        assert exits.shape == (BSZ,) and exits.dtype == torch.bool
    criterion.reset(initial)
    for key, (buffer, pointer) in buffers.items():  # the same tensors (a captured graph reads them), reset
        assert getattr(criterion, key) is buffer and buffer.data_ptr() == pointer
        torch.testing.assert_close(buffer, before[key], rtol=0, atol=0)


def test_kl_compares_with_the_previous_check_uniform_at_first() -> None:
    criterion = KLCriterion(1e-3, torch.zeros(BSZ, 2, 4), VOCAB)
    assert torch.equal(criterion.previous, torch.full((BSZ, VOCAB), -math.log(VOCAB)))
    flat, peaked = torch.zeros(BSZ, VOCAB), torch.zeros(BSZ, VOCAB)
    peaked[:, 0] = 5.0
    assert criterion.exits(torch.zeros(BSZ, 2, 4), flat).all()  # uniform after uniform: KL 0
    assert not criterion.exits(torch.zeros(BSZ, 2, 4), peaked).any()
    assert criterion.exits(torch.zeros(BSZ, 2, 4), peaked).all()


def test_latent_diff_is_the_relative_change_of_the_last_position() -> None:
    initial = torch.ones(BSZ, 2, 4)
    criterion = LatentDiffCriterion(0.1, initial, VOCAB)
    state = initial.clone()
    state[:, -1] *= torch.tensor([1.0, 1.05, 2.0])[:, None]  # relative changes 0, 0.05 / 1.05, 0.5
    assert criterion.exits(state, None).tolist() == [True, True, False]
    state[:, 0] += 10  # other positions do not count
    assert criterion.exits(state, None).all()


def test_entropy_diff_never_exits_at_the_first_check() -> None:
    criterion = EntropyDiffCriterion(1e-3, torch.zeros(BSZ, 1, 4), VOCAB)
    logits = torch.randn(BSZ, VOCAB)
    assert not criterion.exits(torch.zeros(BSZ, 1, 4), logits).any()
    assert criterion.exits(torch.zeros(BSZ, 1, 4), logits + 3.0).all()  # the same distribution


def test_argmax_exits_once_stable_for_threshold_checks() -> None:
    state = torch.zeros(2, 1, 4)
    criterion = ArgmaxCriterion(2.0, state, VOCAB)
    same, other = torch.eye(VOCAB)[[0, 0]], torch.eye(VOCAB)[[0, 1]]
    assert criterion.exits(state, same).tolist() == [False, False]  # the first check: no previous argmax
    assert criterion.exits(state, same).tolist() == [False, False]  # stable for 1 check
    assert criterion.exits(state, other).tolist() == [True, False]  # 2; row 1's argmax changed
    assert criterion.stable.tolist() == [2, 0]
