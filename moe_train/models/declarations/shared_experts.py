"""The shared experts (models/moe/layer.py's `shared_experts`, an MLP of `moe.shared_expert_ffn_hidden_size`):
tensor-parallel like the dense MLP, run before the dispatch on the router's input."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .mlp import swiglu
from .parts import Module
from .saves import Saved, swiglu_items

NAME = "shared_experts"


def declare(cfg: ModelConfig) -> Module | None:
    """None where the layer has none (width 0)."""
    width = cfg.moe.shared_expert_ffn_hidden_size
    return swiglu(NAME, cfg.hidden_size, width) if width else None


def saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """The SwiGLU's saves on the ffn shard over the tp ranks' gathered tokens. Its input is the norm's output,
    which the router keeps already (one storage); its gate and up keep that storage in fp8 runs too
    (models/fp8/select.py), the down projection its own."""
    width = cfg.moe.shared_expert_ffn_hidden_size
    if not width:
        return []
    return swiglu_items(NAME, NAME, lay.tokens, width / lay.tp, lay.act_bytes, lay.kept_fp8(NAME))
