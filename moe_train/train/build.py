"""The one place a model is built for training: this rank's model chunks, with their weights and optimizers.

The trainer (a fresh start, a resume, `checkpoint.init_from`) and `moe-train measure` both build here, so what
measure counts is what the trainer runs. The model comes from its one constructor, `models.build_model`, on the
meta device (no memory, whatever its size; `fake`: directly as fake tensors, shapes only), is optionally cut to
some layers (`measure --layers`), given its expert placement (models/moe/placement.py), parallelised
(`moe_train.parallel.parallelize`) into this rank's chunks (the whole model, or its pipeline stages), then given
its weights: allocated and initialised by name (`init`, so the weights never depend on the device or the layout),
or allocated only (`empty`: a checkpoint fills every tensor). `convert to-hf` needs none of the training half
(checkpoint/ sits below train/): it builds the whole model with `models.build_model` on the meta device and
materialises it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from moe_train.config.placement import recipe_placement
from moe_train.models import build_model
from moe_train.models.fp8.select import apply_fp8
from moe_train.models.init import init_weights, materialize
from moe_train.models.model import Transformer
from moe_train.models.moe.placement import apply_placement
from moe_train.parallel import parallelize
from moe_train.parallel.pipeline import Pipeline, duplicate_parameters, keep_layers, shared_embedding_group
from moe_train.train.optimizer import build_optimizer
from moe_train.train.qk_clip import QKClip

if TYPE_CHECKING:
    import torch.distributed as dist

    from moe_train.config.schema import Recipe
    from moe_train.parallel.context import ParallelContext

Weights = Literal["init", "empty", "fake"]


@dataclass(frozen=True, kw_only=True)
class Trainable:
    """This rank's model chunks and what every step takes with them, built once (`build_training`)."""

    chunks: list[Transformer]  # the whole model alone, or this rank's pipeline stages in virtual-stage order
    optimizers: list[torch.optim.Optimizer]  # one per chunk: AdamW or Muon (with QK-clip as its post-step hook)
    pipeline: Pipeline | None  # the schedule over the stages, when pp > 1
    shared_embedding: dist.ProcessGroup | None  # first and last stage, when both hold the embedding
    duplicates: list[torch.nn.Parameter]  # a stage's copy of another's parameter: counted once in the norm
    model_keys: frozenset[str]  # the whole model's state-dict keys, which a checkpoint holds at every layout


def build_training(recipe: Recipe, ctx: ParallelContext, *, weights: Weights,
                   layers: tuple[int, ...] | None = None) -> Trainable:
    """This rank's chunks of the recipe's model in training mode, with their optimizers. `layers`: keep only
    these layer indices (MTP modules as num_layers + k), as `measure --layers` asks; None: every layer."""
    cfg = recipe.model
    if weights == "fake":
        with torch.device(ctx.device):  # inside measure's fake mode
            model = Transformer(cfg)
    else:
        model = build_model(cfg, device="meta")
    model_keys = frozenset(model.state_dict())
    if recipe.train.precision == "fp8":
        apply_fp8(model, recipe.train.fp8)
    if layers is not None:
        keep_layers(model, layers=[i for i in layers if i < cfg.num_layers],
                    mtp=[i - cfg.num_layers for i in layers if i >= cfg.num_layers])
    apply_placement(model, recipe_placement(recipe))
    chunks = parallelize(model, recipe, ctx)
    for chunk in chunks:
        if weights != "fake":
            materialize(chunk, device=ctx.device)
            if weights == "init":
                init_weights(chunk, seed=recipe.train.seed, init_std=cfg.init_std)
        chunk.train()
    optimizers = [build_optimizer(chunk, train=recipe.train) for chunk in chunks]
    muon = recipe.train.muon
    if recipe.train.optimizer == "muon" and muon.qk_clip is not None:
        for chunk, optimizer in zip(chunks, optimizers, strict=True):
            optimizer.register_step_post_hook(QKClip(chunk, threshold=muon.qk_clip, ctx=ctx))
    return Trainable(
        chunks=chunks,
        optimizers=optimizers,
        pipeline=Pipeline(chunks, recipe, ctx) if ctx.size("pp") > 1 else None,
        shared_embedding=shared_embedding_group(recipe, ctx),
        duplicates=duplicate_parameters(chunks),
        model_keys=model_keys,
    )
