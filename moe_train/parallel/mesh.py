"""The dense and expert device meshes: two views of the same ranks (parallel folding).

Attention and dense layers shard over the dense mesh (pp, dp, cp, tp); MoE layers over the expert mesh
(pp, edp, ep, etp). Within a pipeline stage both meshes cover the same dp*cp*tp == edp*ep*etp ranks, so expert
parallelism can span ranks that attention uses for TP or DP, and etp is independent of tp. Both meshes number
ranks row-major with the last dimension fastest, the order init_device_mesh uses: tp and etp neighbours are
adjacent ranks (same node), pp is outermost.

The layout math (`MeshShape`) is torch-free, so login-node tools can print the same rank table the entry does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from moe_train.config import Recipe

DENSE_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")


@dataclass(frozen=True)
class MeshShape:
    """Sizes of both meshes; `world_size` = pp*dp*cp*tp = pp*edp*ep*etp when `problems()` is empty."""

    pp: int
    dp: int
    cp: int
    tp: int
    edp: int
    ep: int
    etp: int

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> MeshShape:
        p = recipe.parallel
        return cls(pp=p.pp, dp=recipe.dp, cp=p.cp, tp=p.tp, edp=recipe.edp, ep=p.ep, etp=p.etp)

    @property
    def dense(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def expert(self) -> tuple[int, int, int, int]:
        return (self.pp, self.edp, self.ep, self.etp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def problems(self, world_size: int) -> list[str]:
        """Why these meshes cannot cover `world_size` ranks (empty when they can)."""
        out = []
        if self.world_size != world_size:
            out.append(f"dense mesh pp {self.pp} x dp {self.dp} x cp {self.cp} x tp {self.tp} = {self.world_size} "
                       f"ranks, not the world size {world_size}")
        folded = self.dp * self.cp * self.tp
        if self.edp * self.ep * self.etp != folded:
            out.append(f"expert mesh edp {self.edp} x ep {self.ep} x etp {self.etp} = "
                       f"{self.edp * self.ep * self.etp} ranks per stage, not dp*cp*tp = {folded}")
        return out

    def dense_coords(self, rank: int) -> tuple[int, int, int, int]:
        return _unravel(rank, self.dense)

    def expert_coords(self, rank: int) -> tuple[int, int, int, int]:
        return _unravel(rank, self.expert)


def _unravel(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def format_coords(shape: MeshShape, rank: int) -> str:
    """`pp 0 dp 1 cp 0 tp 0 | edp 1 ep 0 etp 0`: a rank's place in both meshes, as the layout computes it."""
    return coords_text(shape.dense_coords(rank), shape.expert_coords(rank))


def coords_text(dense: Sequence[int], expert: Sequence[int]) -> str:
    """Coordinates in the dense and expert meshes as `format_coords` writes them (expert pp, the same, left out)."""
    dense_part = " ".join(f"{n} {c}" for n, c in zip(DENSE_DIMS, dense, strict=True))
    expert_part = " ".join(f"{n} {c}" for n, c in zip(EXPERT_DIMS[1:], expert[1:], strict=True))
    return f"{dense_part} | {expert_part}"


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
