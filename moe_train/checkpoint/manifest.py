"""Checkpoint integrity: `manifest.json` lists every file of a checkpoint folder with its size and SHA-256.

A save writes it last into its temporary folder (after DCP's shards, DCP's `.metadata` and model.json), before the
folder is published, so a published checkpoint always has one. Loading checks it before reading anything else of
the checkpoint: a damaged `.metadata` (a pickle) must never reach an unpickler, and a truncated or corrupted shard
must be reported, not loaded. A folder without a manifest is not intact (a save that did not finish, or files
not written by moe-train).

Checking is split into pieces so that many ranks can share it (moe_train/checkpoint/collective.py): `share`
deals the files out by size, `check` compares any subset with the manifest. Torch-free: `moe-train run` checks
sizes on the login side before it starts the ranks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from moe_train.atomic import write_atomic

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 16 * 2**20


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint folder (its name within the folder), as the save wrote it."""

    name: str
    bytes: int
    sha256: str


def listing(folder: Path) -> list[tuple[str, int]]:
    """(name, size) of every file a save put in `folder`, the manifest and atomic-writer temporaries aside."""
    return sorted(
        (p.name, p.stat().st_size) for p in folder.iterdir()
        if p.is_file() and p.name != MANIFEST and not (p.name.startswith(".") and p.name.endswith(".tmp"))
    )


def share(items: list[tuple[str, int]], rank: int, world: int) -> list[str]:
    """The names `rank` of `world` ranks hashes: largest files first, each to the least loaded rank (ties to the
    lowest rank), so every rank computes the same deal from the same list and the bytes spread evenly."""
    loads = [0] * world
    mine = []
    for name, size in sorted(items, key=lambda item: (-item[1], item[0])):
        owner = loads.index(min(loads))
        loads[owner] += size
        if owner == rank:
            mine.append(name)
    return mine


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as stream:
        while count := stream.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def entries_for(folder: Path, names: list[str]) -> list[FileEntry]:
    """Sizes and checksums of `names` in `folder`, read now."""
    return [FileEntry(name=name, bytes=(folder / name).stat().st_size, sha256=sha256_of(folder / name))
            for name in names]


def write_manifest(folder: Path, entries: list[FileEntry]) -> None:
    files = {e.name: {"bytes": e.bytes, "sha256": e.sha256} for e in sorted(entries, key=lambda e: e.name)}
    write_atomic(folder / MANIFEST, json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n")


class ManifestError(Exception):
    """A manifest that is missing or unreadable: the checkpoint cannot be checked, so it is not intact."""


def read_manifest(folder: Path) -> list[FileEntry]:
    path = folder / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path}: missing (a save that did not finish, or not a moe-train checkpoint)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            raise ManifestError(f"{path}: format {data.get('format')!r}, this moe-train reads format {FORMAT}")
        return [FileEntry(name=name, bytes=int(f["bytes"]), sha256=str(f["sha256"]))
                for name, f in data["files"].items()]
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(f"{path}: unreadable ({type(error).__name__}: {error})") from None


def check(folder: Path, entries: list[FileEntry], *, checksums: bool = True) -> list[str]:
    """One line per file of `entries` that is missing, of another size or (with `checksums`) other content."""
    problems = []
    for entry in entries:
        path = folder / entry.name
        if not path.is_file():
            problems.append(f"{path}: missing (listed in {MANIFEST})")
        elif (size := path.stat().st_size) != entry.bytes:
            problems.append(f"{path}: {size} bytes, {MANIFEST} says {entry.bytes} (truncated or partly copied)")
        elif checksums and sha256_of(path) != entry.sha256:
            problems.append(f"{path}: SHA-256 differs from {MANIFEST} (corrupted)")
    return problems


def verify(folder: Path, *, checksums: bool = True) -> list[str]:
    """Every problem of the checkpoint in `folder` (empty: intact), checked by this process alone."""
    try:
        entries = read_manifest(folder)
    except ManifestError as error:
        return [str(error)]
    return check(folder, entries, checksums=checksums)


def sizes_only(folder: Path) -> list[str]:
    """`verify` without checksums: cheap enough for the login side (a stat per file)."""
    return verify(folder, checksums=False)
