"""Differentiable collectives for token dispatch.

Each is a small autograd function whose backward is the transposed collective: all-to-all's backward is the
all-to-all with the splits swapped, all-gather's is reduce-scatter (sum) and reduce-scatter's is all-gather.
So gradients reach the hidden states and the routing weights on the ranks that own the tokens. The bytes they
move are counted by `moe-train measure` (measure/traffic.py), which sees every collective a step runs.

Each collective is issued asynchronously and waited on through `run_collective` (models/moe/collective_turns.py): in a
plain step that is issue-then-wait, the blocking call; inside an overlapped pair of micro-batches
(`parallel.ep_overlap`) the paired micro-batch computes between the issue and the wait. Either way the wait's
and the collective's own time are booked per kind (`comm_wait_times`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from moe_train.models.moe.collective_turns import issued_together, run_collective
from moe_train.models.moe.deferred_wgrad import DeferredWeightGrads


def all_to_all_rows(
    rows: torch.Tensor,
    *,
    send_splits: list[int],
    recv_splits: list[int],
    group: ProcessGroup,
) -> torch.Tensor:
    """rows [sum(send_splits), H] -> [sum(recv_splits), H]: block r of the input goes to rank r of the group."""
    return _AllToAll.apply(rows, send_splits, recv_splits, group)


def all_to_all_together(
    tensors: list[torch.Tensor],
    *,
    send_splits: list[int],
    recv_splits: list[int],
    group: ProcessGroup,
    beside: DeferredWeightGrads | None = None,
) -> list[torch.Tensor]:
    """Several row tensors with the same splits (a dispatch's rows, their expert ids, their routing weights),
    issued together and waited on together, in forward and in backward: one wait, so
    under `parallel.ep_overlap` the paired micro-batch's compute runs beside all of them at once. `beside`: the
    experts' delayed weight gradients (`parallel.split_wgrad`), run once the backward's collectives are issued
    and before they are waited on."""
    return list(_AllToAllTogether.apply(send_splits, recv_splits, group, beside, *tensors))


def all_gather_rows(x: torch.Tensor, *, group: ProcessGroup, beside: DeferredWeightGrads | None = None
                    ) -> torch.Tensor:
    """x [n, ...] from each rank -> [G*n, ...] in rank order (every rank must pass the same n). `beside`: as
    `all_to_all_together`'s, run by the backward's reduce-scatter."""
    return _AllGather.apply(x, group, beside)


def reduce_scatter_rows(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """x [G*n, ...] on each rank -> [n, ...]: rank r gets block r summed over the ranks."""
    return _ReduceScatter.apply(x, group)


def _all_to_all(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup
                ) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty(sum(recv_splits), *rows.shape[1:])
    run_collective("all_to_all", lambda: dist.all_to_all_single(
        out, rows, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group, async_op=True),
        group=group)
    return out


def _all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    run_collective("all_gather", lambda: dist.all_gather_single(out, x, group=group, async_op=True), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    run_collective("reduce_scatter", lambda: dist.reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group,
                                                                        async_op=True), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _all_to_all(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad, recv_splits, send_splits, ctx.group), None, None, None


class _AllToAllTogether(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_splits, recv_splits, group, beside, *tensors):
        ctx.splits, ctx.group, ctx.beside = (send_splits, recv_splits), group, beside
        ctx.set_materialize_grads(False)  # an output without a gradient sends nothing back, as on its own
        with issued_together():
            outs = [_all_to_all(t, send_splits, recv_splits, group) for t in tensors]
        ctx.mark_non_differentiable(*[out for out in outs if not out.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        send_splits, recv_splits = ctx.splits
        beside = None if ctx.beside is None else ctx.beside.run
        with issued_together(beside=beside):  # which outputs have gradients is the graph's, the same on every rank
            back = [None if grad is None else _all_to_all(grad, recv_splits, send_splits, ctx.group) for grad in grads]
        return None, None, None, None, *back


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, beside):
        ctx.group, ctx.beside = group, beside
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        with issued_together(beside=None if ctx.beside is None else ctx.beside.run):
            out = _reduce_scatter(grad, ctx.group)
        return out, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None
