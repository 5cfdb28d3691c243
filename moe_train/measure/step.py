"""The one training step `measure` runs: the trainer's step (Trainer.train_step, moe_train/train/loop.py)
without its host-side figures.

Per micro-batch: gradient sync only in the last one (FSDP2 reduces once per step), the model's loss terms
(cross-entropy summed over the micro-batch's tokens divided by the global batch's tokens, plus the weighted
MTP loss times 1 / (micro-batches x dp); balancing losses ride on the MoE layers' outputs at the scale
`set_aux_loss_scale` gives them), backward; then clipping over every mesh (moe_train/train/grad_norm.py) and
the AdamW update. Left out, because they only produce figures the host reads (fake tensors have no values):
the all-reduces of the loss sums and of the MoE telemetry over dp (a few bytes per MoE layer) and the
expert-bias update that follows them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_train.config.schema import Recipe
from moe_train.models.model import Transformer
from moe_train.models.moe import MoELayer
from moe_train.models.moe.aux_loss import set_aux_loss_scale
from moe_train.parallel.context import ParallelContext
from moe_train.parallel.data_parallel import set_gradient_sync
from moe_train.train.grad_norm import clip_grad_norm


@dataclass(frozen=True)
class MicroBatch:
    inputs: torch.Tensor  # [b, s] token ids
    labels: torch.Tensor  # [b, s]
    positions: torch.Tensor | None  # [b, s], or None: 0..s-1


def reset_telemetry(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.reset_telemetry()
    model.aux_loss_value.zero_()


def train_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    *,
    recipe: Recipe,
    ctx: ParallelContext,
) -> None:
    train = recipe.train
    share = 1.0 / (len(micro_batches) * ctx.size("dp"))
    tokens_per_step = train.global_batch_size * train.seq_length
    set_aux_loss_scale(share)
    reset_telemetry(model)
    optimizer.zero_grad(set_to_none=True)
    for index, micro in enumerate(micro_batches):
        set_gradient_sync(model, index == len(micro_batches) - 1)
        terms = model(micro.inputs, micro.positions, labels=micro.labels)
        (terms.lm_sum / tokens_per_step + terms.mtp * share).backward()
    clip_grad_norm(model.parameters(), train.grad_clip, stage_group=ctx.group("pp"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
