"""What the recompute and offload policies (parallel.recompute.modules, parallel.offload.modules) do to a
decoder layer's saves, from each module's declaration: the module whose region a policy names says what goes
when it runs again in backward (`recomputed`) and what leaves the device when it is offloaded (`moved`)."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from . import mla, mlp, moe_layer, norm, routed_experts, shared_experts
from .layer import attention_kind
from .layout import ActivationLayout
from .saves import Saved

# Every region a policy can name, by the declaration that owns it.
REGIONS = frozenset({mla.attention.CORE, mla.UP, norm.REGION, mlp.NAME, shared_experts.NAME,
                     routed_experts.ACTIVATION, moe_layer.REGION})


def recomputed(cfg: ModelConfig, lay: ActivationLayout, items: list[Saved], modules: set[str], *,
               moe: bool) -> list[Saved]:
    """The items of a layer (`moe`: a MoE layer's) left when the selective-recompute `modules` run again in
    backward: attention's, the feed-forward slot's, then the pre-norms'."""
    out = attention_kind(cfg).recomputed(items, modules, cfg, lay)
    out = (moe_layer.recomputed if moe else mlp.recomputed)(out, modules, cfg, lay)
    for name in norm.PRE_NORMS:
        out = norm.recomputed(out, modules, cfg, lay, name=name)
    return out


def _moved(region: str, cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """The item names an offloaded `region` moves, as the modules that save in it declare."""
    if region not in REGIONS:
        raise ValueError(f"unknown offload region {region!r}")
    out = attention_kind(cfg).moved(region, cfg, lay)
    for name in norm.PRE_NORMS:
        out |= norm.moved(region, cfg, lay, name=name)
    return out | mlp.moved(region, cfg, lay) | shared_experts.moved(region, cfg, lay) | routed_experts.moved(
        region, cfg, lay)


def offloaded(cfg: ModelConfig, lay: ActivationLayout, items: list[Saved], modules: tuple[str, ...]) -> list[Saved]:
    """The items of one layer (`items`: what it saves under the recompute policy) that the offloaded `modules`
    move to the host pool. A region inside another offloaded one adds nothing (the pool wraps it once): a MoE
    layer offloaded whole moves what `moe_layer.moved_whole` says."""
    whole = moe_layer.REGION in modules and any(i.region == moe_layer.REGION for i in items)
    skipped = moe_layer.REGIONS if whole else (moe_layer.REGION,)  # "moe" names no dense region
    names = set().union(*(_moved(r, cfg, lay) for r in modules if r not in skipped))
    if whole:
        names |= moe_layer.moved_whole(items, cfg, lay)
    return [i for i in items if i.name in names]
