"""The `moe-train` typer app: registers one plain function per command. No torch at import time."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="moe-train",
    help="Pretraining launcher and training engine for dense and Mixture-of-Experts LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
