"""What every command shares: the --set option, recipe loading that exits 2 on bad input, error printing."""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn

import typer

from moe_train.config import Recipe, RecipeError, load_recipe

RecipeArgument = Annotated[
    str, typer.Argument(help="A recipe file, or the name of a built-in recipe (moe-train recipes list).")
]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a field: dotted.path=value, the value read as YAML (3e-4, true, null, [1, 2]). Repeatable.",
        show_default=False,
    ),
]


def fail(problems: list[str], code: int = 2) -> NoReturn:
    """Print one line per problem to stderr and exit (2: invalid input)."""
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    raise typer.Exit(code)


def load_or_exit(recipe: str, sets: list[str] | None = None, *, check_files: bool = True) -> Recipe:
    try:
        return load_recipe(recipe, sets or (), check_files=check_files)
    except RecipeError as error:
        fail(error.problems)
