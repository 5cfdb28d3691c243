"""Expert parallelism: hand every MoE layer the dispatcher the recipe names, over the expert-parallel group,
and the groups its balancing losses count over.

`model.moe.dispatcher` picks the class (alltoall | allgather); at ep = 1 either exchanges nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
        if isinstance(module, MoELayer):
            module.dispatcher = dispatcher_for(moe.dispatcher, num_experts=moe.num_experts, group=ctx.group("ep"))
            module.balance_group = ctx.group("dp")
