"""The all-to-all dispatcher: each token slot travels only to the rank that holds its expert, and back.

dispatch: permute the slots by (global) expert on the source rank (capacity drops and padding applied there,
so padded rows travel too), exchange the per-expert row counts with one all-to-all, send the rows and their
routing weights (one fp32 value a row) with all-to-alls of uneven splits, and sort the received rows
(source-major) by local expert. combine: undo the sort, all-to-all the (weighted) expert outputs back with the
splits swapped, and unpermute and sum them on the source rank.
Dropless unless the caller passes a keep-mask. The traffic grows with the routed rows, not the group size,
which is why Megatron-Core defaults to it for expert parallelism.

The split sizes are host values: read from the exchanged counts (one device-to-host copy per dispatch), or,
when the caller knows every rank's counts on the host (`host_counts`: forced even routing, where they are a
function of the shapes), taken from there: the counts are still exchanged, so the traffic is the same, but
nothing is read back (`moe-train measure --fake` runs on tensors without values). Padded to capacity
(`pad_to`), every split is E_local x pad_to rows whatever the routing: static sizes, nothing read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_train.models.moe.deferred_wgrad import DeferredWeightGrads
from moe_train.models.moe.dispatch_collectives import all_to_all_rows, all_to_all_together
from moe_train.models.moe.expert_group import ExpertShard
from moe_train.models.moe.permute import Permutation, permute, slot_sum, unpermute
from moe_train.models.moe.router import count_per_expert


@dataclass
class AllToAllPlan:
    """What `combine` needs to send the expert outputs home and undo the permutation."""

    permutation: Permutation  # source side: token slots -> the sent buffer (expert-major)
    send_splits: list[int]  # rows this rank sent to each rank of the group
    recv_splits: list[int]  # rows this rank received from each rank of the group
    local_order: torch.Tensor | None  # received row (source-major) of each local-expert-major row; None: no sort


class AllToAllDispatcher:
    """Expert-parallel dispatch over `group` with all_to_all_single (uneven splits); group None: no traffic.

    Dispatch sends the token rows to the experts' ranks, combine sends the expert outputs back, backward sends
    their gradients the other way; beside them go the row-count exchange ((size-1) x E_local x 8 bytes per
    dispatch) and the rows' routing weights (4 bytes a row; backward their gradients). `measure` counts them
    (docs/measure.md).
    """

    def __init__(self, *, num_experts: int, group: dist.ProcessGroup | None = None):
        self.shard = ExpertShard.of(num_experts=num_experts, group=group)
        self.num_experts = num_experts
        self.num_local_experts = self.shard.num_local_experts
        # parallel.split_wgrad: the experts' delayed weight gradients, run in the dispatch's backward collective
        self.deferred_wgrad: DeferredWeightGrads | None = None

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_indices: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        pad_to: int | None = None,
        host_counts: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AllToAllPlan]:
        """hidden [T, H], topk_indices [T, K] (global expert ids), topk_weights [T, K] -> (rows [N, H] sorted by
        local expert, their routing weights [N] (0 for padding), rows per local expert [E_local] int64, plan).

        keep [T, K] drops slots on this (source) rank; pad_to gives each expert pad_to rows from this source
        rank, so a local expert receives the sum over the group's ranks of their pad_to rows. host_counts [E]:
        the rows per expert that topk_indices makes (the slots keep keeps), identical on every rank of the group.
        With pad_to (the same on every rank of the group: the engine's ranks route equal token counts) every
        split is E_local x pad_to rows: nothing is read, whatever the routing.
        """
        shard = self.shard
        if shard.group is None:
            rows, probs, counts, permutation = permute(
                hidden, topk_indices, topk_weights, num_experts=self.num_experts, keep=keep, pad_to=pad_to,
                kept=None if host_counts is None else sum(host_counts),
            )
            return rows, probs, counts, AllToAllPlan(permutation, [len(rows)], [len(rows)], None)
        if pad_to is not None:  # static: pad_to rows per expert from every rank, whatever was kept
            counts = torch.full((self.num_experts,), pad_to, dtype=torch.int64, device=hidden.device)
        else:
            # The rows sent to each expert, counted before permuting, so that the one read of the splits also
            # brings the number of slots a keep-mask kept, which permute would otherwise read on its own.
            slots = topk_indices if keep is None else topk_indices.masked_fill(~keep, self.num_experts)
            counts = count_per_expert(slots, self.num_experts + 1)[: self.num_experts]
        # received[s, j]: rows source rank s sends for this rank's local expert j.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=shard.group)
        received = received.view(shard.size, self.num_local_experts)
        kept = None
        if pad_to is not None:  # the splits follow from the shapes: nothing to read
            send_splits = recv_splits = [self.num_local_experts * pad_to] * shard.size
        elif host_counts is None:  # both splits and the kept count in one device-to-host read: the only one
            *splits, kept = torch.cat([counts.view(shard.size, self.num_local_experts).sum(dim=1),
                                       received.sum(dim=1), counts.sum().view(1)]).tolist()
            send_splits, recv_splits = splits[: shard.size], splits[shard.size:]
        else:
            per_rank = [sum(host_counts[r * self.num_local_experts: (r + 1) * self.num_local_experts])
                        for r in range(shard.size)]
            send_splits, recv_splits, kept = per_rank, [per_rank[shard.rank]] * shard.size, sum(host_counts)
        rows, probs, _, permutation = permute(
            hidden, topk_indices, topk_weights, num_experts=self.num_experts, keep=keep, pad_to=pad_to, kept=kept
        )
        arrived, probs = all_to_all_together(  # one wait for both, forward and backward (ep_overlap)
            [rows, probs], send_splits=send_splits, recv_splits=recv_splits, group=shard.group,
            beside=self.deferred_wgrad,
        )
        if self.num_local_experts == 1:
            local_order = None  # one local expert: source-major order already is expert-major
        else:
            local_expert = torch.arange(self.num_local_experts, device=hidden.device).repeat(shard.size)
            rows_by_expert = local_expert.repeat_interleave(received.reshape(-1), output_size=sum(recv_splits))
            local_order = torch.argsort(rows_by_expert, stable=True)
            arrived = arrived.index_select(0, local_order)
            probs = probs.index_select(0, local_order)  # the rows' index: one storage
        plan = AllToAllPlan(permutation, send_splits, recv_splits, local_order)
        return arrived, probs, received.sum(dim=0), plan

    def combine(self, expert_out: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        """expert_out [N, H] (rows as dispatch returned them, weighted by the experts) -> [T, H] fp32 on the
        tokens' own rank: each token's sum of its slots."""
        permutation = plan.permutation
        return slot_sum(unpermute(self.return_rows(expert_out, plan), permutation), permutation.top_k)

    def return_rows(self, expert_out: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        """expert_out [N, H] (rows as dispatch returned them) -> the source rank's sent buffer [kept slots, H]:
        the local sort undone and the rows sent home."""
        if self.shard.group is not None:
            if plan.local_order is not None:
                source_major = torch.empty_like(plan.local_order)
                source_major[plan.local_order] = torch.arange(len(plan.local_order), device=expert_out.device)
                expert_out = expert_out.index_select(0, source_major)
            expert_out = all_to_all_rows(
                expert_out, send_splits=plan.recv_splits, recv_splits=plan.send_splits, group=self.shard.group
            )
        return expert_out
