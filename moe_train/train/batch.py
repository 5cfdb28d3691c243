"""This rank's samples of one global batch, as every step reads them (the trainer's steps and evaluation, and
`moe-train measure`): its data-parallel slice of the global batch (every pipeline stage of the slice reads the
same samples), inputs and labels shifted by one token, positions restarting after each EOD when the recipe asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_train.data import global_batch, position_ids

if TYPE_CHECKING:
    from moe_train.config.schema import Recipe
    from moe_train.parallel.context import ParallelContext


@dataclass(frozen=True)
class Batch:
    """This rank's samples of one global batch: inputs and labels [B, s], positions [B, s] or None (0..s-1).
    Micro-batches are consecutive rows."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None

    @classmethod
    def of_samples(cls, samples: torch.Tensor, *, eod: int | None) -> Batch:
        """From [B, s + 1] token ids; `eod`: restart positions after this token (None: 0..s-1 throughout).
        Inputs and labels are views of the samples."""
        inputs, labels = samples[:, :-1], samples[:, 1:]
        return cls(inputs, labels, position_ids(inputs, eod) if eod is not None else None)

    def micro_batches(self, size: int) -> list[Batch]:
        inputs, labels = self.inputs.split(size), self.labels.split(size)
        positions = self.positions.split(size) if self.positions is not None else [None] * len(inputs)
        return [Batch(*rows) for rows in zip(inputs, labels, positions, strict=True)]


def rank_batch(source, batch_index: int, *, recipe: Recipe, ctx: ParallelContext, eod: int) -> Batch:
    """This rank's samples of global batch `batch_index` of `source` (a dataset's split), on the rank's device."""
    samples = global_batch(source, step=batch_index, global_batch_size=recipe.train.global_batch_size,
                           dp_rank=ctx.coord("dp"), dp_size=ctx.size("dp")).to(ctx.device)
    return Batch.of_samples(samples, eod=eod if recipe.data.reset_at_eod else None)
