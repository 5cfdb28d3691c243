"""The one place a model is built for training: this rank's model chunks, with their weights and optimizers.

The trainer (a fresh start, a resume, `checkpoint.init_from`), `moe-train measure` and `convert to-hf` all build
here, so what measure counts is what the trainer runs and a checkpoint is read into the model it was written
from. The model is built on the meta device (no memory, whatever its size; `fake`: directly as fake tensors,
shapes only), optionally cut to some layers (`measure --layers`), parallelised (`moe_train.parallel.parallelize`)
into this rank's chunks (the whole model, or its pipeline stages), then given its weights: allocated and
initialised by name (`init`, so the weights never depend on the device or the layout), or allocated only
(`empty`: a checkpoint fills every tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from moe_train.models.init import init_weights, materialize
from moe_train.models.model import Transformer
from moe_train.parallel import parallelize
from moe_train.parallel.pipeline import Pipeline, duplicate_parameters, keep_layers, shared_embedding_group
from moe_train.train.optimizer import build_optimizer

if TYPE_CHECKING:
    import torch.distributed as dist

    from moe_train.config.schema import ModelConfig, Recipe
    from moe_train.parallel.context import ParallelContext

Weights = Literal["init", "empty", "fake"]


@dataclass(frozen=True, kw_only=True)
class Trainable:
    """This rank's model chunks and what every step takes with them, built once (`build_training`)."""

    chunks: list[Transformer]  # the whole model alone, or this rank's pipeline stages in virtual-stage order
    optimizers: list[torch.optim.Optimizer]  # one AdamW per chunk
    pipeline: Pipeline | None  # the schedule over the stages, when pp > 1
    shared_embedding: dist.ProcessGroup | None  # first and last stage, when both hold the embedding
    duplicates: list[torch.nn.Parameter]  # a stage's copy of another's parameter: counted once in the norm
    model_keys: frozenset[str]  # the whole model's state-dict keys, which a checkpoint holds at every layout


def _give_weights(chunk: Transformer, *, weights: Weights, device: torch.device | str, seed: int,
                  init_std: float) -> None:
    if weights == "fake":
        return
    materialize(chunk, device=device)
    if weights == "init":
        init_weights(chunk, seed=seed, init_std=init_std)


def build_whole_model(model_cfg: ModelConfig, *, weights: Weights, device: torch.device | str = "cpu",
                      seed: int = 0) -> Transformer:
    """The whole model, unparallelised, on `device` (`convert to-hf` reads a checkpoint of any layout into it)."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    _give_weights(model, weights=weights, device=device, seed=seed, init_std=model_cfg.init_std)
    return model


def build_training(recipe: Recipe, ctx: ParallelContext, *, weights: Weights,
                   layers: tuple[int, ...] | None = None) -> Trainable:
    """This rank's chunks of the recipe's model in training mode, with their optimizers. `layers`: keep only
    these layer indices (MTP modules as num_layers + k), as `measure --layers` asks; None: every layer."""
    cfg = recipe.model
    with torch.device(ctx.device if weights == "fake" else "meta"):
        model = Transformer(cfg)
    model_keys = frozenset(model.state_dict())
    if layers is not None:
        keep_layers(model, layers=[i for i in layers if i < cfg.num_layers],
                    mtp=[i - cfg.num_layers for i in layers if i >= cfg.num_layers])
    chunks = parallelize(model, recipe, ctx)
    for chunk in chunks:
        _give_weights(chunk, weights=weights, device=ctx.device, seed=recipe.train.seed, init_std=cfg.init_std)
        chunk.train()
    return Trainable(
        chunks=chunks,
        optimizers=[build_optimizer(chunk, train=recipe.train) for chunk in chunks],
        pipeline=Pipeline(chunks, recipe, ctx) if ctx.size("pp") > 1 else None,
        shared_embedding=shared_embedding_group(recipe, ctx),
        duplicates=duplicate_parameters(chunks),
        model_keys=model_keys,
    )
