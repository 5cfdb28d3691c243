"""The memory check `validate`, `submit` and `sweep` share: does the recipe fit its launch target's GPUs?

Skipped for `launch.device: cpu` (host RAM is not a hardware-table entry). One line says why it does not fit
(the peak against device memory, and its biggest parts), or that it fits only within the stated margin.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config.hardware import HardwareError, hardware_table
from moe_train.config.schema import Recipe

from .estimate import Plan, estimate

GB = 1e9


@dataclass(frozen=True)
class FitCheck:
    error: str | None = None
    warning: str | None = None


def memory_line(plan: Plan) -> str:
    mem = plan.worst.memory
    parts = ", ".join(f"{name} {mem[name] / GB:.1f}" for name in ("weights", "grads", "optimizer", "activations",
                                                                  "buffers"))
    stage = f" (the fullest: pipeline rank {plan.worst.rank})" if plan.layout.pp > 1 else ""
    return (f"peak {plan.peak / GB:.1f} GB per GPU{stage} against {plan.device_memory / GB:.0f} GB of a "
            f"{plan.hardware.id}: {parts} GB")


def check_fit(recipe: Recipe) -> FitCheck:
    if recipe.launch.device == "cpu":
        return FitCheck()
    try:
        hardware = hardware_table()[recipe.launch.gpu]
    except (HardwareError, KeyError):
        return FitCheck()  # the recipe rules already report an unknown GPU or a bad hardware file
    plan = estimate(recipe, hardware)
    if not plan.fits:
        return FitCheck(error=f"memory: does not fit: {memory_line(plan)} (moe-train plan shows the details; "
                              "more recompute, a smaller micro_batch_size, or more pp/tp/ep)")
    if plan.tight:
        margin = plan.assumptions.memory_margin
        return FitCheck(warning=f"memory: fits within the {margin:.0%} margin only: {memory_line(plan)}")
    return FitCheck()
