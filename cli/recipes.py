"""`moe-train recipes`: the built-in recipes, listed and shown resolved."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from moe_train.config import builtin_recipes, dump_recipe
from moe_train.plan.params import count_parameters

from .common import RecipeArgument, SetOption, load_or_exit
from .validate import format_count

recipes_app = typer.Typer(help="List and show the built-in recipes.", no_args_is_help=True)


@recipes_app.command("list")
def list_recipes() -> None:
    """List the built-in recipes with their size and layout.

    Example: moe-train recipes list
    """
    table = Table("name", "family", "parameters (active)", "layout", "world size")
    for name in builtin_recipes():
        recipe = load_or_exit(name, check_files=False)
        params = count_parameters(recipe.model)
        p = recipe.parallel
        table.add_row(
            name,
            recipe.model.family,
            f"{format_count(params.total)} ({format_count(params.active)})",
            f"tp{p.tp} pp{p.pp} ep{p.ep} dp{recipe.dp}",
            str(recipe.world_size),
        )
    Console().print(table)


@recipes_app.command("show")
def show(name: RecipeArgument, set: SetOption = None) -> None:
    """Print the resolved YAML of a recipe: every default filled, extends and --set applied.

    Examples:

        moe-train recipes show qwen3-30b-a3b

        moe-train recipes show qwen3-30b-a3b > my.yaml
    """
    print(dump_recipe(load_or_exit(name, set, check_files=False)), end="")
