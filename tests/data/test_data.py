"""Data pipeline: exact packing, mixture weights, phases, held-out split, exact resume, rank split, errors."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from tests.data_util import SEQ_LEN, full_rows, make_docs, resume_config, take, write_jsonl
from tests.torchrun_util import REPO_ROOT, WORKERS_DIR, run_torchrun
from titan_recur.cli import prepare_data
from titan_recur.config import Data, DataPhase, DataSource
from titan_recur.data.loader import LoaderGeometry, _dataset_states, build_dataloader, check_data_config
from titan_recur.data.tokenizer import check_vocab


def is_math(tok, row: list[int]) -> bool:
    """Rows never mix sources; a row of the upper-case source holds at least one upper-case letter."""
    return any(c.isupper() for c in tok.decode(row))


def loader(
    cfg: Data,
    tok,
    *,
    batch: int = 2,
    rows_per_step: int = 2,
    rank: int = 0,
    world: int = 1,
    split="train",
    seq_len: int = SEQ_LEN,
):
    return build_dataloader(cfg, tok, LoaderGeometry(seq_len, batch, rows_per_step, rank, world), split=split)


def packed_stream(tok, docs: list[str]) -> list[int]:
    return [t for d in docs for t in tok.encode(d, bos=True, eos=True)]


def doc_ids(tok, rows: torch.Tensor, prefix: str) -> set[int]:
    text = tok.decode(rows.flatten().tolist())
    return {int(m) for m in re.findall(rf"<s>{prefix}(\d+) ", text)}


def one_line_error(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_packing_is_exact_and_loops_over_epochs(tmp_path, tok):
    docs = make_docs("doc", 40)
    cfg = Data(sources=[DataSource(path=write_jsonl(tmp_path / "a.jsonl", docs), kind="jsonl")])
    stream = packed_stream(tok, docs)
    n_rows = 2 * len(stream) // (SEQ_LEN + 1) + 3  # two epochs and a bit: leftovers carry over
    rows = full_rows(take(loader(cfg, tok), n_rows // 2))
    assert rows.flatten().tolist() == (stream * 3)[: rows.numel()]


def test_text_paragraphs_and_globs(tmp_path, tok):
    docs = make_docs("doc", 30)
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text("\n\n".join(docs[i * 10 : (i + 1) * 10]))
    cfg = Data(sources=[DataSource(path=str(tmp_path / "part*.txt"), kind="text")])
    rows = full_rows(take(loader(cfg, tok), 20))
    assert rows.flatten().tolist() == packed_stream(tok, docs)[: rows.numel()]


def test_parquet_and_local_hf_folder_read_the_same_stream(tmp_path, tok):
    docs = make_docs("doc", 30)
    pq.write_table(pa.table({"body": docs}), tmp_path / "a.parquet")
    (tmp_path / "hub").mkdir()
    write_jsonl(tmp_path / "hub" / "train.jsonl", docs)
    expected = packed_stream(tok, docs)
    for source in [
        DataSource(path=str(tmp_path / "a.parquet"), kind="parquet", text_field="body"),
        DataSource(path=str(tmp_path / "hub"), kind="hf"),
    ]:
        rows = full_rows(take(loader(Data(sources=[source]), tok), 10))
        assert rows.flatten().tolist() == expected[: rows.numel()]


def test_pretokenized_rows_pass_through(tmp_path, tok):
    table = [[i * 10 + j for j in range(SEQ_LEN + 1)] for i in range(12)]
    pq.write_table(pa.table({"input_ids": table}), tmp_path / "rows.parquet")
    cfg = Data(sources=[DataSource(path=str(tmp_path / "*.parquet"), kind="tokenized")])
    check_data_config(cfg, tok, SEQ_LEN)
    assert full_rows(take(loader(cfg, tok), 6)).tolist() == table
    rank_rows = [full_rows(take(loader(cfg, tok, rank=r, world=2), 3)).tolist() for r in range(2)]
    assert sorted(rank_rows[0] + rank_rows[1]) == table


def test_workers_read_disjoint_documents(tmp_path, tok):
    n = 200
    cfg = Data(
        sources=[DataSource(path=write_jsonl(tmp_path / "a.jsonl", make_docs("doc", n)), kind="jsonl")], num_workers=2
    )
    batches = take(loader(cfg, tok), 40)  # workers yield whole batches in turn; < half an epoch each
    per_worker = [doc_ids(tok, full_rows(batches[w::2]), "doc") for w in range(2)]
    assert per_worker[0] and per_worker[1] and per_worker[0].isdisjoint(per_worker[1])


def test_mixture_weights_hold(tmp_path, tok):
    web = write_jsonl(tmp_path / "web.jsonl", make_docs("doc", 300))
    math = write_jsonl(tmp_path / "math.jsonl", make_docs("MATH", 300, seed=1))
    cfg = Data(
        sources=[
            DataSource(name="web", path=web, kind="jsonl", weight=3.0),
            DataSource(name="math", path=math, kind="jsonl", weight=1.0),
        ]
    )
    rows = full_rows(take(loader(cfg, tok, batch=50, rows_per_step=50), 200))
    assert rows.shape[0] == 10_000
    math_share = sum(is_math(tok, r) for r in rows.tolist()) / len(rows)
    assert abs(math_share - 0.25) < 0.02


def test_phases_switch_at_their_start_step(tmp_path, tok):
    web = DataSource(name="web", path=write_jsonl(tmp_path / "web.jsonl", make_docs("doc", 50)), kind="jsonl")
    math = DataSource(name="math", path=write_jsonl(tmp_path / "math.jsonl", make_docs("MATH", 50)), kind="jsonl")
    cfg = Data(phases=[DataPhase(0, [web]), DataPhase(3, [math]), DataPhase(5, [web, math])])
    # 2 rows per micro-batch, 2 micro-batches per step: steps 0-2 web, 3-4 math, 5+ both
    rows = full_rows(take(loader(cfg, tok, rows_per_step=4), 40)).tolist()
    per_step = [{is_math(tok, r) for r in rows[i : i + 4]} for i in range(0, len(rows), 4)]
    assert per_step[:5] == [{False}] * 3 + [{True}] * 2
    assert set().union(*per_step[5:]) == {True, False}
    # web continues where phase 0 left it instead of starting over
    web_docs = sorted(doc_ids(tok, torch.tensor([r for r in rows if not is_math(tok, r)]), "doc"))
    assert web_docs == list(range(len(web_docs)))


def test_validation_holds_out_disjoint_documents(tmp_path, tok):
    n = 200
    cfg = Data(
        sources=[DataSource(path=write_jsonl(tmp_path / "a.jsonl", make_docs("doc", n)), kind="jsonl")],
        validation_fraction=0.2,
    )
    train = doc_ids(tok, full_rows(take(loader(cfg, tok), 300)), "doc")
    val = doc_ids(tok, full_rows(take(loader(cfg, tok, split="validation"), 100)), "doc")
    assert train.isdisjoint(val) and train | val == set(range(n))
    assert 0.1 < len(val) / n < 0.3
    first = [b["input_ids"] for b in take(loader(cfg, tok, split="validation"), 3)]
    again = [b["input_ids"] for b in take(loader(cfg, tok, split="validation"), 3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))  # a fresh loader gives the same batches
    message = one_line_error(ValueError, loader, Data(sources=cfg.sources), tok, split="validation")
    assert "validation_fraction" in message


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_run_is_exact(tmp_path, tok, num_workers):
    cfg = resume_config(tmp_path, num_workers)
    reference = full_rows(take(loader(cfg, tok, rows_per_step=4), 250))  # crosses epochs and the phase switch
    dl = loader(cfg, tok, rows_per_step=4)
    it = iter(dl)
    head = full_rows([next(it) for _ in range(50)])
    state = dl.state_dict()
    resumed = loader(cfg, tok, rows_per_step=4)
    resumed.load_state_dict(state)
    tail = full_rows(take(resumed, 200))
    assert torch.equal(torch.cat([head, tail]), reference)


def test_document_masking_adds_document_ids_and_keeps_rows_and_state(tmp_path, tok):
    """Under training.attention_mask = "document" each batch also holds every token's document within its row (a
    new one after each EOS), in worker processes too; the rows, their order and the resumable state are causal
    training's."""
    cfg = resume_config(tmp_path, 2)
    geometry = LoaderGeometry(SEQ_LEN, 2, 4)
    causal, documents = (build_dataloader(cfg, tok, geometry, attention_mask=m) for m in ("causal", "document"))
    plain, masked = take(causal, 30), take(documents, 30)
    assert "document_ids" not in plain[0]
    assert torch.equal(full_rows(masked), full_rows(plain))
    states = list(_dataset_states(causal.state_dict()))
    assert len(states) == 2 and states == list(_dataset_states(documents.state_dict()))
    ids = torch.cat([b["input_ids"] for b in masked])
    docs = torch.cat([b["document_ids"] for b in masked])
    assert docs[:, 0].eq(0).all() and (docs.diff(dim=1) >= 0).all()
    after_eos = F.pad(ids[:, :-1] == tok.eos_id, (1, 0), value=False)
    assert torch.equal(F.pad(docs.diff(dim=1), (1, 0)).bool(), after_eos)
    assert after_eos.any()


def test_resharding_refuses_or_restarts(tmp_path, tok):
    cfg = resume_config(tmp_path, 0)
    dl = loader(cfg, tok, rows_per_step=4)
    take(dl, 30)  # 15 steps, 60 rows
    state = dl.state_dict()
    other = loader(cfg, tok, rows_per_step=4, world=2)
    message = one_line_error(ValueError, other.load_state_dict, state)
    assert "cannot be resharded" in message and "data.reshard" in message and "step 15" in message
    cfg.reshard = "restart"
    other = loader(cfg, tok, rows_per_step=4, world=2)
    other.load_state_dict(state)
    rows = full_rows(take(other, 20)).tolist()
    # still in the web-only phase until step 20 (rows 60-79 of the new numbering), then mixed
    assert not any(is_math(tok, r) for r in rows[:20]) and any(is_math(tok, r) for r in rows[20:])


def test_bad_inputs_fail_with_one_line(tmp_path, tok):
    good = write_jsonl(tmp_path / "good.jsonl", make_docs("doc", 5))

    def check(**source) -> str:
        cfg = Data(sources=[DataSource(**{"kind": "jsonl", **source})])
        return one_line_error((ValueError, FileNotFoundError), check_data_config, cfg, tok, SEQ_LEN)

    assert "no file matches" in check(path=str(tmp_path / "nope*.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    assert "empty dataset" in check(path=str(tmp_path / "empty.jsonl"))
    assert "field 'body' not found" in check(path=good, text_field="body")
    assert "positive" in check(path=good, weight=0.0)
    pq.write_table(pa.table({"input_ids": [[1] * (SEQ_LEN + 1), [1] * 5]}), tmp_path / "short.parquet")
    message = check(path=str(tmp_path / "short.parquet"), kind="tokenized")
    assert "short.parquet" in message and "5 tokens" in message and f"{SEQ_LEN + 1}" in message
    cfg = Data(sources=[DataSource(path=good, kind="jsonl")])
    assert "vocab mismatch" in one_line_error(ValueError, check_vocab, tok, 100)
    both = Data(sources=cfg.sources, phases=[DataPhase(0, cfg.sources)])
    assert "not both" in one_line_error(ValueError, check_data_config, both, tok, SEQ_LEN)
    late = Data(phases=[DataPhase(5, cfg.sources)])
    assert "step 0" in one_line_error(ValueError, check_data_config, late, tok, SEQ_LEN)
    assert "no training data" in one_line_error(ValueError, check_data_config, Data(), tok, SEQ_LEN)


def test_wrong_row_length_at_run_time(tmp_path, tok):
    pq.write_table(pa.table({"input_ids": [[1] * (SEQ_LEN + 1)] * 3 + [[1] * 4]}), tmp_path / "rows.parquet")
    cfg = Data(sources=[DataSource(name="pre", path=str(tmp_path / "rows.parquet"), kind="tokenized")])
    with pytest.raises(ValueError, match=r"'pre': pre-tokenized row of 4 tokens, expected seq_len \+ 1 = 9"):
        take(loader(cfg, tok), 2)


def test_prepare_data_matches_the_packed_stream(tmp_path, tok, tok_folder):
    docs = make_docs("doc", 120)
    source = write_jsonl(tmp_path / "a.jsonl", docs)
    out = tmp_path / "pre"
    prepare_data.prepare(
        prepare_data.parse_args(
            [
                "--tokenizer",
                str(tok_folder),
                "--path",
                source,
                "--kind",
                "jsonl",
                "--seq-len",
                str(SEQ_LEN),
                "--out",
                str(out),
                "--workers",
                "2",
                "--rows-per-shard",
                "50",
                "--docs-per-task",
                "16",
            ]
        )
    )
    shards = sorted(out.glob("*.parquet"))
    assert len(shards) > 1
    rows = [r for s in shards for r in pq.read_table(s)["input_ids"].to_pylist()]
    stream = packed_stream(tok, docs)
    assert len(rows) == len(stream) // (SEQ_LEN + 1)
    assert [t for r in rows for t in r] == stream[: len(rows) * (SEQ_LEN + 1)]
    cfg = Data(sources=[DataSource(path=str(out / "*.parquet"), kind="tokenized")])
    assert full_rows(take(loader(cfg, tok), 5)).tolist() == rows[:10]


@pytest.mark.parametrize("layout", [["--seq-len", str(SEQ_LEN)], ["--chunk-tokens", "37"]], ids=["v1", "v2"])
def test_an_interrupted_prepare_data_is_refused_and_redone(tmp_path, tok, tok_folder, monkeypatch, layout):
    """prepare_data killed after its first shard (a KeyboardInterrupt there): its shards look complete, and v1
    has no metadata to miss, so training took them for the whole dataset ('epoch done, looping', rc 0). The
    data check (train's, at start-up) refuses the folder in one line, and the same command redoes it."""
    from titan_recur.cli import prepare_data as cli

    source = write_jsonl(tmp_path / "a.jsonl", make_docs("doc", 120))
    args = ["--tokenizer", str(tok_folder), "--path", source, "--workers", "1", "--rows-per-shard", "20", *layout]
    out, whole = tmp_path / "pre", tmp_path / "whole"
    write_shard = cli._write_shard

    def killed_after_one_shard(*shard_args) -> None:
        write_shard(*shard_args)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_write_shard", killed_after_one_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.main([*args, "--out", str(out)])
    monkeypatch.undo()
    assert [p.name for p in out.glob("*.parquet")] == ["part-00000.parquet"]
    cfg = Data(sources=[DataSource(name="pre", path=str(out / "*.parquet"), kind="tokenized")])
    message = one_line_error(ValueError, check_data_config, cfg, tok, SEQ_LEN)
    assert f"'pre': {out} is an unfinished tools/prepare_data.py output" in message, message

    assert prepare_data.main([*args, "--out", str(out)]) == 0  # the same command, no --force
    assert prepare_data.main([*args, "--out", str(whole)]) == 0
    check_data_config(cfg, tok, SEQ_LEN)
    names = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names and len(names) > 2
    for name in names:
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name


def test_token_stream_v2_gives_the_on_the_fly_rows_at_any_seq_len(tmp_path, tok, tok_folder):
    """prepare_data without --seq-len writes a flat stream + metadata; the loader packs it at any seq_len into
    the rows it packs from the text itself."""
    docs = make_docs("doc", 120)
    source = write_jsonl(tmp_path / "a.jsonl", docs)
    out = tmp_path / "stream"
    prepare_data.prepare(
        prepare_data.parse_args(
            [
                "--tokenizer",
                str(tok_folder),
                "--path",
                source,
                "--kind",
                "jsonl",
                "--out",
                str(out),
                "--workers",
                "2",
                "--chunk-tokens",
                "37",
                "--rows-per-shard",
                "10",
                "--docs-per-task",
                "16",
            ]
        )
    )
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["tokens"] == len(packed_stream(tok, docs)) and meta["document_count"] == len(docs)
    assert meta["vocab_size"] == tok.vocab_size and len(sorted(out.glob("*.parquet"))) > 1
    text = Data(sources=[DataSource(path=source, kind="jsonl")], validation_fraction=0.0)
    stream = Data(sources=[DataSource(path=str(out / "*.parquet"), kind="tokenized")], validation_fraction=0.0)
    check_data_config(stream, tok, 13)
    for seq_len in (8, 13):
        expected, got = take(loader(text, tok, seq_len=seq_len), 6), take(loader(stream, tok, seq_len=seq_len), 6)
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_token_stream_of_another_tokenizer_is_one_line_at_start_up(tmp_path, tok_folder, capsys):
    source = write_jsonl(tmp_path / "a.jsonl", make_docs("doc", 20))
    out = tmp_path / "stream"
    prepare_data.prepare(
        prepare_data.parse_args(
            [
                "--tokenizer",
                str(tok_folder),
                "--path",
                source,
                "--kind",
                "jsonl",
                "--out",
                str(out),
                "--workers",
                "1",
            ]
        )
    )
    config = tmp_path / "run.toml"  # the bundled model's tokenizer is not the one the stream was made with
    config.write_text(
        f'[model]\npath = "{REPO_ROOT / "assets" / "tiny_llama_recurrent"}"\n[training]\nsteps = 1\n'
        f'[[data.sources]]\npath = "{out / "*.parquet"}"\nkind = "tokenized"\n'
    )
    from titan_recur.cli.train import main

    capsys.readouterr()
    assert main(["--config", str(config), "--job.dump_folder", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tokenized with another tokenizer" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_ranks_resume_exactly_and_never_share_documents(tmp_path, tok_folder):
    web = write_jsonl(tmp_path / "web.jsonl", make_docs("doc", 101))
    math = write_jsonl(tmp_path / "math.jsonl", make_docs("MATH", 57, seed=1))
    result = tmp_path / "result.json"
    args = ["--tokenizer", tok_folder, "--web", web, "--math", math, "--out", result]
    run_torchrun([WORKERS_DIR / "data_worker.py", *args], nproc=2)
    report = json.loads(result.read_text())
    assert report["resume_equal"] == [True, True]
    assert report["shared_docs"] == 0
    assert min(report["docs_per_rank"]) > 0
