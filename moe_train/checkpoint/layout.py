"""The checkpoint folder on disk: `step-NNNNNNN/` folders, the `latest` pointer, atomic publishing, keep-K.

A checkpoint is written into `.tmp-step-NNNNNNN/`, renamed to `step-NNNNNNN/` when complete, and only then
named in `latest` (itself replaced atomically). A save killed at any point therefore leaves either the
previous `latest` or a `.tmp-*` folder nobody reads; readers trust `latest` and nothing else, and a folder is
complete only when DCP's `.metadata` (written last by DCP) is in it.

Removing a checkpoint (pruning, or a step saved again) first renames it to `.tmp-removing-step-NNNNNNN/`, so a
process killed halfway through deleting it never leaves a half-deleted `step-*` folder that still looks
complete. A step saved again that `latest` names is unnamed first (`latest` moves to the newest earlier
checkpoint), so no kill leaves `latest` naming a folder that is gone: a resume would then start over silently.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from moe_train.atomic import write_atomic
from moe_train.run_files import LATEST

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


def named_checkpoint(ckpt_dir: Path) -> Path | None:
    """The folder `latest` names, complete or not; None without a `latest`."""
    pointer = ckpt_dir / LATEST
    return ckpt_dir / pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none (or it was removed by hand)."""
    path = named_checkpoint(ckpt_dir)
    return path if path is not None and is_complete(path) else None


def complete_steps(ckpt_dir: Path) -> list[Path]:
    """Every complete `step-*` folder, oldest first (the names sort by step)."""
    return sorted(p for p in ckpt_dir.glob(f"{_PREFIX}*") if p.is_dir() and is_complete(p))


def _removal_dir(path: Path) -> Path:
    return path.with_name(f"{_TMP_PREFIX}removing-{path.name}")


def _finish_removals(ckpt_dir: Path) -> None:
    """Delete what removals killed midway left behind (only rank 0 publishes and prunes, so none is running)."""
    for leftover in ckpt_dir.glob(f"{_TMP_PREFIX}removing-{_PREFIX}*"):
        shutil.rmtree(leftover)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: renamed out of the `step-*` names first, then deleted."""
    doomed = _removal_dir(path)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def publish(tmp: Path, *, step: int) -> Path:
    """Rename a finished `.tmp-` folder to its final name, then point `latest` at it."""
    ckpt_dir = tmp.parent
    final = ckpt_dir / step_dir_name(step)
    _finish_removals(ckpt_dir)
    if final.exists():  # the same step saved again (a resumed run re-reaching it): the new one wins
        if latest_checkpoint(ckpt_dir) == final:
            earlier = [p for p in complete_steps(ckpt_dir) if p.name < final.name]
            if earlier:
                write_atomic(ckpt_dir / LATEST, earlier[-1].name + "\n")
            else:
                (ckpt_dir / LATEST).unlink()
        _remove(final)
    os.replace(tmp, final)
    write_atomic(ckpt_dir / LATEST, final.name + "\n")
    return final


def prune(ckpt_dir: Path, *, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (never the one `latest` names)."""
    if keep is None:
        return []
    _finish_removals(ckpt_dir)
    latest = latest_checkpoint(ckpt_dir)
    removed = [p for p in complete_steps(ckpt_dir)[:-keep] if p != latest]
    for path in removed:
        _remove(path)
    return removed
