"""Regional compilation (`train.compile`): each decoder block compiled on its own, as torchtitan applies it.

One block per compile region, not the whole model: blocks of a kind are alike, so each kind compiles once and
every other block of that kind reuses its code (a graph per block kind, guarded on the block's own
parameters), and the whole-model parts that differ by stage (embedding, head, the loss, MTP's glue) stay
eager. The order in `parallelize`: after tensor and expert parallelism (the compiled code calls their
collectives and DTensor shards) and recomputation (a block's checkpointed regions are traced with it; full
recomputation checkpoints whole blocks from outside, where its rerun calls the compiled block again), before
FSDP2, whose per-block hooks then wrap the compiled forward (torchtitan's order).

`nn.Module.compile` compiles the block in place: no wrapper module, so parameter names (and checkpoints) stay
the plain model's. Dropless routing makes token counts vary from step to step wherever experts receive
another rank's rows (expert parallelism: the rows an all-to-all or all-gather brings), so MoE blocks are
compiled with dynamic shapes from the start (`dynamic=True`): a step never recompiles for a new count. Dense
blocks keep static shapes (dynamic=None: recompiled only if a shape ever changes, which it does not within a
run). Host reads of the counts (one per dispatch, docs/gpu.md) are graph breaks, as in eager they are syncs.

Recomputation: a region checkpointed inside a block (selective) is traced into the block's graph, whose
partitioner recomputes it in the compiled backward (parallel/recompute.py `recomputed`): no Python reruns, so
MoE telemetry and balancing-loss collectives run once without the recompute flag. A region checkpointed
around compiled code (full recomputation's groups, the `moe` policy's MoE layer) reruns it from Python, where
the MoE layer reads the flag (`in_recomputation`) and skips its telemetry: a compiled MoE layer would then
run another graph in the rerun than in the forward, saving other tensors, which checkpoint rejects. So under
those policies the MoE layer stays eager inside its compiled block (attention and norms compiled); dense
blocks do not read the flag and compile whole under every policy.

`MOE_TRAIN_COMPILE_BACKEND` (unset: inductor) names another torch.compile backend: the tests run the layout
cases with `aot_eager` (autograd traced and partitioned as inductor's, without code generation, which takes
minutes on the development machine's two cores).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from moe_train.kernels import kernels_for
from moe_train.models.decoder import DecoderBlock
from moe_train.parallel.layout import wrap_region

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.model import Transformer

BACKEND_ENV = "MOE_TRAIN_COMPILE_BACKEND"


def compile_enabled(recipe: Recipe, device: torch.device) -> bool:
    """train.compile, or the device's default (moe_train/kernels.py) when it is null."""
    setting = recipe.train.compile
    return kernels_for(device.type).compile if setting is None else setting


def compile_backend() -> str:
    return os.environ.get(BACKEND_ENV, "inductor")


def _plain_output(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The vocabulary-parallel embedding's output as a plain tensor: DTensor's redistribution hands back an
    AsyncCollectiveTensor, and a compiled block given one as its input returned no gradient for it (the
    embedding's gradient was lost under TP2). A copy, which autograd connects as any op on it."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def apply_compile(model: Transformer, recipe: Recipe, device: torch.device) -> None:
    """Compile every decoder block of `model` (MTP modules' blocks too) in place, when enabled."""
    if not compile_enabled(recipe, device):
        return
    if model.embed_tokens is not None:
        model.embed_tokens.register_forward_hook(_plain_output)
    backend = compile_backend()
    policy = recipe.parallel.recompute
    moe_rerun = policy.granularity == "full" or (policy.granularity == "selective" and "moe" in policy.modules)
    for block in model.modules():
        if isinstance(block, DecoderBlock):
            # (the MoE layer's balancing losses are attached eagerly always: models/moe/layer.py)
            if block.is_moe and moe_rerun:
                wrap_region(block.ffn.layout_forward, torch.compiler.disable, reason="compile: eager MoE layer")
            block.compile(backend=backend, dynamic=True if block.is_moe else None)
