"""The one training step `measure` runs: the trainer's step without its host reads.

It mirrors `Trainer.train_step` (moe_train/train/loop.py): per micro-batch, the forward under the recipe's
autocast, the loss the trainer optimises (token-summed cross-entropy over the global batch's tokens, plus the
model's aux and MTP losses scaled by 1 / (micro-batches x dp)), backward; then the gradient sum over the
data-parallel group in one flat all-reduce, clipping and the AdamW update. It leaves out what only reads
values on the host (loss and gradient-norm figures, expert-load telemetry), which fake tensors cannot give.
This is the one place to switch to the parallel engine's Trainer once it is in main.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_train.config.schema import Recipe


@dataclass(frozen=True)
class MicroBatch:
    inputs: torch.Tensor  # [b, s] token ids
    labels: torch.Tensor  # [b, s]
    positions: torch.Tensor | None  # [b, s], or None: 0..s-1


def autocast(recipe: Recipe, device: torch.device) -> contextlib.AbstractContextManager:
    if recipe.train.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    *,
    recipe: Recipe,
    device: torch.device,
    dp_group: dist.ProcessGroup | None,
) -> None:
    train = recipe.train
    dp_size = dp_group.size() if dp_group is not None else 1
    share = 1.0 / (len(micro_batches) * dp_size)
    tokens_per_step = train.global_batch_size * train.seq_length
    optimizer.zero_grad(set_to_none=True)
    for micro in micro_batches:
        with autocast(recipe, device):
            logits = model(micro.inputs, micro.positions, labels=micro.labels)
        lm = F.cross_entropy(logits.flatten(0, 1).float(), micro.labels.flatten(), reduction="sum") / tokens_per_step
        (lm + model.aux_loss() * share + model.mtp_loss() * share).backward()
    if dp_size > 1:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        torch._foreach_copy_(grads, [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in grads]),
                                                                             grads, strict=True)])
    torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip or math.inf, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
