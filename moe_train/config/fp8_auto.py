"""`train.fp8.recipe: auto`: the scaling recipe the hardware runs best, resolved the same way on the login
node (from the hardware table's compute capability of `launch.gpu`) and on the ranks (from the device's own
capability at start-up, moe_train/entry.py), so validate, plan and the engine agree: blockwise on sm90 (Hopper,
DeepSeek-V3's own 1 x 128 / 128 x 128 recipe), mxfp8 on sm100 and later (Blackwell's MX kernels), tensorwise
on the CPU and on older GPUs (the one recipe emulated or real everywhere). Torch-free."""

from __future__ import annotations

from moe_train.config.hardware import HardwareError, hardware_table
from moe_train.config.schema import Recipe


def resolve_fp8_recipe(recipe: str, *, device: str, capability: float | None) -> str:
    """The concrete recipe `recipe` stands for on `device` ("cpu" or "cuda") of compute `capability` (9.0:
    Hopper; None: not known, as the CPU). A concrete recipe stays as it is."""
    if recipe != "auto":
        return recipe
    if device != "cuda" or capability is None or capability < 9.0:
        return "tensorwise"
    return "blockwise" if capability < 10.0 else "mxfp8"


def table_capability(recipe: Recipe) -> float | None:
    """The compute capability of the recipe's launch target in the hardware table (None: the CPU, or a GPU the
    table does not know, which the recipe rules report)."""
    if recipe.launch.device != "cuda":
        return None
    try:
        hardware = hardware_table().get(recipe.launch.gpu)
    except HardwareError:
        return None
    return None if hardware is None else hardware.compute_capability


def with_fp8_resolved(recipe: Recipe, *, capability: float | None = None, from_table: bool = True) -> Recipe:
    """`recipe` with `train.fp8.recipe: auto` resolved (from `capability`, or the launch target's table entry
    when `from_table`); the same object when there is nothing to resolve."""
    fp8 = recipe.train.fp8
    if fp8.recipe != "auto":
        return recipe
    if from_table and capability is None:
        capability = table_capability(recipe)
    concrete = resolve_fp8_recipe(fp8.recipe, device=recipe.launch.device, capability=capability)
    train = recipe.train.model_copy(update={"fp8": fp8.model_copy(update={"recipe": concrete})})
    return recipe.model_copy(update={"train": train})
