"""The `moe-train` typer app: registers one plain function per command. No torch at import time."""

from __future__ import annotations

from typing import Annotated

import typer

import moe_train

from .convert import convert_app
from .data import data_app
from .experts import experts_app
from .measure import measure
from .plan import plan
from .recipes import recipes_app
from .render import render
from .report import report
from .run import run
from .runs import runs
from .schema import schema
from .submit import submit
from .sweep import sweep
from .validate import validate

app = typer.Typer(
    name="moe-train",
    help="Pretraining launcher and training engine for dense and Mixture-of-Experts LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

# In the order of a user's journey: pick and check a recipe, train it here or on SLURM, then data and conversion.


def _print_version(value: bool) -> None:
    if value:
        print(f"moe-train {moe_train.__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Pretraining launcher and training engine for dense and Mixture-of-Experts LLMs."""


app.add_typer(recipes_app, name="recipes")
app.command()(validate)
app.command()(schema)
app.command()(plan)
app.command()(measure)
app.command()(run)
app.command()(render)
app.command()(submit)
app.command()(sweep)
app.command()(runs)
app.command()(report)
app.add_typer(experts_app, name="experts")
app.add_typer(data_app, name="data")
app.add_typer(convert_app, name="convert")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
