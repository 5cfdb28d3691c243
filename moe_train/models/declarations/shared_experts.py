"""The shared experts (models/moe/layer.py's `shared_experts`, an MLP of `moe.shared_expert_ffn_hidden_size`):
tensor-parallel like the dense MLP, run before the dispatch on the router's input."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .mlp import swiglu
from .parts import Module
from .saves import SWIGLU, Saved, swiglu_items, with_scales, without

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


def recomputed(items: list[Saved], modules: set[str], cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """`shared_experts` run again in backward: they keep their input only (the router's, already an item)."""
    return without(items, {f"{NAME}.{n}" for n in SWIGLU}) if NAME in modules else items


def moved(region: str, cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """Offloaded `shared_experts`: gate, up, silu(gate) and the down projection's input (they run on flat rows);
    their input is the router's, saved outside. With fp8 GEMMs only silu(gate) and the down projection's input
    (gate and up are views)."""
    if region != NAME:
        return set()
    if NAME in lay.fp8_gemms:
        return with_scales({f"{NAME}.silu", f"{NAME}.down_input"})
    return with_scales({f"{NAME}.{n}" for n in SWIGLU})


def kept_in_offloaded_layer(cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """What offloading the whole MoE layer leaves of these: with fp8 GEMMs their gate and up (views of the fp8
    GEMMs' flat outputs)."""
    return {f"{NAME}.gate", f"{NAME}.up"} if NAME in lay.fp8_gemms else set()
