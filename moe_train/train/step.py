"""One optimizer step, written once: the trainer (moe_train/train/loop.py) and `moe-train measure` run it alike.

Nothing here reads a value on the host, so the same code runs on fake tensors (`measure --fake`). The step is
two phases, with the trainer's host-side figures between them: `compute_gradients` (telemetry reset, the
forward and backward passes over the micro-batches, the gradient reductions, the clip; it leaves the loss sums
and the gradient norm on the device) and `apply_update` (the learning rate and AdamW), which the trainer calls
only when it admits the step (bad_steps.py); `zero_gradients` ends either.

The optimised loss of a micro-batch is its cross-entropy summed over its tokens divided by the whole global
batch's token count, plus its weighted MTP loss times its share 1 / (micro-batches x dp), so the gradients that
accumulate over the step's micro-batches (and are summed over data-parallel ranks by FSDP2) are the global
batch's, whatever the layout; balancing losses ride on the MoE layers' outputs at the scale
each chunk's `balancing.start_step` gives them.

Without pipeline parallelism this rank's single model runs the micro-batches one after another, FSDP2 reducing
gradients in the last one's backward. With it, the schedule (parallel/pipeline.py) interleaves them over the
stages and reduces after its last backward. With `parallel.ep_overlap` the micro-batches run in overlapped
pairs, the forward of one beside the backward of the one before (parallel/overlap.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_train.models.model import LossTerms, Transformer
from moe_train.models.moe import MoELayer
from moe_train.parallel.data_parallel import set_cadence
from moe_train.parallel.overlap import overlapped_micro_batches
from moe_train.parallel.pipeline import Pipeline, sync_shared_gradients
from moe_train.parallel.tensor import reduce_replicated_gradients
from moe_train.train.batch import Batch
from moe_train.train.grad_norm import clip_grad_norm
from moe_train.train.optimizer import set_lr

if TYPE_CHECKING:
    import torch.distributed as dist

    from moe_train.config.schema import ParallelConfig, Recipe
    from moe_train.parallel.context import ParallelContext
    from moe_train.train.build import Trainable


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
    parallel: ParallelConfig,
) -> None:
    """Accumulate the step's gradients in the chunks' parameters, gathering and reducing at the cadences
    `parallel` sets (default: reduced once, at the end)."""
    for chunk in chunks:
        chunk.balancing.start_step(scale=loss.share)
    if pipeline is not None:
        pipeline.train(batch.inputs, batch.labels, batch.positions, loss, batch.mtp)
        return
    (model,) = chunks
    micro_batches = batch.micro_batches(micro_batch_size)
    if parallel.ep_overlap:
        overlapped_forward_backward(model, micro_batches, loss=loss, parallel=parallel)
        return
    for index, micro in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        set_cadence(model, reduce_gradients=last or parallel.grad_reduce == "per_microbatch",
                    reshard_after_backward=last or not parallel.gathers_per_step)
        loss(model(micro.inputs, micro.positions, labels=micro.labels, **micro.mtp_kwargs)).backward()


def overlapped_forward_backward(model: Transformer, micro_batches: list, *, loss: StepLoss,
                                parallel: ParallelConfig) -> None:
    """`parallel.ep_overlap`: the micro-batches' forwards and backwards in overlapped pairs (parallel/overlap.py),
    each backward at the cadence the plain loop gives it."""
    last = len(micro_batches) - 1

    def forward(index: int) -> torch.Tensor:
        micro = micro_batches[index]
        return loss(model(micro.inputs, micro.positions, labels=micro.labels, **micro.mtp_kwargs))

    def backward(index: int, optimised: torch.Tensor) -> None:
        set_cadence(model, reduce_gradients=index == last or parallel.grad_reduce == "per_microbatch",
                    reshard_after_backward=index == last or not parallel.gathers_per_step)
        optimised.backward()

    overlapped_micro_batches(len(micro_batches), forward, backward)


@torch.no_grad()
def forward_only(chunks: list[Transformer], pipeline: Pipeline | None, batch: Batch, *, micro_batch_size: int,
                 loss: StepLoss) -> None:
    """The loss terms of a batch without gradients (evaluation: the models are in eval mode)."""
    if pipeline is not None:
        pipeline.evaluate(batch.inputs, batch.labels, batch.positions, loss, batch.mtp)
        return
    (model,) = chunks
    for micro in batch.micro_batches(micro_batch_size):
        loss(model(micro.inputs, micro.positions, labels=micro.labels, **micro.mtp_kwargs))


def reduce_gradients(chunks: list[Transformer], *, tp_group: dist.ProcessGroup,
                     shared_embedding: dist.ProcessGroup | None) -> None:
    """After the step's last backward: sum over tp the gradients of parameters replicated over it that each rank
    computed from part of the data, and sum the embedding's gradient with its last-stage copy's."""
    for chunk in chunks:
        reduce_replicated_gradients(chunk, tp_group)
    sync_shared_gradients(chunks, shared_embedding)


def reset_telemetry(chunks: list[Transformer]) -> None:
    """Zero what the forwards accumulate over a step: each MoE layer's counts and each chunk's balancing loss."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                module.reset_telemetry()
        chunk.aux_loss_value.zero_()


def zero_gradients(trainable: Trainable) -> None:
    for optimizer in trainable.optimizers:
        optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class Gradients:
    """What `compute_gradients` leaves on the device for the host to read (or not): the step's loss sums
    (`loss.sums`; `loss.share` is each micro-batch's share of the step) and the gradient norm before clipping."""

    loss: StepLoss
    grad_norm: torch.Tensor


def compute_gradients(trainable: Trainable, batch: Batch, *, recipe: Recipe, ctx: ParallelContext) -> Gradients:
    """Phase one of the step: this rank's gradients of the global batch, reduced and clipped."""
    train = recipe.train
    micro_batches = len(batch.inputs) // train.micro_batch_size
    share = 1.0 / (micro_batches * ctx.size("dp"))  # of each micro-batch's mean losses
    loss = StepLoss(tokens_per_step=train.global_batch_size * train.seq_length, share=share,
                    device=batch.inputs.device)
    reset_telemetry(trainable.chunks)
    zero_gradients(trainable)
    forward_backward(trainable.chunks, trainable.pipeline, batch, micro_batch_size=train.micro_batch_size, loss=loss,
                     parallel=recipe.parallel)
    reduce_gradients(trainable.chunks, tp_group=ctx.group("tp"), shared_embedding=trainable.shared_embedding)
    grad_norm = clip_grad_norm([p for chunk in trainable.chunks for p in chunk.parameters()], train.grad_clip,
                               stage_group=ctx.group("pp"), duplicates=trainable.duplicates,
                               device=ctx.device)
    return Gradients(loss=loss, grad_norm=grad_norm)


def apply_update(trainable: Trainable, *, lr: float) -> None:
    """Phase two: one AdamW step per chunk at the schedule's learning rate."""
    for optimizer in trainable.optimizers:
        set_lr(optimizer, lr)
        optimizer.step()
