"""data.sources.N.shuffle_buffer: each window of documents in a seeded order, the same on resume."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from test_data import SEQ_LEN, full_rows, make_docs, resume_config, take, tok, tok_folder, write_jsonl  # noqa: F401

from titan_recur.config import ConfigError, Data, DataSource, config_from_dict, validate
from titan_recur.data import build_dataloader

DOCS, WINDOW = 40, 8


def read_once(cfg: Data, tok, seed: int, rows_per_step: int = 2):
    return build_dataloader(cfg, tok, seq_len=SEQ_LEN, local_batch_size=2, rows_per_step=rows_per_step,
                            dp_rank=0, dp_world=1, seed=seed, single_pass=True)


def doc_order(tok, cfg: Data, seed: int) -> list[int]:
    """The document ids in the order one pass over the source packs them."""
    text = tok.decode(full_rows(list(read_once(cfg, tok, seed))).flatten().tolist())
    return [int(i) for i in re.findall(r"<s>doc(\d+) ", text)]


def test_shuffle_permutes_each_window_by_the_seed(tmp_path, tok):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs("doc", DOCS))
    in_order = Data(sources=[DataSource(path=path, kind="jsonl")])
    shuffled = Data(sources=[DataSource(path=path, kind="jsonl", shuffle_buffer=WINDOW)])
    assert doc_order(tok, in_order, seed=0) == list(range(DOCS))
    orders = [doc_order(tok, shuffled, seed) for seed in (0, 0, 1)]
    assert orders[0] == orders[1]  # seeded: the same order on every read
    assert orders[0] != orders[2]  # another job.seed, another order
    for order in orders:
        assert order != list(range(DOCS))
        windows = [order[i : i + WINDOW] for i in range(0, DOCS, WINDOW)]
        assert [sorted(w) for w in windows] == [list(range(i, i + WINDOW)) for i in range(0, DOCS, WINDOW)]


def test_resume_mid_window_is_exact_with_shuffling(tmp_path, tok):
    cfg = resume_config(tmp_path, 0)
    cfg.phases = [dataclasses.replace(p, sources=[dataclasses.replace(s, shuffle_buffer=7) for s in p.sources])
                  for p in cfg.phases]

    def train_loader():
        return build_dataloader(cfg, tok, seq_len=SEQ_LEN, local_batch_size=2, rows_per_step=4,
                                dp_rank=0, dp_world=1, seed=0)

    reference = full_rows(take(train_loader(), 120))  # crosses epochs, windows and the phase switch
    dl = train_loader()
    it = iter(dl)
    head = full_rows([next(it) for _ in range(23)])
    state = dl.state_dict()
    resumed = train_loader()
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([head, full_rows(take(resumed, 97))]), reference)


def test_negative_shuffle_buffer_is_refused():
    cfg = config_from_dict({"model": {"path": "m"}, "data": {"sources": [{"path": "a.jsonl", "shuffle_buffer": -1}]}})
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == "invalid config: [data.sources][0] shuffle_buffer must be >= 0, got -1"
