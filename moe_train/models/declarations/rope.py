"""Rotary embeddings (models/rope.py): the tables are computed once per forward and shared by every layer, so
what a layer's rotations save is only their casts (no parameters, no GEMM)."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .saves import FP32, Saved


def saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """bf16 runs: FSDP2 casts each layer's floating-point inputs to bf16, the fp32 rotary tables among them, so
    the q and k rotations share one cast cos and sin [position rows, s, rotary_dim / 2] per layer (in region
    `attention`); the fp32 tables themselves are counted once per model, not here."""
    if lay.act_bytes == FP32:
        return []
    seq = lay.seq_length / lay.cp
    casts = 2 * lay.act_bytes * lay.position_batch * seq * cfg.rotary_dim / 2
    return [Saved("attention", "rope.cos_sin_casts", casts)]


def tables_saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """The fp32 cos and sin tables [position rows, s, rotary_dim / 2] one forward computes and every layer's
    rotations share, kept as they are in an fp32 run (a bf16 run keeps each layer's casts instead: `saved`)."""
    if lay.act_bytes != FP32:
        return []
    seq = lay.seq_length / lay.cp
    return [Saved("other", "rope.cos_sin", 2 * FP32 * lay.position_batch * seq * cfg.rotary_dim / 2)]
