"""manifest.json: what kind of folder titan_recur wrote, and the size and checksum of each of its files.

Every writer puts it into its folder last, just before the folder appears by rename: a conversion
(tools/convert_hf.py), a run's final model, an HF export (tools/export_hf.py) and each DCP
checkpoint step. Readers check the files against it (a flipped byte, a truncated copy); tools that
replace a folder with ``--force`` replace only their own kind (:func:`folder_kind`).

Checksums are xxh3-128 (non-cryptographic: they detect corruption, not tampering), several times
faster than sha256 (``tools/bench_checkpoint.py`` measures both).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import xxhash

from titan_recur.storage.manifest_format import CHECKSUM, MANIFEST_NAME

# conversion: tools/convert_hf.py; trained: a run's final_model/; hf_export: tools/export_hf.py;
# checkpoint: a DCP step folder of a run.
FOLDER_KINDS = ("conversion", "trained", "hf_export", "checkpoint")
DCP_METADATA = ".metadata"
_CHUNK = 8 << 20


class IntegrityError(ValueError):
    """A file that does not match its folder's manifest; the message is one line naming the file."""


def file_checksum(path: Path) -> str:
    digest, buffer = xxhash.xxh3_128(), bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def describe_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {"bytes": size, CHECKSUM: digest}} of the given files of ``folder``."""
    return {name: {"bytes": (folder / name).stat().st_size, CHECKSUM: file_checksum(folder / name)} for name in names}


def write_manifest(folder: Path, kind: str, files: dict[str, dict[str, Any]], **fields: Any) -> None:
    """Write manifest.json (flushed to disk, so the rename that publishes the folder comes after it)."""
    if kind not in FOLDER_KINDS:
        raise ValueError(f"unknown folder kind {kind!r}; known: {FOLDER_KINDS}")
    text = json.dumps({"kind": kind, "checksum": CHECKSUM, **fields, "files": files}, indent=1) + "\n"
    with open(folder / MANIFEST_NAME, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def seal_folder(folder: Path, kind: str) -> None:
    """The manifest of every file in ``folder`` (a model folder, flat), written last."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    write_manifest(folder, kind, describe_files(folder, names))


def update_manifest_entry(folder: Path, name: str) -> None:
    """Record a file a titan_recur writer has just rewritten in the folder's manifest; no manifest: nothing."""
    manifest = read_manifest(folder)
    if manifest is not None:
        files = {**manifest.pop("files"), **describe_files(folder, [name])}
        write_manifest(folder, manifest.pop("kind"), files, **{k: v for k, v in manifest.items() if k != "checksum"})


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None when it has none; an unreadable one is an IntegrityError."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IntegrityError(f"{path}: unreadable manifest (truncated or corrupt?): {err}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise IntegrityError(f"{path}: not a titan_recur manifest (no 'files')")
    return manifest


def folder_kind(folder: Path) -> str | None:
    """What wrote ``folder``: its manifest's kind, "checkpoint" for any DCP folder, else None (unknown)."""
    try:
        manifest = read_manifest(folder)
    except IntegrityError:
        manifest = None
    if manifest is not None and manifest.get("kind") in FOLDER_KINDS:
        return manifest["kind"]
    return "checkpoint" if (Path(folder) / DCP_METADATA).is_file() else None


def check_files(folder: Path, files: dict[str, dict[str, Any]], names: list[str], checksums: bool) -> None:
    """Each named file is listed, exists with its recorded size (and, with ``checksums``, its recorded checksum).

    A file the manifest leaves out cannot be checked: it is refused like a corrupt one, never read unchecked.
    """
    for name in names:
        path, entry = Path(folder) / name, files.get(name)
        if entry is None:
            raise IntegrityError(f"{path}: not listed in {MANIFEST_NAME} (its contents cannot be checked)")
        if not path.is_file():
            raise IntegrityError(f"{path}: missing (listed in {MANIFEST_NAME})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            recorded = entry["bytes"]
            raise IntegrityError(f"{path}: {size} bytes, {MANIFEST_NAME} records {recorded} (truncated or corrupt)")
        if checksums and file_checksum(path) != entry[CHECKSUM]:
            raise IntegrityError(f"{path}: checksum mismatch with {MANIFEST_NAME} (corrupt file)")


def verify_folder(folder: Path, names: list[str]) -> None:
    """Check the named files of a model folder against its manifest, which must list each; no manifest: no check."""
    manifest = read_manifest(folder)
    if manifest is not None:
        check_files(folder, manifest["files"], names, checksums=True)
