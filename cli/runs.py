"""`moe-train runs`: the run folders under a root and where each stands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moe_train.launch.runs import collect, failure_lines, runs_table

from .common import fail


def runs(
    root: Annotated[
        Path, typer.Argument(help="Folder searched for run folders (any folder holding a recipe.yaml).")
    ] = Path("runs"),
) -> None:
    """List the runs under ROOT: status (complete, running or queued with the job id, failed, stopped, submitted,
    new), last step, loss and tokens/s from metrics.jsonl, and the time since the latest launch; a failed run's
    reason below the table. Sweep points are listed as runs of their own.

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
    from rich.console import Console

    console = Console()
    # Off a terminal (pipes, SLURM logs, tests) rich would wrap at 80 columns: lines stay whole instead.
    console = console if console.is_terminal else Console(width=10_000, no_color=True)
    console.print(runs_table(statuses, root), crop=False)
    for line in failure_lines(statuses, root):
        console.print(line, markup=False, highlight=False, crop=False)
