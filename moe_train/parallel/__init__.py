"""How a model is trained on many ranks: the parallel context and `parallelize`, which applies every kind of
parallelism from outside the model, in a fixed order.

Models know nothing of process groups; `parallelize` changes a meta-device model in place, each step in its
own file and a no-op where its dimension is 1. The order matters: a pipeline split decides which layers a
rank holds; tensor parallelism turns their weights into sharded DTensors; expert parallelism hands MoE layers
their dispatcher; recomputation wraps regions of the (now parallel) modules; FSDP2 shards what remains over
the data-parallel dimensions last, around everything else. Steps not built yet are refused by
`moe_train.config.support` before a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.model import Transformer
    from moe_train.parallel.context import ParallelContext


def parallelize(model: Transformer, recipe: Recipe, ctx: ParallelContext) -> Transformer:
    """Apply the recipe's layout to `model` (built on the meta device) for this rank; returns the model."""
    from moe_train.parallel.data_parallel import apply_fsdp
    from moe_train.parallel.expert import apply_expert_parallel

    apply_expert_parallel(model, recipe, ctx)
    apply_fsdp(model, recipe, ctx)
    return model
