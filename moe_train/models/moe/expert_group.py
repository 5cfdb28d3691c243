"""Which experts a rank of the dispatch group holds: a contiguous block of num_experts // ep.

Rank r of an expert-parallel group holds experts [r * E_local, (r + 1) * E_local), so the expert-major order of
a permuted buffer is also its destination-rank order and the buffer is sent without another sort. A group that
flattens (ep, etp) with etp fastest (the all-gather dispatcher's ep x etp group) has ep = size // etp, and its
rank g holds the experts of ep coordinate g // etp (a tensor-parallel shard of each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ExpertShard:
    """This rank's share of the experts; group None (or a group of one) holds all of them."""

    num_experts: int
    size: int  # ranks in the dispatch group (ep x etp)
    rank: int  # this rank's index in the group
    expert_tp_size: int  # etp: consecutive group ranks that hold the same experts
    group: ProcessGroup | None  # None when size is 1: no communication at all

    @classmethod
    def of(cls, *, num_experts: int, group: ProcessGroup | None, expert_tp_size: int = 1) -> ExpertShard:
        size = 1 if group is None else dist.get_world_size(group)
        if size % expert_tp_size:
            raise ValueError(f"expert tensor-parallel size {expert_tp_size} does not divide the group size {size}")
        if num_experts % (size // expert_tp_size):
            raise ValueError(
                f"model.moe.num_experts ({num_experts}) not divisible by the expert-parallel size "
                f"{size // expert_tp_size}"
            )
        rank = 0 if group is None else dist.get_rank(group)
        return cls(
            num_experts=num_experts,
            size=size,
            rank=rank,
            expert_tp_size=expert_tp_size,
            group=group if size > 1 else None,
        )

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // (self.size // self.expert_tp_size)

    @property
    def first_expert(self) -> int:
        return self.rank // self.expert_tp_size * self.num_local_experts
