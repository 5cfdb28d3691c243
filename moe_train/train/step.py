"""The forward and backward passes of one optimizer step, shared by the trainer and `moe-train measure`.

Nothing here reads a value on the host, so the same code runs on fake tensors (`measure --fake`). The optimised
loss of a micro-batch is its cross-entropy summed over its tokens divided by the whole global batch's token count,
plus its weighted MTP loss times its share 1 / (micro-batches x dp), so the gradients that accumulate over the
step's micro-batches (and are summed over data-parallel ranks by FSDP2) are the global batch's, whatever the
layout; balancing losses ride on the MoE layers' outputs at the scale each chunk's `balancing.start_step` gives
them.

Without pipeline parallelism this rank's single model runs the micro-batches one after another, FSDP2 reducing
gradients in the last one's backward. With it, the schedule (parallel/pipeline.py) interleaves them over the
stages and reduces after its last backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_train.models.model import LossTerms, Transformer
from moe_train.parallel.data_parallel import set_gradient_sync
from moe_train.parallel.pipeline import Pipeline, duplicate_parameters, shared_embedding_group, sync_shared_gradients
from moe_train.parallel.tensor import reduce_replicated_gradients
from moe_train.train.optimizer import build_optimizer

if TYPE_CHECKING:
    import torch.distributed as dist

    from moe_train.config.schema import Recipe
    from moe_train.parallel.context import ParallelContext


@dataclass(frozen=True)
class StepParts:
    """What every step takes besides this rank's model chunks, built once from them (by the trainer and by
    `measure`, which must run the trainer's step)."""

    optimizers: list[torch.optim.Optimizer]  # one per chunk
    pipeline: Pipeline | None  # the schedule over the stages, when pp > 1
    shared_embedding: dist.ProcessGroup | None  # first and last stage, when both hold the embedding
    duplicates: list[torch.nn.Parameter]  # a stage's copy of another's parameter: counted once in the norm


def step_parts(chunks: list[Transformer], recipe: Recipe, ctx: ParallelContext) -> StepParts:
    return StepParts(
        optimizers=[build_optimizer(chunk, train=recipe.train) for chunk in chunks],
        pipeline=Pipeline(chunks, recipe, ctx) if ctx.size("pp") > 1 else None,
        shared_embedding=shared_embedding_group(recipe, ctx),
        duplicates=duplicate_parameters(chunks),
    )


@dataclass(frozen=True)
class Batch:
    """This rank's samples of one global batch: inputs and labels [B, s], positions [B, s] or None (0..s-1).
    Micro-batches are consecutive rows."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None

    def micro_batches(self, size: int) -> list[Batch]:
        inputs, labels = self.inputs.split(size), self.labels.split(size)
        positions = self.positions.split(size) if self.positions is not None else [None] * len(inputs)
        return [Batch(*rows) for rows in zip(inputs, labels, positions, strict=True)]


class StepLoss:
    """Turns each micro-batch's loss terms into its part of the step's optimised loss, and keeps the step's
    running sums on the device: `sums[0]` the cross-entropy summed over tokens, `sums[1]` the weighted MTP share."""

    def __init__(self, *, tokens_per_step: int, share: float, device: torch.device) -> None:
        self.tokens_per_step = tokens_per_step
        self.share = share
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)

    def __call__(self, terms: LossTerms) -> torch.Tensor:
        lm = terms.lm_sum / self.tokens_per_step
        mtp = terms.mtp * self.share
        self.sums += torch.stack([terms.lm_sum.detach(), mtp.detach()]).double()
        return lm + mtp


def forward_backward(
    chunks: list[Transformer],
    pipeline: Pipeline | None,
    batch: Batch,
    *,
    micro_batch_size: int,
    loss: StepLoss,
) -> None:
    """Accumulate the step's gradients in the chunks' parameters (FSDP2 reduces them once, at the end)."""
    for chunk in chunks:
        chunk.balancing.start_step(scale=loss.share)
    if pipeline is not None:
        pipeline.train(batch.inputs, batch.labels, batch.positions, loss)
        return
    (model,) = chunks
    micro_batches = batch.micro_batches(micro_batch_size)
    for index, micro in enumerate(micro_batches):
        set_gradient_sync(model, index == len(micro_batches) - 1)
        loss(model(micro.inputs, micro.positions, labels=micro.labels)).backward()


@torch.no_grad()
def forward_only(chunks: list[Transformer], pipeline: Pipeline | None, batch: Batch, *, micro_batch_size: int,
                 loss: StepLoss) -> None:
    """The loss terms of a batch without gradients (evaluation: the models are in eval mode)."""
    if pipeline is not None:
        pipeline.evaluate(batch.inputs, batch.labels, batch.positions, loss)
        return
    (model,) = chunks
    for micro in batch.micro_batches(micro_batch_size):
        loss(model(micro.inputs, micro.positions, labels=micro.labels))


def reduce_gradients(chunks: list[Transformer], *, tp_group: dist.ProcessGroup,
                     shared_embedding: dist.ProcessGroup | None) -> None:
    """After the step's last backward: sum over tp the gradients of parameters replicated over it that each rank
    computed from part of the data, and sum the embedding's gradient with its last-stage copy's."""
    for chunk in chunks:
        reduce_replicated_gradients(chunk, tp_group)
    sync_shared_gradients(chunks, shared_embedding)
