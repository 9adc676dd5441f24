"""manifest.json covers every file it guards: a file it leaves out is refused, not loaded unchecked.

A DCP step (resumed by the trainer) and a model folder, each with one file's entry removed from its manifest
and a byte of that file flipped. See docs/checkpointing.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.torchrun_util import DEBUG_CONFIG, REPO_ROOT
from titan_recur.cli.train import main
from titan_recur.storage.manifest import MANIFEST_NAME, IntegrityError
from titan_recur.storage.model_io import WEIGHTS_NAME, load_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP reads here, no process group


def leave_out_and_flip(folder: Path, name: str) -> None:
    """Drop ``name``'s entry from the folder's manifest, then flip a byte of that file."""
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    del manifest["files"][name]
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (folder / name).write_bytes(bytes(data))


def test_a_step_whose_manifest_leaves_out_a_shard_is_refused_as_corrupt(tmp_path, capsys):
    """It resumed from the flipped shard with rc 0: the manifest turned that shard's check off."""
    dump = tmp_path / "run"
    argv = ["--config", DEBUG_CONFIG, "--job.dump_folder", str(dump), "--training.steps", "2"]
    argv += ["--checkpoint.interval", "1", "--validation.enable", "false", "--checkpoint.export_final", "false"]
    assert main(argv) == 0
    step = dump / "checkpoints" / "step-2"
    leave_out_and_flip(step, "__0_0.distcp")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {step / '__0_0.distcp'}: not listed in {MANIFEST_NAME} (its contents cannot be checked); resume "
        "from the newest verified checkpoint with --checkpoint.load_step 1, or set "
        "checkpoint.fallback_on_corruption = true\n"
    ), err


def test_a_model_folder_whose_manifest_leaves_out_its_weights_is_refused(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(REPO_ROOT / "assets" / "tiny_llama_recurrent", folder)
    leave_out_and_flip(folder, WEIGHTS_NAME)
    with pytest.raises(IntegrityError, match=f"{WEIGHTS_NAME}: not listed in {MANIFEST_NAME}"):
        load_model(folder)
