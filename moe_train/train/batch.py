"""This rank's samples of one global batch, as every step reads them (the trainer's steps and evaluation, and
`moe-train measure`): its data-parallel slice of the global batch (every pipeline stage of the slice reads the
same samples), inputs and labels shifted by one token, positions restarting after each EOD when the recipe asks.

Under context parallelism (cp > 1) each rank then keeps its two chunks of every sequence
(parallel/context_parallel.py: `shard_sequence`), after everything that needs the whole sequence: the one-token
shift of the labels, the positions (always given under CP: the shard's RoPE and document mask follow from them)
and MTP's shifted inputs and targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_train.data import global_batch, position_ids
from moe_train.models.mtp import mtp_shifts
from moe_train.parallel.context_parallel import shard_sequence

if TYPE_CHECKING:
    from moe_train.config.schema import Recipe
    from moe_train.parallel.context import ParallelContext


@dataclass(frozen=True)
class Batch:
    """This rank's samples of one global batch: inputs and labels [B, s], positions [B, s] or None (0..s-1),
    and under context parallelism MTP's inputs and targets [B, depth, s] shifted on the whole sequences (None:
    the model shifts them). Micro-batches are consecutive rows."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None
    mtp_inputs: torch.Tensor | None = None
    mtp_targets: torch.Tensor | None = None

    @classmethod
    def of_samples(cls, samples: torch.Tensor, *, eod: int | None) -> Batch:
        """From [B, s + 1] token ids; `eod`: restart positions after this token (None: 0..s-1 throughout).
        Inputs and labels are views of the samples."""
        inputs, labels = samples[:, :-1], samples[:, 1:]
        return cls(inputs, labels, position_ids(inputs, eod) if eod is not None else None)

    @property
    def mtp(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.mtp_inputs is None else (self.mtp_inputs, self.mtp_targets)

    @property
    def mtp_kwargs(self) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for pre-shifted MTP inputs (none when the model shifts them)."""
        return {} if self.mtp_inputs is None else {"mtp_inputs": self.mtp_inputs, "mtp_targets": self.mtp_targets}

    def micro_batches(self, size: int) -> list[Batch]:
        fields = (self.inputs, self.labels, self.positions, self.mtp_inputs, self.mtp_targets)
        rows = [x.split(size) if x is not None else None for x in fields]
        count = len(rows[0])
        return [Batch(*(None if parts is None else parts[i] for parts in rows)) for i in range(count)]

    def context_shard(self, *, cp: int, rank: int, mtp_layers: int) -> Batch:
        """This cp rank's chunks of every sequence; positions are made explicit (0..s-1 where none) and MTP's
        inputs and targets are shifted on the whole sequences first."""
        positions = self.positions
        if positions is None:
            positions = torch.arange(self.inputs.shape[1], device=self.inputs.device).expand(self.inputs.shape)
        mtp = (None, None)
        if mtp_layers > 0:
            mtp = tuple(shard_sequence(x, cp=cp, rank=rank)
                        for x in mtp_shifts(self.inputs, self.labels, positions, depth=mtp_layers))
        return Batch(*(shard_sequence(x, cp=cp, rank=rank) for x in (self.inputs, self.labels, positions)), *mtp)


def rank_batch(source, batch_index: int, *, recipe: Recipe, ctx: ParallelContext, eod: int) -> Batch:
    """This rank's samples of global batch `batch_index` of `source` (a dataset's split), on the rank's device."""
    samples = global_batch(source, step=batch_index, global_batch_size=recipe.train.global_batch_size,
                           dp_rank=ctx.coord("dp"), dp_size=ctx.size("dp")).to(ctx.device)
    batch = Batch.of_samples(samples, eod=eod if recipe.data.reset_at_eod else None)
    if ctx.size("cp") == 1:
        return batch
    return batch.context_shard(cp=ctx.size("cp"), rank=ctx.coord("cp"), mtp_layers=recipe.model.mtp_layers)
