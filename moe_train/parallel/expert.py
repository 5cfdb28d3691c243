"""Expert parallelism: each rank of the expert-parallel group holds num_experts / ep experts of every MoE layer,
and tokens travel to their experts through the dispatcher the recipe names (alltoall | allgather |
hierarchical, which splits the ep group at node boundaries: `node_split`). Expert
tensor parallelism (etp) splits each expert's FFN dimension further: gate and up by rows, down by columns (the
stacks are separate parameters, so no rank ever holds a fused [gate; up] split down the middle), and the
partial outputs are summed by the allgather dispatcher's reduce-scatter over the ep x etp ranks.

The expert stacks become DTensors over the expert mesh's (ep, etp) dimensions (dim 0, the expert index, over
ep), so checkpoints keep the full [E, ...] shapes and reshard; FSDP2 then shards each rank's experts further
over edp (data_parallel.py). The router stays replicated: every rank routes its own tokens over all experts.
Each MoE layer is also handed the groups its balancing losses count over, and under `parallel.split_wgrad` one
queue its experts' delayed weight gradients wait in and its dispatcher runs (models/moe/deferred_wgrad.py).
At ep = etp = 1 the experts stay whole and either dispatcher exchanges nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from moe_train.config.mesh_shape import dispatch_node_ranks, ep_node_split_problem, ep_split
from moe_train.models.moe import MoELayer
from moe_train.models.moe.deferred_wgrad import DeferredWeightGrads
from moe_train.models.moe.dispatcher import dispatcher_for

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.model import Transformer
    from moe_train.parallel.context import ParallelContext


def apply_expert_parallel(model: Transformer, recipe: Recipe, ctx: ParallelContext) -> None:
    moe = recipe.model.moe
    if moe is None:
        return
    etp = ctx.size("etp")
    # allgather gathers over the ep x etp ranks (etp fastest); alltoall exchanges over ep (etp = 1, rules.py);
    # hierarchical over the ep ranks inside this node and, across nodes, those of this rank's local index.
    group = ctx.mesh("ep_etp").get_group() if etp > 1 else ctx.group("ep")
    node_group = None
    if moe.dispatcher == "hierarchical":
        group, node_group = node_split(ctx, node_ranks=dispatch_node_ranks(recipe))
    sharded = ctx.size("ep") * etp > 1
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        module.dispatcher = dispatcher_for(moe.dispatcher, num_experts=moe.num_experts, group=group,
                                           expert_tp_size=etp, node_group=node_group)
        module.balance_group = ctx.group("dp")
        if sharded:
            _shard_experts(module.experts, ctx)
        if recipe.parallel.split_wgrad:  # validate: EP communication, pp 1
            module.experts.deferred_wgrad = module.dispatcher.deferred_wgrad = DeferredWeightGrads()


def node_split(ctx: ParallelContext, *, node_ranks: int):
    """(eplocal, epnode): the ep group split into this node's ranks and, across nodes, the ranks of this rank's
    local index (a node: `node_ranks` consecutive ranks, the NVLink domain; on CPU an emulated node), as mesh
    dimensions named without `_` (measure counts their bytes under these names: `ctx.named_groups`). Every rank
    makes every group, in one order (a DeviceMesh over the expert mesh with ep unflattened). Either is None
    where it has one rank."""
    from torch.distributed.device_mesh import DeviceMesh

    if "eplocal" in ctx.named_groups or "epnode" in ctx.named_groups:  # one split per context (every chunk)
        return ctx.named_groups.get("eplocal"), ctx.named_groups.get("epnode")
    shape = ctx.shape
    problem = ep_node_split_problem(world_size=shape.world_size, ep=shape.ep, etp=shape.etp, node_ranks=node_ranks)
    if problem is not None:  # validate refuses the recipe (config/rules.py); a hand-made context may not be one
        raise ValueError(f"parallel.ep: {problem}")
    _, local = ep_split(shape, node_ranks)
    # (pp, edp, ep, etp) -> (pp, edp, epnode, eplocal, etp), on the host's rank table: under `measure --fake`
    # a tensor op would run in fake mode
    ranks = [[[row[n: n + local] for n in range(0, len(row), local)] for row in stage]
             for stage in ctx.expert.mesh.tolist()]
    mesh = DeviceMesh(ctx.expert.device_type, ranks, mesh_dim_names=("pp", "edp", "epnode", "eplocal", "etp"))
    split = {}
    for name in ("eplocal", "epnode"):
        if mesh[name].size() > 1:
            split[name] = ctx.named_groups[name] = mesh[name].get_group()
    return split.get("eplocal"), split.get("epnode")


def _shard_experts(experts: nn.Module, ctx: ParallelContext) -> None:
    """Experts over ep (dim 0); the FFN dimension I over etp: rows of gate/up [E, I, H], columns of down [E, H, I],
    and gpt-oss's gate/up biases [E, I] with their rows; its down bias [E, H] is whole on every etp rank and added
    by etp rank 0's partial sum only (`GroupedExperts.adds_down_bias`: the reduce adds it once)."""
    mesh = ctx.expert["ep", "etp"]
    experts.adds_down_bias = ctx.coord("etp") == 0
    for name, param in list(experts.named_parameters(recurse=False)):
        ffn = {"down_proj": Shard(2), "down_proj_bias": Replicate()}.get(name, Shard(1))
        sharded = distribute_tensor(param.data, mesh, [Shard(0), ffn], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
