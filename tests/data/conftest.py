"""Fixtures of the data pipeline tests: one tiny BPE tokenizer per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data_util import build_bpe_tokenizer
from titan_recur.data.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tok_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of ``build_bpe_tokenizer``'s tokenizer, built once per session."""
    return build_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tok(tok_folder: Path):
    return load_tokenizer(tok_folder)
