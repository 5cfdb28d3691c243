"""What activation offloading (`parallel.offload.modules`, parallel/offload.py) moves off the device: the saved
items of plan/saved_tensors.py (after selective recompute) that leave a layer when its forward returns (no torch).

The pool moves a storage that one of the named regions saved and that nothing else holds when the layer's
forward returns; it leaves on the device every storage something else keeps too (a save outside the regions,
another tensor on the same storage, a tensor Python holds). The second rule is what makes the list more than
the regions' items: a save that is a *view* (a reshape or transpose of another op's output) shares its storage
with the tensor it views, so it stays. What that leaves, region by region, each module declares beside its
saves (models/declarations: `moved`, and for a MoE layer offloaded whole `kept_in_offloaded_layer`;
policies.py gathers them).

Held to measure exactly (tests/test_plan_measure.py) for every region in fp32 and bf16, with and without tensor
and sequence parallelism, expert parallelism, recompute of other regions and fp8 GEMMs (rowwise, inputs kept
in fp8 or in bf16).

plan/estimate.py takes these bytes out of the device-resident activation memory, reports them per layer as
measure does (`offloaded_bytes_per_layer`) and prices their copies on the hardware table's host link.
"""

from __future__ import annotations

from moe_train.config.schema import ModelConfig
from moe_train.models.declarations import policies

from .saved_tensors import ActivationLayout, Saved


def offloaded_items(items: list[Saved], modules: tuple[str, ...], cfg: ModelConfig,
                    lay: ActivationLayout) -> list[Saved]:
    """The items of one layer (`items`: what it saves under the recompute policy) that the offloaded `modules`
    move to the host pool."""
    return policies.offloaded(cfg, lay, items, modules)
