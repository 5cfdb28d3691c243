"""Recipes: the pydantic schema, YAML loading with positions, extends and overrides, and the rules.

Torch-free: the login-node half imports this.
"""

from .hardware import HARDWARE, Hardware
from .loader import RecipeError, builtin_recipes, dump_recipe, load_recipe, parse_override
from .schema import (
    CheckpointConfig,
    DataConfig,
    LaunchConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    Recipe,
    RouterConfig,
    SlurmConfig,
    TrainConfig,
)
from .support import unsupported

__all__ = [
    "HARDWARE",
    "CheckpointConfig",
    "DataConfig",
    "Hardware",
    "LaunchConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "Recipe",
    "RecipeError",
    "RouterConfig",
    "SlurmConfig",
    "TrainConfig",
    "builtin_recipes",
    "dump_recipe",
    "load_recipe",
    "parse_override",
    "unsupported",
]
