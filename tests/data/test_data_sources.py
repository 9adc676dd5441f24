"""Source options: shuffle_buffer (each window of documents in a seeded order, the same on resume);
data_files and revision for hub sources."""

from __future__ import annotations

import dataclasses
import re

import datasets
import pytest
import torch

from tests.data_util import SEQ_LEN, full_rows, make_docs, resume_config, take, write_jsonl
from titan_recur.config import ConfigError, Data, DataSource, config_from_dict, validate
from titan_recur.data.loader import LoaderGeometry, build_dataloader, open_source

DOCS, WINDOW = 40, 8


def read_once(cfg: Data, tok, seed: int, rows_per_step: int = 2):
    return build_dataloader(cfg, tok, LoaderGeometry(SEQ_LEN, 2, rows_per_step, seed=seed), single_pass=True)


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
    cfg.phases = [
        dataclasses.replace(p, sources=[dataclasses.replace(s, shuffle_buffer=7) for s in p.sources])
        for p in cfg.phases
    ]

    def train_loader():
        return build_dataloader(cfg, tok, LoaderGeometry(SEQ_LEN, 2, rows_per_step=4))

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


def test_hub_data_files_read_only_those_files(tmp_path, tok):
    hub = tmp_path / "hub"
    (hub / "extra").mkdir(parents=True)
    write_jsonl(hub / "train.jsonl", make_docs("doc", 10))
    write_jsonl(hub / "extra" / "more.jsonl", make_docs("MORE", 6))
    whole = [row["text"] for row in open_source(DataSource(path=str(hub), kind="hf"))]
    subset = [row["text"] for row in open_source(DataSource(path=str(hub), kind="hf", data_files=["extra/*.jsonl"]))]
    assert subset == make_docs("MORE", 6) and whole == make_docs("doc", 10)  # the default: the config's split files


def test_hub_revision_reaches_the_hub_reader(monkeypatch):
    """The revision is datasets' own argument (a hub download cannot run in the tests)."""
    calls = []
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda *args, **kwargs: (
            calls.append((args, kwargs)) or datasets.IterableDataset.from_generator(lambda: iter([{"text": "x"}]))
        ),
    )
    open_source(DataSource(path="org/set", kind="hf", hf_config="c", revision="v1.0", data_files=["a/*.parquet"]))
    assert calls == [
        (("org/set",), dict(name="c", split="train", streaming=True, revision="v1.0", data_files=["a/*.parquet"]))
    ]


def test_local_sources_refuse_hub_options():
    cfg = config_from_dict(
        {"model": {"path": "m"}, "data": {"sources": [{"path": "a.jsonl", "kind": "jsonl", "revision": "v1"}]}}
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "revision and data_files are for kind = 'hf'" in str(err.value)
