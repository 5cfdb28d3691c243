"""Expert parallelism: each rank of the expert-parallel group holds num_experts / ep experts of every MoE layer,
and tokens travel to their experts through the dispatcher the recipe names (alltoall | allgather). Expert
tensor parallelism (etp) splits each expert's FFN dimension further: gate and up by rows, down by columns (the
stacks are separate parameters, so no rank ever holds a fused [gate; up] split down the middle), and the
partial outputs are summed by the allgather dispatcher's reduce-scatter over the ep x etp ranks.

The expert stacks become DTensors over the expert mesh's (ep, etp) dimensions (dim 0, the expert index, over
ep), so checkpoints keep the full [E, ...] shapes and reshard; FSDP2 then shards each rank's experts further
over edp (data_parallel.py). The router stays replicated: every rank routes its own tokens over all experts.
Each MoE layer is also handed the groups its balancing losses count over. At ep = etp = 1 the experts stay
whole and either dispatcher exchanges nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from moe_train.models.moe import MoELayer
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
    # allgather gathers over the ep x etp ranks (etp fastest); alltoall exchanges over ep (etp = 1, rules.py).
    group = ctx.mesh("ep_etp").get_group() if etp > 1 else ctx.group("ep")
    sharded = ctx.size("ep") * etp > 1
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        module.dispatcher = dispatcher_for(moe.dispatcher, num_experts=moe.num_experts, group=group,
                                           expert_tp_size=etp)
        module.balance_group = ctx.group("dp")
        if sharded:
            _shard_experts(module.experts, ctx)


def _shard_experts(experts: nn.Module, ctx: ParallelContext) -> None:
    """Experts over ep (dim 0); the FFN dimension I over etp: rows of gate/up [E, I, H], columns of down [E, H, I]."""
    mesh = ctx.expert["ep", "etp"]
    for name, param in list(experts.named_parameters(recurse=False)):
        ffn_dim = 2 if name == "down_proj" else 1
        sharded = distribute_tensor(param.data, mesh, [Shard(0), Shard(ffn_dim)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
