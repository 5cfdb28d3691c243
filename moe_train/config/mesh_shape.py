"""The dense and expert mesh shapes: two views of the same ranks (parallel folding), torch-free.

Attention and dense layers shard over the dense mesh (pp, dp, cp, tp); MoE layers over the expert mesh
(pp, edp, ep, etp). Within a pipeline stage both meshes cover the same dp*cp*tp == edp*ep*etp ranks, so expert
parallelism can span ranks that attention uses for TP or DP, and etp is independent of tp. Both meshes number
ranks row-major with the last dimension fastest, the order init_device_mesh uses: tp and etp neighbours are
adjacent ranks (same node), pp is outermost.

HSDP (`parallel.dp_replicate` > 1) splits dp into dpr x dps (replicas outer, so a replica's shards are the
nearer ranks, within a node) and edp into dpr x edps, the same dpr: a rank's replica index is one number in
both meshes, since both number a stage's ranks row-major with dp (edp) outermost. The split names have no `_`,
which joins flattened dimensions (`dp_cp`).

This is the one statement of the mesh dimensions: the recipe derives dp and edp here, the planner its rank
strides, parallel/mesh.py the DeviceMeshes and the entry its rank table. A new dimension is added to the
tuples and to MeshShape, nowhere else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.config.schema import ParallelConfig, Recipe

# Outermost first. Both start with pp; the second dimension is the data-parallel one, derived from the others.
DENSE_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")
# HSDP's split of each data-parallel dimension: replicas (outer) x shards, the 2-D mesh FSDP2 is given.
DENSE_DP_SPLIT = ("dpr", "dps")
EXPERT_DP_SPLIT = ("dpr", "edps")


def ranks_beside_dp(parallel: ParallelConfig) -> int:
    """The product of the dense dimensions other than dp (pp*cp*tp): the world size is dp times this."""
    return math.prod(getattr(parallel, dim) for dim in DENSE_DIMS if dim != "dp")


def stage_ranks(dp: int, parallel: ParallelConfig) -> int:
    """The ranks of one pipeline stage (dp*cp*tp: every dense dimension but pp), which the expert mesh folds onto."""
    return dp * math.prod(getattr(parallel, dim) for dim in DENSE_DIMS[2:])


def ranks_beside_edp(parallel: ParallelConfig) -> int:
    """The product of the expert dimensions within a stage other than edp (ep*etp)."""
    return math.prod(getattr(parallel, dim) for dim in EXPERT_DIMS[2:])


def data_parallel_size(world_size: int, parallel: ParallelConfig) -> int | None:
    """`parallel.dp` as written, else the world size over the other dense dimensions when that divides it.

    None when it does not divide: the rules report that, and a dp guessed from it (a floor division) would add
    problems the user does not have, such as a batch size that seems not to divide.
    """
    if parallel.dp is not None:
        return parallel.dp
    others = ranks_beside_dp(parallel)
    return None if world_size % others else world_size // others


def expert_data_parallel_size(dp: int | None, parallel: ParallelConfig) -> int | None:
    """edp: the expert mesh folds onto a stage's ranks. None when dp is undefined or the other expert dimensions
    do not divide a stage's ranks."""
    if dp is None:
        return None
    per_stage, others = stage_ranks(dp, parallel), ranks_beside_edp(parallel)
    return None if per_stage % others else per_stage // others


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
    dpr: int = 1  # HSDP replicas (`parallel.dp_replicate`), splitting dp and edp

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> MeshShape:
        p = recipe.parallel
        return cls(pp=p.pp, dp=recipe.dp, cp=p.cp, tp=p.tp, edp=recipe.edp, ep=p.ep, etp=p.etp, dpr=p.dp_replicate)

    @property
    def dps(self) -> int:
        """Dense shards per replica: the ranks a dense parameter is sharded over (dp under plain FSDP)."""
        return self.dp // self.dpr

    @property
    def edps(self) -> int:
        """Expert shards per replica: the ranks a routed expert is sharded over (edp under plain FSDP)."""
        return self.edp // self.dpr

    @property
    def dense(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in DENSE_DIMS)

    @property
    def expert(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in EXPERT_DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.dense)

    @property
    def ranks_per_stage(self) -> int:
        """The ranks of one pipeline stage (dp*cp*tp), which hold the same layers."""
        return math.prod(self.dense[1:])

    def problems(self, world_size: int) -> list[str]:
        """Why these meshes cannot cover `world_size` ranks (empty when they can)."""
        out = []
        if self.world_size != world_size:
            sizes = " x ".join(f"{dim} {getattr(self, dim)}" for dim in DENSE_DIMS)
            out.append(f"dense mesh {sizes} = {self.world_size} ranks, not the world size {world_size}")
        folded, expert = self.ranks_per_stage, math.prod(self.expert[1:])
        if expert != folded:
            sizes = " x ".join(f"{dim} {getattr(self, dim)}" for dim in EXPERT_DIMS[1:])
            out.append(f"expert mesh {sizes} = {expert} ranks per stage, not {'*'.join(DENSE_DIMS[1:])} = {folded}")
        for dim in ("dp", "edp"):
            if getattr(self, dim) % self.dpr:
                out.append(f"dpr {self.dpr} (HSDP replicas) does not divide {dim} {getattr(self, dim)}")
        return out

    def strides(self, dims: tuple[str, ...]) -> dict[str, int]:
        """How far apart in rank numbers two neighbours along each dimension of the mesh `dims` are."""
        out, running = {}, 1
        for dim in reversed(dims):
            out[dim] = running
            running *= getattr(self, dim)
        for whole, (replicas, shards) in (("dp", DENSE_DP_SPLIT), ("edp", EXPERT_DP_SPLIT)):
            if whole in out:  # HSDP's split: shards are the whole's neighbours, replicas dps (edps) of them apart
                out[shards], out[replicas] = out[whole], out[whole] * getattr(self, shards)
        return out

    def dense_coords(self, rank: int) -> tuple[int, ...]:
        return _unravel(rank, self.dense)

    def expert_coords(self, rank: int) -> tuple[int, ...]:
        return _unravel(rank, self.expert)


def dispatch_node_ranks(recipe: Recipe) -> int:
    """Consecutive ranks that make one "node" for the hierarchical dispatcher: the fast (NVLink) domain of the
    recipe's GPU (a node of 8 H100s, an NVL72 rack of GB200s); on CPU the emulated node, gpus_per_node ranks."""
    if recipe.launch.device != "cuda":
        return recipe.launch.gpus_per_node
    from moe_train.config.hardware import hardware_table

    return hardware_table()[recipe.launch.gpu].nvlink_domain


def ep_split(shape: MeshShape, node_ranks: int) -> tuple[int, int]:
    """(epnode, eplocal): the nodes an ep group spans and its ranks inside each (ep ranks are etp apart)."""
    local = _ep_local(shape.ep, shape.etp, node_ranks)
    return shape.ep // local, local


def _ep_local(ep: int, etp: int, node_ranks: int) -> int:
    return max(1, min(ep, node_ranks // etp))


def ep_node_split_problem(*, world_size: int, ep: int, etp: int, node_ranks: int) -> str | None:
    """Why the ep groups do not split into `ep_split`'s eplocal blocks each inside one node of `node_ranks`
    consecutive ranks (what the hierarchical dispatcher needs); None when they do.

    From the sizes alone, never a walk over ranks: an ep group is ep ranks etp apart inside an aligned block of
    ep*etp ranks, so its eplocal blocks tile the ranks in aligned spans of eplocal*etp. With eplocal > 1 some
    block holds ranks on both sides of a node boundary exactly when the world has more than one node and
    node_ranks is not a multiple of that span (the span holding the first boundary then straddles it)."""
    local = _ep_local(ep, etp, node_ranks)
    if ep % local:
        return (f"ep {ep} does not split into nodes of {local} ep ranks ({node_ranks} ranks per node, ep ranks "
                f"etp {etp} apart)")
    span = local * etp
    if local > 1 and world_size > node_ranks and node_ranks % span:
        return (f"the ep groups' node blocks of {local} ep ranks ({span} consecutive ranks, ep ranks etp {etp} "
                f"apart) straddle node boundaries: {node_ranks} ranks per node is not a multiple of {span}")
    return None


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
