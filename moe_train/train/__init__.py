"""The trainer loop, optimizer and LR schedules, metrics and preemption.

`run_from_recipe` is the one entry: `moe-train run` calls it in-process at world size 1, and entry.py calls it
on every rank under torchrun/srun. It raises RecipeError, DataError or CheckpointError for bad input (exit 2)
and TrainingError for a runtime failure (exit 1); `input_errors()` lists the former for callers to map.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.config.schema import Recipe
    from moe_train.train.loop import Summary


def input_errors() -> tuple[type[Exception], ...]:
    """The exception types that mean bad input (exit 2, one line, no traceback)."""
    from moe_train.checkpoint.layout import CheckpointError
    from moe_train.config import RecipeError
    from moe_train.data import DataError

    return (RecipeError, DataError, CheckpointError)


def run_from_recipe(recipe: Recipe) -> Summary:
    """Train `recipe` on this process's rank; creates (and destroys) the process group when WORLD_SIZE > 1."""
    import torch
    import torch.distributed as dist

    from moe_train.config import RecipeError, unsupported
    from moe_train.train.loop import Trainer

    problems = unsupported(recipe)
    if problems:
        raise RecipeError(problems)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != recipe.world_size:
        raise RecipeError(
            [f"launch: the recipe asks for {recipe.world_size} ranks but this job has WORLD_SIZE={world_size}"]
        )
    created = False
    if world_size > 1 and not dist.is_initialized():
        torch.set_num_threads(1)  # ranks share the cores; oversubscription is many times slower
        if recipe.launch.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if recipe.launch.device == "cuda" else "gloo",
            timeout=timedelta(minutes=recipe.launch.timeout_minutes),
        )
        created = True
    try:
        return Trainer(recipe).train()
    finally:
        if created:
            dist.destroy_process_group()

