"""The decoder block's two pre-norms (models/norm.py RMSNorm over the hidden size, on the sequence region)."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .parts import Module, Param
from .saves import Saved, norm_items

PRE_NORMS = ("input_layernorm", "post_attention_layernorm")  # the block's names (models/decoder.py)
REGION = "layernorm"  # the recompute and offload policies' name for both


def declare(cfg: ModelConfig, *, name: str) -> Module:
    """A pre-norm's weight [h], whole on every tp rank (its gradient partial under SP); no GEMM."""
    return Module(name, (Param(f"{name}.weight", (cfg.hidden_size,), "sequence"),))


def saved(cfg: ModelConfig, lay: ActivationLayout, *, name: str) -> list[Saved]:
    """Its input (the residual stream, sequence-sharded under SP) and the fp32 reciprocal rms."""
    return norm_items(name, name, lay.seq_tokens, cfg.hidden_size, lay.act_bytes)


def recomputed(items: list[Saved], modules: set[str], cfg: ModelConfig, lay: ActivationLayout, *,
               name: str) -> list[Saved]:
    """Run again in backward (`layernorm`): the norm keeps its input (the residual stream, a x Ts x h), which it
    keeps anyway, and drops its rstd. Its output stays where a consumer saved it (the next GEMM's input, the
    router's): our checkpoint keeps a region's output like any tensor (Megatron-Core's checkpoint-without-output
    discards those too)."""
    if REGION not in modules:
        return items
    kept = [i for i in items if i.region != name]
    return [Saved(REGION, f"{name}.input", lay.act_bytes * lay.seq_tokens * cfg.hidden_size), *kept]


def moved(region: str, cfg: ModelConfig, lay: ActivationLayout, *, name: str) -> set[str]:
    """Offloaded (`layernorm`): both reciprocal rms and the post-attention norm's input (the residual after
    attention); the input norm's input is the layer's own argument, which the caller holds."""
    if region != REGION:
        return set()
    return {f"{name}.rstd"} | ({f"{name}.input"} if name != PRE_NORMS[0] else set())
