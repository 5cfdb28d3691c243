"""How the planner reads `parallel.recompute` (RecomputePolicy) and what activation recomputation runs again
in backward (parallel/recompute.py), for the memory, FLOPs and collectives the planner counts (torch-free).

Non-reentrant checkpointing re-runs a region's forward until the last tensor the region saved for backward is
back, then stops (early stop): whatever runs after that last save is not repeated. In a dense MLP that is the
down projection and the collective after it; in a MoE layer (whose shared experts run before the dispatch, so
the routed experts and the combine save after them) the all-gather dispatcher's closing reduce-scatter (when no
balancing loss saves after the combine) and, without sequence parallelism, the gather of the layer's token
slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.config.schema import ModelConfig


@dataclass(frozen=True)
class RecomputePolicy:
    """parallel.recompute as the planner reads it. `num_layers` counts per model chunk (Megatron-Core).
    `offload`: parallel.offload.modules, the regions whose saves leave the device instead (validate keeps them
    apart from the recomputed ones): the other half of what a layer keeps for backward, so it travels with it."""

    granularity: str = "none"
    modules: tuple[str, ...] = ()
    method: str = "uniform"
    num_layers: int = 1
    offload: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, rc, offload: tuple[str, ...] = ()) -> RecomputePolicy:
        modules = tuple(rc.modules) if rc.granularity == "selective" else ()
        return cls(granularity=rc.granularity, modules=modules, method=rc.method, num_layers=rc.num_layers,
                   offload=tuple(sorted(set(offload))))


def saves_after_combine(m: ModelConfig) -> bool:
    """Whether a MoE layer's balancing losses save tensors after the routed experts' combine (seq_aux_loss,
    z-loss): then a recomputation of the layer runs to its end, the combine's collective included."""
    router = m.moe.router
    return (router.load_balancing == "seq_aux_loss" and router.aux_loss_coeff > 0) or router.z_loss_coeff > 0


def recompute_groups(layers: list[int], policy: RecomputePolicy) -> list[list[int]]:
    """The layers of a chunk that full recompute checkpoints together (uniform: groups of num_layers; block:
    each of the first num_layers alone)."""
    n = policy.num_layers
    if policy.method == "block":
        return [[i] for i in layers[:n]]
    return [layers[g: g + n] for g in range(0, len(layers), n)]
