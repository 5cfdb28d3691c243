"""Token dispatch: moves each token's hidden state to the experts it was routed to, and the results back.

As in Megatron-Core, dispatch is separate from routing and from the expert computation, so that expert
parallelism replaces only this piece. Every dispatcher has the same pair:
    dispatch(hidden [T, H], topk_indices [T, K], topk_weights [T, K], *, keep=None, pad_to=None, host_counts=None)
        -> (rows [N, H] sorted by local expert, row_probs [N], tokens_per_local_expert [E_local] int64, plan)
    combine(expert_out [N, H], plan) -> [T, H] fp32
Each row travels with its slot's routing weight (`row_probs`, fp32 as the router made it, 0 for padding), the
experts multiply their activation by it (experts.py), so combine is each token's plain sum of its returned rows
(Megatron-Core's moe_permute_fusion with probs): the weights' gradient flows back through the dispatch's
collectives, and the combine keeps no expert output for backward.
`LocalDispatcher` is the no-communication case (every expert on this process); the expert-parallel ones
(dispatch_alltoall.py, dispatch_allgather.py, dispatch_hierarchical.py) are built by `dispatcher_for` from
`model.moe.dispatcher`.
`host_counts` (the rows per expert, known on the host and the same on every rank: forced even routing) lets an
expert-parallel dispatcher size its collectives without reading the device; so does `pad_to` (the capacity,
the same on every rank) for the alltoall and hierarchical dispatchers, whatever the routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moe_train.models.moe.dispatch_allgather import AllGatherDispatcher
from moe_train.models.moe.dispatch_alltoall import AllToAllDispatcher
from moe_train.models.moe.dispatch_hierarchical import HierarchicalDispatcher
from moe_train.models.moe.permute import Permutation, permute, slot_sum, unpermute


class TokenDispatcher(Protocol):
    """What the MoE layer calls (the traffic it causes is counted by `measure`, docs/measure.md)."""

    num_experts: int
    num_local_experts: int

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_indices: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        pad_to: int | None = None,
        host_counts: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, expert_out: torch.Tensor, plan: Any) -> torch.Tensor: ...


class LocalDispatcher:
    """Permutes token slots into expert-major order and back, on one process (see permute.py)."""

    def __init__(self, *, num_experts: int):
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_indices: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        pad_to: int | None = None,
        host_counts: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Permutation]:
        """hidden [T, H], topk_indices [T, K], topk_weights [T, K] -> (rows [N, H] sorted by expert, their
        weights [N], tokens per expert [E], plan).

        keep [T, K] (bool) drops the assignments that are False. pad_to gives every expert exactly that many
        rows (zeros after its real ones), for static shapes. host_counts: unused (nothing to size here).
        """
        return permute(hidden, topk_indices, topk_weights, num_experts=self.num_experts, keep=keep, pad_to=pad_to)

    def combine(self, expert_out: torch.Tensor, plan: Permutation) -> torch.Tensor:
        """expert_out [N, H] (weighted by the experts) -> [T, H] fp32: each token's sum of its experts' outputs."""
        return slot_sum(unpermute(expert_out, plan), plan.top_k)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher,
               "hierarchical": HierarchicalDispatcher}


def dispatcher_for(
    name: str, *, num_experts: int, group: dist.ProcessGroup | None, expert_tp_size: int = 1,
    node_group: dist.ProcessGroup | None = None,
) -> TokenDispatcher:
    """The dispatcher that `model.moe.dispatcher` names, over its group (None: no expert parallelism).

    alltoall takes the ep group; allgather takes the ep x etp group (etp fastest) and `expert_tp_size`;
    hierarchical takes this node's part of the ep group (eplocal) as `group` and the ranks with this rank's
    local index across nodes (epnode) as `node_group` (None: one node).
    """
    if name not in DISPATCHERS:
        raise ValueError(f"model.moe.dispatcher must be one of {', '.join(DISPATCHERS)}, got {name!r}")
    if name == "allgather":
        return AllGatherDispatcher(num_experts=num_experts, group=group, expert_tp_size=expert_tp_size)
    if expert_tp_size != 1:
        raise ValueError(f"model.moe.dispatcher {name} with expert tensor parallelism (etp > 1) is not supported yet")
    if name == "hierarchical":
        return HierarchicalDispatcher(num_experts=num_experts, node_group=node_group, local_group=group)
    return AllToAllDispatcher(num_experts=num_experts, group=group)
