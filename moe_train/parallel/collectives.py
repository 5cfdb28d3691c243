"""The communication of tensor and sequence parallelism, as small named autograd functions over the tp group.

Conventions (Megatron-Core's): activations outside a tensor-parallel region are either replicated (every tp
rank holds the same full tensor, and its gradient is the same full tensor on every rank) or, under sequence
parallelism, sharded along the sequence (each rank holds a slice, and the gradient of that slice). Inside a
region, column-parallel GEMMs produce head/feature shards whose input gradients are partial sums over ranks.
So each function is a pair of collectives, one in forward and its transpose in backward:

| function                | forward                   | backward                |
|-------------------------|---------------------------|-------------------------|
| copy_to_region          | identity                  | all-reduce              |
| reduce_from_region      | all-reduce                | identity                |
| gather_sequence         | all-gather along `dim`    | reduce-scatter          |
| reduce_scatter_sequence | reduce-scatter along `dim`| all-gather              |
| scatter_sequence        | keep this rank's slice    | all-gather              |
| gather_replicated       | all-gather along `dim`    | keep this rank's slice  |

`column_linear_saving_shard` is the paper's sequence-parallel GEMM (Korthikanti et al. 2022, section 4.2.2): the
input arrives all-gathered, but only this rank's sequence shard is kept for backward and the full input is
gathered again there, so storing it costs sbh/t instead of sbh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moe_train.models.linear import linear, linear_input_grad, linear_weight_grad

if TYPE_CHECKING:
    from moe_train.models.fp8.gemm import Fp8Gemm

Group = dist.ProcessGroup


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    dist.reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _my_slice(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's chunk as a tensor of its own. A chunk that is already contiguous (a micro-batch of one
    sequence) would be a view: whatever saved it for backward would keep the whole replicated tensor alive."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _my_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _my_slice(grad, ctx.dim, ctx.group), None, None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated activation entering a region whose ranks each return a partial input gradient."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial sums (a row-parallel GEMM's output) to the replicated full value."""
    return _ReduceFromRegion.apply(x, group)


def gather_sequence(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sequence shards to the full sequence, whose gradient on each rank is a partial sum (sequence parallel)."""
    return _GatherSequence.apply(x, dim, group)


def reduce_scatter_sequence(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Partial sums over the full sequence to this rank's summed sequence shard (sequence parallel)."""
    return _ReduceScatterSequence.apply(x, dim, group)


def scatter_sequence(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """A replicated activation to this rank's slice of it (no communication in forward)."""
    return _ScatterSequence.apply(x, dim, group)


def gather_replicated(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Each rank's slice to the replicated full tensor, whose gradient is already full on every rank."""
    return _GatherReplicated.apply(x, dim, group)


class _ColumnLinearSavingShard(torch.autograd.Function):
    """linear(full, weight) where `full` = all-gather of `shard`: keeps `shard` (not `full`) for backward."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, weight: torch.Tensor, shard: torch.Tensor, dim: int,
                group: Group, fp8: Fp8Gemm | None) -> torch.Tensor:
        ctx.save_for_backward(shard, weight)
        ctx.dim, ctx.group, ctx.fp8 = dim, group, fp8
        return linear(full, weight, fp8=fp8)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, weight = ctx.saved_tensors
        full = _all_gather(shard, ctx.dim, ctx.group)
        grad_input = linear_input_grad(grad, weight, fp8=ctx.fp8)
        grad_weight = linear_weight_grad(grad, full, fp8=ctx.fp8)
        return grad_input, grad_weight.to(weight.dtype), None, None, None, None


def column_linear_saving_shard(full: torch.Tensor, weight: torch.Tensor, shard: torch.Tensor, *, dim: int,
                               group: Group, fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """`fp8`: the GEMM's fp8 recipe (models/fp8/gemm.py) when its module runs in fp8."""
    return _ColumnLinearSavingShard.apply(full, weight, shard, dim, group, fp8)
