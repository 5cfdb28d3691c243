"""Which experts a rank of the expert-parallel group holds: a contiguous block of num_experts // size.

Rank r of the group holds experts [r * E_local, (r + 1) * E_local), so the expert-major order of a permuted
buffer is also its destination-rank order and the buffer is sent without another sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ExpertShard:
    """This rank's share of the experts; group None (or a group of one) holds all of them."""

    num_experts: int
    size: int  # ranks in the expert-parallel group
    rank: int  # this rank's index in the group
    group: ProcessGroup | None  # None when size is 1: no communication at all

    @classmethod
    def of(cls, *, num_experts: int, group: ProcessGroup | None) -> ExpertShard:
        size = 1 if group is None else dist.get_world_size(group)
        if num_experts % size:
            raise ValueError(f"model.moe.num_experts ({num_experts}) not divisible by the expert-parallel size {size}")
        rank = 0 if group is None else dist.get_rank(group)
        return cls(num_experts=num_experts, size=size, rank=rank, group=group if size > 1 else None)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def first_expert(self) -> int:
        return self.rank * self.num_local_experts
