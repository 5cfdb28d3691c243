"""The checkpoint steps every rank of a job takes together: the manifest's checksums, shared out over the ranks,
and the choice of the checkpoint to start from, made by one rank and broadcast.

Hashing a checkpoint is reading all of it once; dealt out by size (`manifest.share`), each rank reads about
1/world of it, in parallel, at save and at load. The start point (`resume.start_point`, which may pass over a
corrupt checkpoint for an older intact one) is decided by rank 0 alone, so no two ranks can pick different
checkpoints from what they each see on a shared file system; the other ranks only help it check each candidate
and then receive its decision. Without a process group (or with one rank) everything runs in this process.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from moe_train.checkpoint import manifest
from moe_train.checkpoint.layout import CheckpointError
from moe_train.checkpoint.resume import StartPoint, start_point


def distributed() -> bool:
    """Whether a process group exists (without one, everything runs in this process)."""
    return dist.is_available() and dist.is_initialized()


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def rank() -> int:
    return _world()[0]


def barrier() -> None:
    if distributed():
        dist.barrier()


def _broadcast(value=None, group=None):
    """Rank 0's `value` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _gathered(items: list, group=None) -> list:
    """Every rank's `items`, concatenated in rank order, on every rank."""
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, items, group=group)
    return [item for box in boxes for item in box]


def write_manifest(folder: Path, group=None) -> None:
    """Hash the files a save put in `folder` (each rank its share) and have rank 0 write the manifest.
    Every rank calls this after the save's files are all on disk. `group`: a process group of every rank
    (default: the default group; a background save passes its own, so it never mixes with training's)."""
    rank, world = _world()
    if world == 1:
        manifest.write_manifest(folder, manifest.entries_for(folder, [name for name, _ in manifest.listing(folder)]))
        return
    items = _broadcast(manifest.listing(folder) if rank == 0 else None, group)
    entries = _gathered(manifest.entries_for(folder, manifest.share(items, rank, world)), group)
    if rank == 0:
        manifest.write_manifest(folder, entries)
    dist.barrier(group=group)


def _check_share(folder: Path, entries: list[manifest.FileEntry], rank: int, world: int) -> list[str]:
    mine = set(manifest.share([(e.name, e.bytes) for e in entries], rank, world))
    return sorted(_gathered(manifest.check(folder, [e for e in entries if e.name in mine])))


def agreed_start_point(*, ckpt_dir: Path, resume: str, init_from: str | None) -> StartPoint:
    """`resume.start_point` decided on rank 0, each candidate's checksums checked by all ranks; every rank gets
    the same StartPoint, or raises the same CheckpointError. Every rank calls this together."""
    rank, world = _world()
    if world == 1:
        return start_point(ckpt_dir=ckpt_dir, resume=resume, init_from=init_from, verify=manifest.verify)
    if rank == 0:

        def verify(folder: Path) -> list[str]:
            try:
                entries, unreadable = manifest.read_manifest(folder), []
            except manifest.ManifestError as error:
                entries, unreadable = [], [str(error)]
            _broadcast(("verify", str(folder), entries))
            return unreadable + _check_share(folder, entries, rank, world)

        try:
            outcome = ("start", start_point(ckpt_dir=ckpt_dir, resume=resume, init_from=init_from, verify=verify))
        except CheckpointError as error:
            outcome = ("refused", str(error))
        except BaseException as error:  # the other ranks must not wait for a decision that never comes
            _broadcast(("failed", f"{type(error).__name__}: {error}"))
            raise
        _broadcast(outcome)
    else:
        while (outcome := _broadcast())[0] == "verify":
            _check_share(Path(outcome[1]), outcome[2], rank, world)
    kind, value = outcome
    if kind == "refused":
        raise CheckpointError(value)
    if kind == "failed":
        raise RuntimeError(f"rank 0 failed while choosing the checkpoint to start from: {value}")
    return value
