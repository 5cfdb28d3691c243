"""Which checkpoint a run starts from: `checkpoint.resume` and `checkpoint.init_from` (INTERFACES.md).

- resume `auto`: the latest complete checkpoint in the run's checkpoint folder, else a fresh start;
- resume `required`: the same, but no checkpoint is an error (a requeued job that lost its state must not
  silently start over);
- resume `never`: always fresh (existing checkpoints are overwritten as the run reaches their steps);
- resume PATH: that checkpoint folder, or a checkpoint folder's `latest`.
Resuming restores everything (weights, optimizer, step, data position). When nothing is resumed and
`init_from` names a model-only or full checkpoint, only its weights are loaded: fresh optimizer, step 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_train.checkpoint.layout import CheckpointError, is_complete, latest_checkpoint


@dataclass(frozen=True, kw_only=True)
class StartPoint:
    """`resume_from`: a full checkpoint to continue; `init_from`: weights to start from; both None: fresh."""

    resume_from: Path | None = None
    init_from: Path | None = None


def checkpoint_at(path: Path, field: str) -> Path:
    """A complete checkpoint folder, or the one a checkpoints folder's `latest` names."""
    if is_complete(path):
        return path
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        raise CheckpointError(f"{field}: {path} is not a complete checkpoint (no .metadata, no 'latest')")
    return latest


def start_point(*, ckpt_dir: Path, resume: str, init_from: str | None) -> StartPoint:
    """Resolve the recipe's resume policy against what is on disk; CheckpointError when it cannot be met."""
    if resume in ("auto", "required"):
        latest = latest_checkpoint(ckpt_dir)
        if latest is not None:
            return StartPoint(resume_from=latest)
        if resume == "required":
            raise CheckpointError(f"checkpoint.resume: required, but {ckpt_dir} holds no complete checkpoint")
    elif resume != "never":
        return StartPoint(resume_from=checkpoint_at(Path(resume), "checkpoint.resume"))
    if init_from is not None:
        return StartPoint(init_from=checkpoint_at(Path(init_from), "checkpoint.init_from"))
    return StartPoint()
