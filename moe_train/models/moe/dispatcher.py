"""Token dispatch: moves each token's hidden state to the experts it was routed to, and the results back.

As in Megatron-Core, dispatch is separate from routing and from the expert computation, so that expert
parallelism replaces only this piece: an all-to-all or all-gather dispatcher over the expert-parallel group
keeps the same `dispatch` / `combine` pair. `LocalDispatcher` is the no-communication case (every expert on this
process): a permutation that sorts token slots by expert, so each expert's rows are contiguous for grouped GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_train.models.moe.router import count_per_expert


@dataclass
class DispatchPlan:
    """What `combine` needs to undo a dispatch."""

    slot_rows: torch.Tensor  # [T*K] row of the expert buffer holding each token slot; num_rows when dropped
    num_rows: int  # rows of the expert buffer (including padding)
    has_dropped: bool


class LocalDispatcher:
    """Permutes token slots into expert-major order and back, on one process."""

    def __init__(self, *, num_experts: int):
        self.num_experts = num_experts

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_indices: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        pad_to: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
        """hidden [T, H], topk_indices [T, K] -> (rows [N, H] sorted by expert, tokens per expert [E], plan).

        keep [T, K] (bool) drops the assignments that are False. pad_to gives every expert exactly that many
        rows (zeros after its real ones), for static shapes.
        """
        tokens, top_k = topk_indices.shape
        experts = topk_indices.reshape(-1)
        if keep is not None:
            experts = experts.masked_fill(~keep.reshape(-1), self.num_experts)  # dropped slots sort last
        counts = count_per_expert(experts, self.num_experts + 1)[: self.num_experts]
        order = torch.argsort(experts, stable=True)
        kept = int(counts.sum()) if keep is not None else tokens * top_k
        order = order[:kept]
        source_tokens = order // top_k
        if pad_to is None:
            rows = hidden.index_select(0, source_tokens)
            num_rows = kept
            destination = torch.arange(kept, device=hidden.device)
        else:
            starts = torch.cumsum(counts, 0) - counts
            sorted_experts = experts[order]
            rank = torch.arange(kept, device=hidden.device) - starts[sorted_experts]
            destination = sorted_experts * pad_to + rank
            num_rows = self.num_experts * pad_to
            rows = hidden.new_zeros(num_rows, hidden.shape[1]).index_copy(
                0, destination, hidden.index_select(0, source_tokens)
            )
            counts = torch.full_like(counts, pad_to)
        slot_rows = torch.full((tokens * top_k,), num_rows, dtype=torch.int64, device=hidden.device)
        slot_rows[order] = destination
        plan = DispatchPlan(slot_rows=slot_rows, num_rows=num_rows, has_dropped=kept < tokens * top_k)
        return rows, counts, plan

    def combine(self, expert_out: torch.Tensor, topk_weights: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """expert_out [N, H] -> [T, H] fp32: each token's sum of its experts' outputs times the routing weights.

        Weighting and summing run in fp32 (a bf16 sum of K terms loses bits the residual stream would keep).
        """
        tokens, top_k = topk_weights.shape
        if plan.has_dropped:  # dropped slots read an appended zero row
            expert_out = torch.cat([expert_out, expert_out.new_zeros(1, expert_out.shape[1])])
        slots = expert_out.index_select(0, plan.slot_rows).float()
        weighted = slots.view(tokens, top_k, -1) * topk_weights.unsqueeze(-1)
        return weighted.sum(dim=1)


def dispatcher_for(name: str, *, num_experts: int, group=None) -> LocalDispatcher:
    """The dispatcher `model.moe.dispatcher` names, over `group` (the expert-parallel ranks).

    Within one process both names move tokens the same way; over several ranks they differ.
    """
    import torch.distributed as dist

    if name not in ("alltoall", "allgather"):
        raise ValueError(f"model.moe.dispatcher must be 'alltoall' or 'allgather', got {name!r}")
    if group is not None and dist.get_world_size(group) > 1:
        raise NotImplementedError("expert parallelism (ep > 1) is not supported yet")
    return LocalDispatcher(num_experts=num_experts)
