"""The run fingerprint: what it holds, and how a checkpoint written before a field existed compares."""

from __future__ import annotations

import pytest

from tests.tiny_models import tiny_args
from titan_recur.config import load_config
from titan_recur.training.fingerprint import FingerprintError, check_unchanged, run_fingerprint

BASE = ["--model.preset", "tinyllama-1.1b", "--model.shape", "4,8,4", "--model.init", "random"]


def fingerprint(*overrides: str) -> dict:
    cfg = load_config(None, [*BASE, *overrides])
    return run_fingerprint(cfg, tiny_args(), None, global_batch=8)


def test_the_attention_mask_is_part_of_the_fingerprint_and_may_change_only_when_allowed():
    causal, document = fingerprint(), fingerprint("--training.attention_mask", "document")
    with pytest.raises(FingerprintError, match="attention_mask 'causal' -> 'document'; .*allow_changes attention_mask"):
        check_unchanged(causal, document, [], "step-8")
    assert check_unchanged(causal, document, ["attention_mask"], "step-8") == ["attention_mask"]


def test_a_checkpoint_from_before_the_attention_mask_existed_resumes_as_causal():
    old = {k: v for k, v in fingerprint().items() if k != "attention_mask"}
    assert check_unchanged(old, fingerprint(), [], "step-8") == []
    with pytest.raises(FingerprintError, match="attention_mask 'causal' -> 'document'"):
        check_unchanged(old, fingerprint("--training.attention_mask", "document"), [], "step-8")
