"""A decoder layer (models/decoder.py `DecoderBlock`) as its modules' declarations, in forward order: the input
norm, attention (MLA for deepseek_v3, GQA otherwise), the post-attention norm, then the feed-forward slot
(`ffn`): a dense MLP, or the MoE layer's router, routed experts and shared experts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

from moe_train.config.schema import ModelConfig

from . import attention, mla, mlp, norm, routed_experts, router, shared_experts
from .layout import ActivationLayout
from .parts import Module
from .saves import Saved

Declare = Callable[[ModelConfig], "Module | None"]
Saves = Callable[[ModelConfig, ActivationLayout], list[Saved]]


def attention_kind(cfg: ModelConfig) -> ModuleType:
    """The attention declaration the family's blocks hold (the declaration file: its declare, saved, recomputed,
    moved)."""
    return mla if cfg.family == "deepseek_v3" else attention


def _ffn_parts(moe_layer: bool) -> list[tuple[Declare, Saves]]:
    """(declare, saved) of each module of the feed-forward slot, in forward order."""
    if moe_layer:
        return [(router.declare, router.saved), (routed_experts.declare, routed_experts.saved),
                (shared_experts.declare, shared_experts.saved)]
    return [(mlp.declare, mlp.saved)]


def _parts(cfg: ModelConfig, moe_layer: bool) -> list[tuple[Declare, Saves]]:
    """(declare, saved) of each module of the layer, in forward order."""
    pre, post = ((functools.partial(norm.declare, name=n), functools.partial(norm.saved, name=n))
                 for n in norm.PRE_NORMS)
    attn = attention_kind(cfg)
    return [pre, (attn.declare, attn.saved), post, *_ffn_parts(moe_layer)]


def _declared(cfg: ModelConfig, parts: list[tuple[Declare, Saves]]) -> tuple[Module, ...]:
    return tuple(m for declare, _ in parts if (m := declare(cfg)) is not None)


@functools.lru_cache(maxsize=256)
def decoder_layer(cfg: ModelConfig, *, moe_layer: bool) -> tuple[Module, ...]:
    """The declarations of a dense (or MoE) layer's modules; layers of one kind are alike."""
    return _declared(cfg, _parts(cfg, moe_layer))


@functools.lru_cache(maxsize=256)
def attention_module(cfg: ModelConfig) -> Module:
    """The layer's attention (every layer of a model has the same)."""
    return attention_kind(cfg).declare(cfg)


@functools.lru_cache(maxsize=256)
def ffn_modules(cfg: ModelConfig, *, moe_layer: bool) -> tuple[Module, ...]:
    """The feed-forward slot's modules: what follows the post-attention norm."""
    return _declared(cfg, _ffn_parts(moe_layer))


def layer_saved(cfg: ModelConfig, lay: ActivationLayout, *, moe_layer: bool) -> list[Saved]:
    """Every storage one micro-batch's forward of a dense (or MoE) layer saves, with no recompute."""
    return [item for _, saved in _parts(cfg, moe_layer) for item in saved(cfg, lay)]
