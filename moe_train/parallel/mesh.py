"""The dense and expert DeviceMeshes, built from config/mesh_shape.py's MeshShape (the torch-free layout math,
so login-node tools print the same rank table the entry does; see there for the dimensions and rank order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_train.config.mesh_shape import DENSE_DIMS, EXPERT_DIMS, MeshShape

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Meshes:
    """The two DeviceMeshes over all ranks; sub-groups by name, e.g. `dense["tp"]`, `expert["ep"]`."""

    shape: MeshShape
    dense: DeviceMesh
    expert: DeviceMesh


def build_meshes(shape: MeshShape, device_type: str, *, distinct_groups: bool = False) -> Meshes:
    """Create both meshes (and their process groups) on an initialised default process group.

    Every rank must call this, in the same order: each mesh dimension makes a collective new_group. A dimension
    that spans every rank reuses the default group, so two such dimensions (dp and ep, say) share one group;
    `distinct_groups` gives each its own instead (`moe-train measure` names every collective by its group).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    problems = shape.problems(world)
    if problems:
        raise ValueError("; ".join(problems))

    def own_groups(names: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, str] | None:
        if not distinct_groups:
            return None
        return {name: dist.get_backend() for name, size in zip(names, sizes, strict=True) if size == world > 1}

    dense = init_device_mesh(device_type, shape.dense, mesh_dim_names=DENSE_DIMS,
                             backend_override=own_groups(DENSE_DIMS, shape.dense))
    expert = init_device_mesh(device_type, shape.expert, mesh_dim_names=EXPERT_DIMS,
                              backend_override=own_groups(EXPERT_DIMS, shape.expert))
    return Meshes(shape=shape, dense=dense, expert=expert)
