"""Which checkpoint a run starts from: `checkpoint.resume` and `checkpoint.init_from` (docs/interfaces.md).

- resume `auto`: the newest intact checkpoint of the run's checkpoint folder, else a fresh start;
- resume `required`: the same, but no checkpoint is an error (a requeued job that lost its state must not
  silently start over; the batch script passes `--restart`, which sets it, to every requeued job);
- resume `never`: always fresh (existing checkpoints are overwritten as the run reaches their steps);
- resume PATH: that checkpoint folder, or a checkpoint folder's `latest`.
Resuming restores everything (weights, optimizer, step, data position). When nothing is resumed and
`init_from` names a model-only or full checkpoint, only its weights are loaded: fresh optimizer, step 0.

Every checkpoint is checked against its manifest (`verify`) before it is chosen. For auto and required the
candidates are the one `latest` names, then the older complete ones, newest first: a corrupt or partial one is
passed over, and the StartPoint's `notes` say which and why, for the log. When checkpoints exist but none is
intact, that is an error for auto too (starting over would silently overwrite a run that has history). A
checkpoint named by a path is used only when intact. Torch-free: `moe-train run` resolves the policy (with
sizes only) before it starts the ranks; the trainer decides through `collective.agreed_start_point`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moe_train.checkpoint.layout import (
    CheckpointError,
    complete_steps,
    is_complete,
    latest_checkpoint,
    named_checkpoint,
)
from moe_train.checkpoint.manifest import verify as verify_manifest

Verify = Callable[[Path], list[str]]


@dataclass(frozen=True, kw_only=True)
class StartPoint:
    """`resume_from`: a full checkpoint to continue (`own`: one of this run's, in its checkpoint folder);
    `init_from`: weights to start from; both None: fresh. `notes`: checkpoints passed over, and why."""

    resume_from: Path | None = None
    init_from: Path | None = None
    own: bool = False
    notes: tuple[str, ...] = ()


def checkpoint_at(path: Path, field: str) -> Path:
    """A complete checkpoint folder, or the one a checkpoints folder's `latest` names."""
    if is_complete(path):
        return path
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        raise CheckpointError(f"{field}: {path} is not a complete checkpoint (no .metadata, no 'latest')")
    return latest


def candidates(ckpt_dir: Path) -> list[Path]:
    """What a resume may continue from, best first: the checkpoint `latest` names, then every complete one
    older than the step `latest` names (all of them when there is no `latest`), newest first. Folders newer
    than `latest` were never published as the latest (a save killed between its rename and `latest`)."""
    named = named_checkpoint(ckpt_dir)
    older = [p for p in complete_steps(ckpt_dir) if named is None or p.name < named.name]
    return ([named] if named is not None and is_complete(named) else []) + older[::-1]


def intact_checkpoint_at(path: Path, field: str, verify: Verify = verify_manifest) -> Path:
    """`checkpoint_at(path, field)`, checked against its manifest: CheckpointError naming `field` otherwise."""
    path = checkpoint_at(path, field)
    problems = verify(path)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{field}: {path} is not intact: {problems[0]}{more}")
    return path


def start_point(*, ckpt_dir: Path, resume: str, init_from: str | None,
                verify: Verify = verify_manifest) -> StartPoint:
    """Resolve the recipe's resume policy against what is on disk; CheckpointError when it cannot be met.
    `verify(folder)` lists a checkpoint's problems (default: this process checks every checksum)."""
    if resume in ("auto", "required"):
        passed_over: list[str] = []
        for path in candidates(ckpt_dir):
            problems = verify(path)
            if not problems:
                notes = passed_over + ([f"resuming from {path.name}, the newest intact checkpoint"] if passed_over
                                       else [])
                return StartPoint(resume_from=path, own=True, notes=tuple(notes))
            passed_over.append(f"checkpoint {path} is not intact, not resumed from: " + "; ".join(problems[:3]))
        if passed_over:
            raise CheckpointError(f"checkpoint.resume: {resume}, but no checkpoint in {ckpt_dir} is intact ("
                                  f"{passed_over[0]}); restore one, or set checkpoint.resume: never to start over")
        if resume == "required":
            raise CheckpointError(f"checkpoint.resume: required, but {ckpt_dir} holds no complete checkpoint")
    elif resume != "never":
        path = intact_checkpoint_at(Path(resume), "checkpoint.resume", verify)
        return StartPoint(resume_from=path, own=path.resolve().parent == ckpt_dir.resolve())
    if init_from is not None:
        return StartPoint(init_from=intact_checkpoint_at(Path(init_from), "checkpoint.init_from", verify))
    return StartPoint()
