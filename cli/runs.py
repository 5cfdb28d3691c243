"""`moe-train runs`: the run folders under a root and where each stands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moe_train.launch.runs import collect, format_runs

from .common import fail


def runs(
    root: Annotated[
        Path, typer.Argument(help="Folder searched for run folders (any folder holding a recipe.yaml).")
    ] = Path("runs"),
) -> None:
    """List the runs under ROOT: status (complete, running or queued with the job id, stopped, submitted, new),
    last step and loss from metrics.jsonl. Sweep points are listed as runs of their own.

    Examples:

        moe-train runs

        moe-train runs runs/qwen3-30b-a3b
    """
    if not root.is_dir():
        fail([f"{root}: no such folder"])
    statuses = collect(root)
    if not statuses:
        print(f"no runs under {root}")
        return
    print(format_runs(statuses, root))
