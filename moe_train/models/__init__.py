"""Models: norms, rope, attention (GQA + QK-norm, MLA), MLP, MoE, decoder and MTP; one builder for all families.

build_model builds on the meta device (no memory, no init cost, whatever the size), then materialises and
initialises by name (models.init), so the weights never depend on the device or the parallel layout.
"""

from __future__ import annotations

import torch

from moe_train.config.schema import ModelConfig
from moe_train.models.init import init_weights, materialize
from moe_train.models.model import LossTerms, Transformer

__all__ = ["LossTerms", "Transformer", "build_model"]


def build_model(model_cfg: ModelConfig, *, device: torch.device | str = "cpu", seed: int = 0) -> Transformer:
    """An initialised Transformer of the recipe's `model` section; device="meta" returns it unmaterialised."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    if torch.device(device).type != "meta":
        materialize(model, device=device)
        init_weights(model, seed=seed, init_std=model_cfg.init_std)
    return model
