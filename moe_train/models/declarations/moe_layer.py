"""The MoE layer as one region (models/moe/layer.py `MoELayer`: router, routed experts and shared experts), as
the recompute and offload policies' `moe` names it: run again or offloaded whole, or by its parts."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from . import routed_experts, router, shared_experts
from .layout import ActivationLayout
from .saves import Saved

REGION = "moe"
INNER = (routed_experts.ACTIVATION, shared_experts.NAME)  # the regions inside it (config/rules.py INNER_REGIONS)
REGIONS = (REGION, *INNER)  # every region its saves belong to


def recomputed(items: list[Saved], modules: set[str], cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """`moe`: the whole layer keeps its input, the post-attention norm's output (a x Ts x h), and its every save
    goes. Otherwise its parts: `shared_experts`; `moe_act` drops nothing: the weighted SwiGLU keeps only its
    inputs (gate, up, the rows' routing weights; models/moe/weighted_swiglu.py), which the checkpoint keeps as
    well, and its output is the down projection's input."""
    if REGION not in modules:
        return shared_experts.recomputed(items, modules, cfg, lay)
    out = [i for i in items if i.region not in REGIONS]
    return [*out, Saved(REGION, "moe.input", lay.act_bytes * lay.seq_tokens * cfg.hidden_size)]


def moved_whole(items: list[Saved], cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """Offloaded whole: everything the layer saves but what its parts keep (`kept_in_offloaded_layer`: views of
    tensors held elsewhere)."""
    kept = (router.kept_in_offloaded_layer(cfg, lay) | routed_experts.kept_in_offloaded_layer(cfg, lay)
            | shared_experts.kept_in_offloaded_layer(cfg, lay))
    return {i.name for i in items if i.region in REGIONS and i.name not in kept}
