"""metrics.enable_wandb: an offline W&B run holds the records of metrics.jsonl; a resumed run keeps its id.

The offline run is read back from its transaction log (run-<id>.wandb), the LevelDB-style record
log W&B writes and `wandb sync` uploads: 32 KiB blocks of chunks with a 7-byte header (crc32c,
length, type), each record a wandb_internal_pb2.Record protobuf. The reader below is written from
that format, not taken from titan_recur.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as wandb_pb2

from tests.torchrun_util import REPO_ROOT
from titan_recur.cli.train import main
from titan_recur.training.metrics import WANDB_ID_FILE

DEBUG_CONFIG = str(REPO_ROOT / "train_configs" / "debug_model.toml")
BLOCK, CHUNK_HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator:
    """The protobuf records of a .wandb transaction log, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""  # 4-byte magic, 2-byte version magic, 1-byte version
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        chunk, pos = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length], pos + CHUNK_HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_pb2.Record()
            record.ParseFromString(pending)
            yield record


def offline_runs(dump: Path) -> list[tuple[str, list]]:
    """(run id, records) of each offline run under the dump folder, oldest first."""
    runs = sorted((dump / "wandb").glob("offline-run-*"))
    return [(run.name.rsplit("-", 1)[1], list(wandb_records(next(run.glob("*.wandb"))))) for run in runs]


def history(records: list) -> list[dict]:
    """The logged rows, without W&B's own keys (_step, _runtime, _timestamp)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def as_logged(line: dict) -> dict:
    """A metrics.jsonl record as the scalar sinks log it: numbers only, sections as 'section/key'."""
    return {k.replace(".", "/"): v for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def train(dump: Path, steps: int, *extra: str) -> None:
    """One trainer process's run, in this process (the W&B run is finished when it returns)."""
    argv = [
        *extra,
        "--config",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--checkpoint.interval",
        "2",
        "--metrics.log_freq",
        "1",
        "--validation.interval",
        "2",
        "--validation.recurrences",
        "1,2",
        "--validation.steps",
        "1",
        "--checkpoint.export_final",
        "false",
        "--metrics.enable_wandb",
        "--metrics.wandb_mode",
        "offline",
        "--metrics.wandb_tags",
        "ci,tiny",
    ]
    assert main(argv) == 0


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch) -> None:
    """No credentials and W&B's own folders in tmp: nothing can reach the network or the home folder."""
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    (tmp_path / "netrc").write_text("")
    for key, value in dict(
        WANDB_CONFIG_DIR="wandb_config", WANDB_CACHE_DIR="wandb_cache", WANDB_DATA_DIR="wandb_data", NETRC="netrc"
    ).items():
        monkeypatch.setenv(key, str(tmp_path / value))


def test_offline_run_matches_metrics_jsonl_and_resume_keeps_the_run(tmp_path, wandb_env):
    dump = tmp_path / "run"
    train(dump, steps=2)
    run_id = (dump / WANDB_ID_FILE).read_text().strip()
    train(dump, 3, "--checkpoint.allow_changes", "steps")  # resumes from the step-2 checkpoint
    assert (dump / WANDB_ID_FILE).read_text().strip() == run_id

    runs = offline_runs(dump)
    assert [rid for rid, _ in runs] == [run_id, run_id]  # the resumed process continued the same run
    for _, records in runs:
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (run.run_id, run.project, run.display_name, list(run.tags)) == (
            run_id,
            "titan_recur",
            "run",
            ["ci", "tiny"],
        )
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["job"]["dump_folder"] == str(dump) and config["metrics"]["enable_wandb"] is True

    lines = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    logged = [row for _, records in runs for row in history(records)]
    assert logged == [as_logged(line) for line in lines]
    steps = [(row["step"], "validation/loss_r1" in row) for row in logged]
    assert steps == [(1, False), (2, False), (2, True), (3, False), (3, True)]
    assert {"loss", "grad_norm", "lr", "tokens_per_sec", "max_memory"} <= logged[0].keys()
    assert "mfu" not in logged[0]  # null on CPU without metrics.peak_flops: not a number, not logged


def test_missing_wandb_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    dump = tmp_path / "run"
    code = main(["--config", DEBUG_CONFIG, "--job.dump_folder", str(dump), "--metrics.enable_wandb"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "metrics.enable_wandb = true needs wandb: pip install 'titan_recur[wandb]'" in err
    assert not dump.exists()


def test_wandb_refusal_is_one_line(tmp_path, capsys, monkeypatch, wandb_env):
    """Online without credentials: W&B refuses at start-up, the trainer exits 2 with its reason."""
    monkeypatch.setenv("WANDB_MODE", "online")
    dump = tmp_path / "run"
    code = main(
        [
            "--config",
            DEBUG_CONFIG,
            "--job.dump_folder",
            str(dump),
            "--metrics.enable_wandb",
            "--checkpoint.export_final",
            "false",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: metrics.enable_wandb: wandb.init failed: ") and "wandb login" in err
    assert not (dump / WANDB_ID_FILE).exists() and not (dump / "metrics.jsonl").exists()
