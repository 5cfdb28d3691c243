"""Models: norms, rope, attention (GQA + QK-norm, MLA), MLP, MoE, decoder and MTP; one builder for all families.

build_model builds on the meta device (no memory, no init cost, whatever the size), then materialises and
initialises by name (models.init), so the weights never depend on the device or the parallel layout.

The package loads no torch by itself: its torch-free part, the module declarations (models/declarations), is
what the login half's planner reads, so `Transformer` and `LossTerms` load models/model.py on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_train.config.schema import ModelConfig

if TYPE_CHECKING:
    import torch

    from moe_train.models.model import Transformer

__all__ = ["LossTerms", "Transformer", "build_model"]


def __getattr__(name: str):
    """`Transformer`, `LossTerms`: models/model.py (torch), imported when first asked for."""
    if name in ("LossTerms", "Transformer"):
        from moe_train.models import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(model_cfg: ModelConfig, *, device: torch.device | str = "cpu", seed: int = 0) -> Transformer:
    """An initialised Transformer of the recipe's `model` section; device="meta" returns it unmaterialised."""
    import torch

    from moe_train.models.init import init_weights, materialize
    from moe_train.models.model import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    if torch.device(device).type != "meta":
        materialize(model, device=device)
        init_weights(model, seed=seed, init_std=model_cfg.init_std)
    return model
