"""Data parallelism with FSDP2 (`fully_shard`): dense parameters sharded over dp, experts over edp (with their
block when edp is dp), and explicit prefetch one block ahead.

Every rank holds a shard of every parameter, gathered for a module's forward and backward and resharded after
(unless `parallel.reshard_after_forward` is false, the default under pipeline parallelism: more memory, one
all-gather less per micro-batch). `parallel.param_gather` and `parallel.grad_reduce` set the cadences over a
step's micro-batches (`set_cadence`; under pipelining torch's schedules set them, `_reduce_in_every_backward`
holding the gradient sync on for grad_reduce per_microbatch). The
policy is one at every world size, including 1, so numerics never depend on dp: parameters are kept in fp32
(the optimizer's master weights), computed in the recipe's precision (bf16 or fp32; fp8 computes in bf16 around
its fp8 GEMMs, models/fp8/), and gradients are reduced in fp32. `train.fp8.fp8_all_gather` gathers the
fp8-marked Linear weights in fp8 with the whole weight's scale (models/fp8/all_gather.py): the same numbers, bit
for bit, in half the bytes. On one process in fp32 that policy is the identity (nothing to gather, cast or
reduce), so FSDP2 is not applied there: its hooks and buffer copies cost ~10% of the default run's step for
bit-identical numbers.
A bf16 run on one process keeps FSDP2, whose parameter cast is the policy.

HSDP (`parallel.dp_replicate` > 1): the mesh is 2-D, (dpr, dps) for dense units and (dpr, edps) for experts
apart (ParallelContext.fsdp_mesh): parameters are sharded over the shard dimension and replicated over dpr;
FSDP2 reduce-scatters gradients within dps, then all-reduces the shard across dpr.

Gradients are SUMMED over the data-parallel group, never averaged: the trainer scales each rank's loss to its
share of the global batch already, so the sum is the global batch's gradient. Forcing the sum (and a divide
factor of 1) also avoids the reduction paths reported wrong on gloo (pytorch#162338: averaging summed) and when
a shard group is the whole world or of size 1 (pytorch#160285, PR #167178).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from moe_train.parallel.layout import replace_fsdp_post_backward

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.model import Transformer
    from moe_train.parallel.context import ParallelContext


def apply_fsdp(model: Transformer, recipe: Recipe, ctx: ParallelContext) -> None:
    """Shard each decoder block (and MTP module) as one unit, its routed experts with it or, where they live on
    other ranks (`parallel.experts_apart`), as their own unit over the expert mesh's edp dimension, and the rest
    (embedding, final norm, head) as the root unit."""
    compute_dtype = torch.bfloat16 if recipe.train.compute_precision == "bf16" else torch.float32
    if ctx.world_size == 1 and compute_dtype == torch.float32:
        return
    options = dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
        reshard_after_forward=recipe.parallel.reshards_after_forward,
    )
    if recipe.train.precision == "fp8" and recipe.train.fp8.fp8_all_gather:
        from moe_train.models.fp8.all_gather import wrap_fp8_weights

        wrap_fp8_weights(model)  # their shards gather in fp8 (models/fp8/all_gather.py)
    dense, expert = ctx.fsdp_mesh(experts=False), ctx.fsdp_mesh(experts=True)
    apart = recipe.parallel.experts_apart
    blocks: list[nn.Module] = [*model.layers.values(), *(module.block for module in model.mtp.values())]
    for block in blocks:
        if block.is_moe and apart:
            fully_shard(block.ffn.experts, mesh=expert, **options)
            if block.ffn.experts.deferred_wgrad is not None:
                _post_backward_after_delayed_grads(block.ffn.experts)
        fully_shard(block, mesh=dense, **options)
    for module in model.mtp.values():  # its projection and norms around the block
        fully_shard(module, mesh=dense, **options)
    fully_shard(model, mesh=dense, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    if recipe.parallel.grad_reduce == "per_microbatch":
        _reduce_in_every_backward(model)
    if dense.size() > 1:  # one shard: nothing to gather, so prefetching only holds the next block earlier
        _prefetch_one_block_ahead([_units(block, apart) for block in blocks])


def _post_backward_after_delayed_grads(experts: FSDPModule) -> None:
    """`parallel.split_wgrad`: the experts unit's post-backward (its gradients' reduce-scatter, or their fp32
    accumulation) fires once the experts' inputs have their gradients, before the dispatch's backward runs the
    delayed weight gradients; it waits for them (models/moe/deferred_wgrad.py `hold`). FSDP2 has no hook for it:
    the one rewrite left outside the model's declared points (parallel/layout.py)."""

    def after_delayed_grads(post_backward: Callable[..., None]) -> Callable[..., None]:
        def run(*grads: torch.Tensor) -> None:
            if not experts.deferred_wgrad.hold(lambda: post_backward(*grads)):
                post_backward(*grads)

        return run

    replace_fsdp_post_backward(experts._get_fsdp_state()._fsdp_param_group, after_delayed_grads)


def _reduce_in_every_backward(model: FSDPModule) -> None:
    """`parallel.grad_reduce: per_microbatch`: hold FSDP2's gradient sync on for every unit of `model`, whatever
    it is asked, so each backward reduce-scatters the units' gradients into their fp32 shards (where the step's
    gradient accumulates) instead of keeping their unsharded fp32 gradients until the step's last backward.

    Without a pipeline the trainer asks for it (`set_cadence`); under pipelining this is the only way in: torch's
    schedules turn every stage's sync off before each backward (PipelineStage.backward_maybe_with_nosync) and
    run every unit's post-backward after the step's last one (perform_reduce_grad), which then finds no
    unsharded gradient left (FSDPParamGroup.post_backward is idempotent) and only reshards and finalizes. The
    method is shadowed on the instance, as torch's schedules call it by attribute."""
    request = model.set_requires_gradient_sync

    def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        request(True, recurse=recurse)

    model.set_requires_gradient_sync = set_requires_gradient_sync
    request(True)


def _units(block: nn.Module, apart: bool) -> list[FSDPModule]:
    """A block's FSDP2 units in the order its forward uses them: the block (attention), then its experts when
    they are a unit of their own."""
    return [block, block.ffn.experts] if block.is_moe and apart else [block]


def _prefetch_one_block_ahead(units: list[list[FSDPModule]]) -> None:
    """Explicit prefetch: each block's forward issues the next block's all-gathers, each block's backward the
    previous block's, so the gathers overlap compute. FSDP2's implicit prefetch only overlaps the copy-out of a
    gather with the next module, and it cannot run ahead of a CPU that waits: a MoE layer's dispatch reads its
    split sizes on the host, so without this the next block's gather starts only after that wait (torchtitan
    sets the same for MoE models). One block ahead holds at most two blocks' parameters gathered, as implicit
    prefetch does; further ahead would cost another block's memory for overlap the comm stream already has.
    `apply_fsdp` sets it only where the dense mesh has more than one rank (with one shard nothing is gathered)."""
    for before, after in zip(units, units[1:], strict=False):
        before[0].set_modules_to_forward_prefetch(after)
        after[0].set_modules_to_backward_prefetch(list(reversed(before)))


def set_cadence(model: nn.Module, *, reduce_gradients: bool, reshard_after_backward: bool) -> None:
    """Before a micro-batch's backward (no pipeline; torch's schedules set the same for their stages): whether it
    reduce-scatters the gradients over the data-parallel ranks (`parallel.grad_reduce`: every micro-batch, or
    the last one only, accumulating unsharded fp32 gradients until then) and whether it frees the gathered
    parameters after (`parallel.param_gather`: per_step keeps them, with reshard_after_forward false, until the
    last micro-batch's backward, so each unit is gathered once per step; the last one must reshard, since the
    optimizer updates the shards). A model without FSDP2 (one fp32 process) has nothing to gather or reduce."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(reduce_gradients)
        model.set_reshard_after_backward(reshard_after_backward)
