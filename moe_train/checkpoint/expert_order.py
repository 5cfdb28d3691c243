"""Checkpoints keep experts by global id whatever the placement: DCP planners that write each slot's row of an
expert stack (and of its optimizer moments) at its expert's index, and read it back from there.

Under a placement (models/moe/placement.py) row s of a stack holds expert `expert_ids[s]`; a rank's shard is a
contiguous run of slots, which under a permutation is no contiguous run of experts, so the default planners'
one chunk per shard cannot say where its rows belong. These planners split such a shard into one chunk per row,
at offset `expert_ids[s]` of dim 0, and DCP's own resharding does the rest: a checkpoint written under one
placement (or the contiguous one, which writes as it always did) loads under any other, optimizer state
included. Only the stacks of placed layers are touched; every other tensor goes through the default planners.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from moe_train.models.init import local_region


class _PlacedKeys:
    """Which flattened state-dict keys are placed expert stacks: `model.<stack>` and `optim.state.<stack>.<x>`
    (the moments; a scalar step count is left alone)."""

    def __init__(self, stacks: dict[str, tuple[int, ...]]):
        self.stacks = stacks

    def expert_ids(self, key: str, value) -> tuple[int, ...] | None:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        if key.startswith("model."):
            return self.stacks.get(key[len("model.") :])
        if key.startswith("optim.state."):
            stack, _, _ = key[len("optim.state.") :].rpartition(".")
            ids = self.stacks.get(stack)
            return ids if ids is not None and value.shape[0] == len(ids) else None
        return None


def _shard(value: torch.Tensor) -> tuple[torch.Tensor, int, list[int]]:
    """(this rank's rows, the first slot they hold, the offsets of their other dims)."""
    region = local_region(value)
    local = value.to_local() if isinstance(value, DTensor) else value
    return local, region[0].start, [r.start for r in region[1:]]


def _row_chunks(value: torch.Tensor, ids: tuple[int, ...]) -> list[ChunkStorageMetadata]:
    """One chunk per row of this rank's shard, at its expert's index."""
    local, first, rest = _shard(value)
    return [
        ChunkStorageMetadata(offsets=torch.Size([ids[first + j], *rest]), sizes=torch.Size([1, *local.shape[1:]]))
        for j in range(local.shape[0])
    ]


def _row(value: torch.Tensor, ids: tuple[int, ...], expert: int) -> torch.Tensor:
    """The row of this rank's shard that holds `expert` (a view)."""
    local, first, _ = _shard(value)
    return local.narrow(0, ids.index(expert) - first, 1)


class ExpertOrderSavePlanner(DefaultSavePlanner):
    def __init__(self, stacks: dict[str, tuple[int, ...]]):
        super().__init__()
        self.placed = _PlacedKeys(stacks)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            value = self.state_dict.get(item.index.fqn)
            ids = self.placed.expert_ids(item.index.fqn, value)
            if ids is None:
                items.append(item)
                continue
            for chunk in _row_chunks(value, ids):
                items.append(
                    WriteItem(
                        index=MetadataIndex(item.index.fqn, chunk.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=chunk, properties=item.tensor_data.properties, size=item.tensor_data.size
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        value = self.state_dict.get(write_item.index.fqn)
        ids = self.placed.expert_ids(write_item.index.fqn, value)
        if ids is None:
            return super().resolve_data(write_item)
        return _row(value, ids, write_item.index.offset[0]).clone()  # an owned row, not a view of the shard


class ExpertOrderLoadPlanner(DefaultLoadPlanner):
    def __init__(self, stacks: dict[str, tuple[int, ...]]):
        super().__init__()
        self.placed = _PlacedKeys(stacks)

    def create_local_plan(self) -> LoadPlan:
        placed = {
            key: ids
            for key, value in self.state_dict.items()
            if (ids := self.placed.expert_ids(key, value)) is not None
        }
        # The default plan of the other keys (not super's create_local_plan: keys missing from the state dict
        # make it fall back to the whole unflattened one, as for a checkpoint older than torch 2.4).
        others = {key: value for key, value in self.state_dict.items() if key not in placed}
        plan = create_default_local_load_plan(others, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for key, ids in placed.items():
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], _row_chunks(self.state_dict[key], ids)
            )
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        ids = self.placed.expert_ids(index.fqn, value)
        if ids is None:
            return super().lookup_tensor(index)
        return _row(value, ids, index.offset[0])
