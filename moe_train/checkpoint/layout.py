"""The checkpoint folder on disk: `step-NNNNNNN/` folders, the `latest` pointer, atomic publishing, keep-K.

A checkpoint is written into `.tmp-step-NNNNNNN/`, renamed to `step-NNNNNNN/` when complete, and only then
named in `latest` (itself replaced atomically). A save killed at any point therefore leaves either the
previous `latest` or a `.tmp-*` folder nobody reads; readers trust `latest` and nothing else, and a folder is
complete only when DCP's `.metadata` (written last by DCP) is in it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from moe_train.atomic import write_atomic

LATEST = "latest"
_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"
MODEL_CONFIG = "model.json"


class CheckpointError(Exception):
    """A checkpoint the recipe asks for is missing or does not fit: bad input, exit code 2."""


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:07d}"


def tmp_dir(ckpt_dir: Path, step: int) -> Path:
    """The folder a save of `step` writes into before it is published."""
    return ckpt_dir / f"{_TMP_PREFIX}{step_dir_name(step)}"


def is_complete(path: Path) -> bool:
    """DCP writes `.metadata` after every shard, so its presence marks a finished save."""
    return (path / ".metadata").is_file()


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none (or it was removed by hand)."""
    pointer = ckpt_dir / LATEST
    if not pointer.is_file():
        return None
    path = ckpt_dir / pointer.read_text(encoding="utf-8").strip()
    return path if is_complete(path) else None


def publish(tmp: Path, *, step: int) -> Path:
    """Rename a finished `.tmp-` folder to its final name, then point `latest` at it."""
    final = tmp.parent / step_dir_name(step)
    if final.exists():  # the same step saved again (a resumed run re-reaching it): the new one wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_atomic(tmp.parent / LATEST, final.name + "\n")
    return final


def prune(ckpt_dir: Path, *, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (never the one `latest` names)."""
    if keep is None:
        return []
    latest = latest_checkpoint(ckpt_dir)
    steps = sorted(p for p in ckpt_dir.glob(f"{_PREFIX}*") if p.is_dir() and is_complete(p))
    removed = [p for p in steps[:-keep] if p != latest]
    for path in removed:
        shutil.rmtree(path)
    return removed
