"""`moe-train submit`: the run folder, its batch script, and sbatch."""

from __future__ import annotations

import shlex
import sys
from typing import Annotated

import typer

from moe_train.launch.shell import LaunchError
from moe_train.launch.submit import SubmitError
from moe_train.launch.submit import submit as submit_run
from moe_train.plan.fit import check_fit

from .common import RecipeArgument, SetOption, fail, load_or_exit


def submit(
    recipe: RecipeArgument,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the batch script; write nothing and submit nothing.")
    ] = False,
    preflight: Annotated[
        bool,
        typer.Option(
            "--preflight",
            help="Submit a short job of the same shape that only runs the entry's preflight: every rank joins, "
            "builds the dense and expert meshes and prints its place; no training.",
        ),
    ] = False,
    set: SetOption = None,
) -> None:
    """Submit RECIPE to SLURM: write RUN_DIR (resolved recipe, job.sbatch, logs/), sbatch it, print the job id.

    Exit 2 when the recipe is invalid, uses a feature the engine cannot train yet (a preflight accepts any
    layout), or RUN_DIR holds a different run; exit 1 when sbatch fails.

    Examples:

        moe-train submit recipes/qwen3-30b-a3b.yaml --preflight

        moe-train submit recipes/qwen3-30b-a3b.yaml --set launch.nodes=4 --dry-run
    """
    loaded = load_or_exit(recipe, set)
    warning = None if preflight else check_fit(loaded).warning
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    try:
        result = submit_run(loaded, preflight=preflight, dry_run=dry_run)
    except LaunchError as error:
        fail(error.problems)
    except SubmitError as error:
        fail([str(error)], code=1)
    if dry_run:
        print(result.script_text, end="")
        return
    print(f"submitted job {result.job_id}{' (preflight)' if preflight else ''}: {result.script}")
    print(f"log:    {result.log}")
    print(f"follow: tail -F {shlex.quote(str(result.log))}")
    print(f"status: squeue -j {result.job_id}   or   moe-train runs {shlex.quote(str(result.run_dir.parent))}")
