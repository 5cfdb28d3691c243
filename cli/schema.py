"""`moe-train schema`: the recipe's JSON Schema, for editors' YAML completion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moe_train.config import Recipe


def schema(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
) -> None:
    """Print the JSON Schema of a recipe.

    Example (VS Code with the YAML extension): moe-train schema -o moe-train.schema.json, then add
    `# yaml-language-server: $schema=moe-train.schema.json` at the top of a recipe.
    """
    text = json.dumps(Recipe.model_json_schema(), indent=2) + "\n"
    if output is None:
        print(text, end="")
    else:
        output.write_text(text)
