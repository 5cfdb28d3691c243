"""Saving a training checkpoint atomically: temporary folder, DCP write, manifest, rename, `latest`, keep-K.

Every rank calls `save_checkpoint` at the same step boundary. Rank 0 owns the folder operations; barriers
order them around the collective DCP write and the manifest's checksums (each rank hashes a share of the
files), so no rank can see `latest` move before every shard and the manifest are on disk.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from moe_train.checkpoint import collective
from moe_train.checkpoint.layout import prune, publish, step_dir_name, tmp_dir
from moe_train.checkpoint.state import Progress, save_training_state


def save_checkpoint(
    ckpt_dir: Path,
    *,
    chunks: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    progress: Progress,
    model_config: dict,
    keep: int | None,
) -> Path:
    """Write `step-NNNNNNN` for `progress.step` and make it the latest; returns its final path. `chunks`:
    this rank's model chunks (pipeline stages), each with its optimizer in `optimizers`."""
    is_rank0 = collective.rank() == 0
    tmp = tmp_dir(ckpt_dir, progress.step)
    if is_rank0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a save that was killed midway
            shutil.rmtree(tmp)
    collective.barrier()
    save_training_state(tmp, chunks=chunks, optimizers=optimizers, progress=progress,
                        model_config=model_config)
    if is_rank0:
        publish(tmp, step=progress.step)
        prune(ckpt_dir, keep=keep)
    collective.barrier()
    return ckpt_dir / step_dir_name(progress.step)
