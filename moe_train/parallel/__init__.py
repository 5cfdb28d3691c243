"""How a model is trained on many ranks: the parallel context and `parallelize`, which applies every kind of
parallelism from outside the model, in a fixed order.

Models know nothing of process groups; `parallelize` changes a meta-device model in place, each step in its
own file and a no-op where its dimension is 1, only through the points the model's modules declare
(parallel/layout.py: no class swaps, no rebound methods). The order matters: a pipeline split decides which layers a
rank holds (one model chunk per virtual stage, each then parallelised as a whole model is); tensor parallelism
turns their weights into sharded DTensors; context parallelism makes attention span the cp ranks' shards of
each sequence (and sets the MoE layers' token groups, over cp and tp); expert parallelism hands MoE layers their
dispatcher; recomputation wraps regions of the (now parallel) modules, and offloading others
(parallel/offload.py); regional compilation compiles each block with them (train.compile,
parallel/compile.py); FSDP2 shards what remains over the data-parallel dimensions
(dp x cp for dense parameters) last, around everything else (each chunk its own root). Steps not built yet are
refused by `moe_train.config.support` before a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.model import Transformer
    from moe_train.parallel.context import ParallelContext


def parallelize(model: Transformer, recipe: Recipe, ctx: ParallelContext) -> list[Transformer]:
    """Apply the recipe's layout to `model` (built on the meta device) for this rank; returns this rank's model
    chunks in virtual-stage order (the whole model alone without pipeline parallelism)."""
    from moe_train.config.loss_chunks import recipe_loss_chunk_tokens
    from moe_train.parallel.compile import apply_compile
    from moe_train.parallel.context_parallel import apply_context_parallel
    from moe_train.parallel.data_parallel import apply_fsdp
    from moe_train.parallel.expert import apply_expert_parallel
    from moe_train.parallel.offload import apply_offload
    from moe_train.parallel.pipeline import split_model
    from moe_train.parallel.recompute import apply_recompute
    from moe_train.parallel.tensor import apply_tensor_parallel

    chunks = split_model(model, recipe, ctx)
    for chunk in chunks:
        apply_tensor_parallel(chunk, recipe, ctx)
        chunk.lm_loss.chunk_tokens = recipe_loss_chunk_tokens(recipe)  # the loss tensor parallelism chose
        apply_context_parallel(chunk, recipe, ctx)
        apply_expert_parallel(chunk, recipe, ctx)
        apply_recompute(chunk, recipe)
        apply_offload(chunk, recipe, ctx.device)
        apply_compile(chunk, recipe, ctx.device)
        apply_fsdp(chunk, recipe, ctx)
    return chunks
