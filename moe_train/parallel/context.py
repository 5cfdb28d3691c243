"""The parallel context: where this rank sits in both meshes, and the process groups the engine talks over.

Every part that needs to know about parallelism (the trainer, the data sampler, checkpointing, metrics,
`parallelize`) reads it from here, by name: `ctx.group("dp")`, `ctx.size("tp")`, `ctx.coord("ep")`. A dimension
the recipe does not use is a group of size 1, never None, so callers have no special cases; a collective over a
size-1 group is cheap and correct.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moe_train.config.mesh_shape import DENSE_DIMS, DENSE_DP_SPLIT, EXPERT_DIMS, EXPERT_DP_SPLIT, MeshShape

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    """One rank's view of the job: both meshes over the same ranks (parallel folding) and named views of them."""

    shape: MeshShape
    rank: int
    world_size: int
    device: torch.device
    dense: DeviceMesh  # (pp, dp, cp, tp)
    expert: DeviceMesh  # (pp, edp, ep, etp)
    # HSDP (dpr > 1): the same meshes with dp split (pp, dpr, dps, cp, tp) and edp split (pp, dpr, edps, ep, etp)
    dense_split: DeviceMesh | None = None
    expert_split: DeviceMesh | None = None
    owns_process_group: bool = False  # bootstrap created it, so `shutdown` destroys it
    distinct_groups: bool = False  # every dimension has its own process group (build_meshes)
    flattened: dict[str, DeviceMesh] = field(default_factory=dict, compare=False)  # made so far, by name
    # Groups outside both meshes, by the name byte counts use (`embedding`: parallel/pipeline.py).
    named_groups: dict[str, ProcessGroup] = field(default_factory=dict, compare=False)

    def mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of dimension `name` (dense: pp dp cp tp; expert: edp ep etp) that holds this rank, or of
        adjacent dimensions of one mesh flattened (`dp_cp`, `ep_etp`: the names joined by `_`). Flattening
        creates a process group: every rank must ask for the same flattened names in the same order."""
        if name in DENSE_DIMS:
            return self.dense[name]
        if name in EXPERT_DIMS:
            return self.expert[name]
        if name in (*DENSE_DP_SPLIT, *EXPERT_DP_SPLIT):
            if self.dense_split is None:
                if name == "dpr":
                    raise KeyError("mesh dimension 'dpr' exists under HSDP only (parallel.dp_replicate > 1)")
                return self.dense["dp"] if name == "dps" else self.expert["edp"]
            return self.dense_split[name] if name in DENSE_DP_SPLIT else self.expert_split[name]
        if name in self.flattened:
            return self.flattened[name]
        dims = tuple(name.split("_"))
        for mesh, names in ((self.dense, DENSE_DIMS), (self.expert, EXPERT_DIMS)):
            if len(dims) > 1 and set(dims) <= set(names):
                spans_world = mesh[dims].size() == self.world_size > 1
                own = _default_backend() if self.distinct_groups and spans_world else None
                self.flattened[name] = mesh[dims]._flatten(name, backend_override=own)
                return self.flattened[name]
        raise KeyError(f"unknown mesh dimension {name!r}; known: {', '.join(DENSE_DIMS + EXPERT_DIMS[1:])} "
                       "or adjacent ones joined by _")

    def fsdp_mesh(self, *, experts: bool) -> DeviceMesh:
        """The mesh FSDP2 shards over: dp (edp for experts apart from their block), or under HSDP the 2-D
        (dpr, dps) ((dpr, edps)) mesh, on which fully_shard replicates over dpr and shards over the other.
        Under context parallelism dense parameters shard over dp x cp (`dp_cp`): the cp ranks hold the same
        parameters and their gradients, each from its shard of the sequences, are summed; edp includes cp."""
        if self.dense_split is None:
            if experts:
                return self.expert["edp"]
            return self.mesh("dp_cp") if self.shape.cp > 1 else self.dense["dp"]
        return self.expert_split[EXPERT_DP_SPLIT] if experts else self.dense_split[DENSE_DP_SPLIT]

    def group(self, name: str) -> ProcessGroup:
        return self.mesh(name).get_group()

    def size(self, name: str) -> int:
        return getattr(self.shape, name)

    def coord(self, name: str) -> int:
        """This rank's index along dimension `name`."""
        return self.mesh(name).get_local_rank()

    @property
    def logs(self) -> bool:
        """Whether this rank writes metrics, COMPLETE and the summary: the one holding the loss (last pipeline
        stage) with dp = cp = tp = 0, so a job has exactly one such rank."""
        return self.coord("pp") == self.size("pp") - 1 and self.coord("dp") == 0 and self.coord("cp") == 0 and (
            self.coord("tp") == 0
        )

    def group_name(self, group: ProcessGroup) -> str:
        """The mesh dimension a process group belongs to (for per-group byte counts; flattened ones made so far
        and `named_groups` included); `world` for the default group when it is not one of the dimensions, `?`
        for a group this context did not create. Dimensions that share a group (see `distinct_groups`) go by
        the first of pp dp cp tp edp ep etp."""
        import torch.distributed as dist

        for name in (*DENSE_DIMS, *EXPERT_DIMS[1:], *self.flattened):
            if self.mesh(name).get_group() is group:
                return name
        for split, names in ((self.dense_split, DENSE_DP_SPLIT), (self.expert_split, EXPERT_DP_SPLIT)):
            for name in names if split is not None else ():
                if split[name].get_group() is group:  # the expert mesh's dpr is the dense dpr's ranks
                    return name
        for name, named in self.named_groups.items():
            if named is group:
                return name
        if group is None or group is dist.group.WORLD:
            return "world"
        return "?"


def _default_backend() -> str:
    import torch.distributed as dist

    return dist.get_backend()
