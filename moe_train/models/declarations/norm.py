"""The decoder block's two pre-norms (models/norm.py RMSNorm over the hidden size, on the sequence region)."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .parts import Module, Param
from .saves import Saved, norm_items

PRE_NORMS = ("input_layernorm", "post_attention_layernorm")  # the block's names (models/decoder.py)


def declare(cfg: ModelConfig, *, name: str) -> Module:
    """A pre-norm's weight [h], whole on every tp rank (its gradient partial under SP); no GEMM."""
    return Module(name, (Param(f"{name}.weight", (cfg.hidden_size,), "sequence"),))


def saved(cfg: ModelConfig, lay: ActivationLayout, *, name: str) -> list[Saved]:
    """Its input (the residual stream, sequence-sharded under SP) and the fp32 reciprocal rms."""
    return norm_items(name, name, lay.seq_tokens, cfg.hidden_size, lay.act_bytes)
