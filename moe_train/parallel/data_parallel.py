"""Data parallelism with FSDP2 (`fully_shard`): dense parameters sharded over dp, experts over edp (with their
block when edp is dp).

Every rank holds a shard of every parameter, gathered for a module's forward and backward and resharded after
(unless `parallel.reshard_after_forward` is false, the default under pipeline parallelism: more memory, one
all-gather less per micro-batch). The
policy is one at every world size, including 1, so numerics never depend on dp: parameters are kept in fp32
(the optimizer's master weights), computed in the recipe's precision (bf16 or fp32), and gradients are reduced
in fp32. On one process in fp32 that policy is the identity (nothing to gather, cast or reduce), so FSDP2 is
not applied there: its hooks and buffer copies cost ~10% of the default run's step for bit-identical numbers.
A bf16 run on one process keeps FSDP2, whose parameter cast is the policy.

Gradients are SUMMED over the data-parallel group, never averaged: the trainer scales each rank's loss to its
share of the global batch already, so the sum is the global batch's gradient. Forcing the sum (and a divide
factor of 1) also avoids the reduction paths reported wrong on gloo (pytorch#162338: averaging summed) and when
a shard group is the whole world or of size 1 (pytorch#160285, PR #167178).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.model import Transformer
    from moe_train.parallel.context import ParallelContext


def apply_fsdp(model: Transformer, recipe: Recipe, ctx: ParallelContext) -> None:
    """Shard each decoder block (and MTP module) as one unit, its routed experts with it or, where they live on
    other ranks (`parallel.experts_apart`), as their own unit over the expert mesh's edp dimension, and the rest
    (embedding, final norm, head) as the root unit."""
    compute_dtype = torch.bfloat16 if recipe.train.precision == "bf16" else torch.float32
    if ctx.world_size == 1 and compute_dtype == torch.float32:
        return
    options = dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
        reshard_after_forward=recipe.parallel.reshards_after_forward,
    )
    dense, expert = ctx.mesh("dp"), ctx.mesh("edp")
    apart = recipe.parallel.experts_apart
    blocks: list[nn.Module] = [*model.layers.values(), *(module.block for module in model.mtp.values())]
    for block in blocks:
        if block.is_moe and apart:
            fully_shard(block.mlp.experts, mesh=expert, **options)
        fully_shard(block, mesh=dense, **options)
    for module in model.mtp.values():  # its projection and norms around the block
        fully_shard(module, mesh=dense, **options)
    fully_shard(model, mesh=dense, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Whether the next backward reduces gradients over the data-parallel ranks (FSDP2 reduces once per step, in
    the last micro-batch's backward); a model without FSDP2 (one fp32 process) has nothing to reduce."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
