"""What one micro-batch's forward of one layer saves for backward, tensor by tensor, with no recompute (no torch).

The list is the modules' own declarations (models/declarations: each module's `saved`, beside the module it
describes), not a textbook layer: each `Saved` item is one storage that autograd keeps, found by reading the
modules and checked against `torch.autograd.graph.saved_tensors_hooks` (tests/test_plan.py, world size 1,
storages de-duplicated, parameters excluded), and held to measure on every layout (tests/test_plan_measure.py).
Every item carries the region a recompute policy can drop and is sharded as the layout shards its module
(models/declarations/saves.py says how). MoE layers route a rank's share of the tokens (T / tp); each rank's
experts see `top_k` rows per token at even routing (times `moe_imbalance` on the most loaded rank),
all-gathered over etp, with the expert ffn sharded by etp (`expert_rows`).

The planner's other files read the declarations' layout, items and routed rows through this module.
"""

from __future__ import annotations

from moe_train.config.schema import ModelConfig
from moe_train.models.declarations.layer import layer_saved
from moe_train.models.declarations.layout import ActivationLayout
from moe_train.models.declarations.routed_experts import expert_rows, padded_capacity
from moe_train.models.declarations.saves import FP32, INT32, INT64, Saved

__all__ = ["FP32", "INT32", "INT64", "ActivationLayout", "Saved", "expert_rows", "layer_items", "padded_capacity"]


def layer_items(cfg: ModelConfig, lay: ActivationLayout, *, layer_index: int) -> list[Saved]:
    """Every storage one micro-batch's forward of decoder layer `layer_index` saves, with no recompute."""
    return layer_saved(cfg, lay, moe_layer=cfg.is_moe_layer(layer_index))
