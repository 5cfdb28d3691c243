"""Expert parallelism: each rank of the expert-parallel group holds num_experts / ep experts of every MoE layer,
and tokens travel to their experts through the dispatcher the recipe names (alltoall | allgather).

The expert stacks become DTensors sharded on dim 0 (the expert index) over the expert mesh's ep dimension, so
checkpoints keep the full [E, ...] shapes and reshard; FSDP2 then shards each rank's experts further over edp
(data_parallel.py). The router stays replicated: every rank routes its own tokens over all experts. Each MoE
layer is also handed the groups its balancing losses count over. At ep = 1 the experts stay whole and either
dispatcher exchanges nothing.
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
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        module.dispatcher = dispatcher_for(moe.dispatcher, num_experts=moe.num_experts, group=ctx.group("ep"))
        module.balance_group = ctx.group("dp")
        if ctx.size("ep") > 1:
            experts = module.experts
            for name, param in list(experts.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.data, ctx.mesh("ep"), [Shard(0)], src_data_rank=None)
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
