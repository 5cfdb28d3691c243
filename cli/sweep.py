"""`moe-train sweep`: one run per point of a grid of overrides, as a SLURM job array or torchrun commands."""

from __future__ import annotations

from typing import Annotated

import typer

from moe_train.config import RecipeError
from moe_train.launch.render import render_torchrun
from moe_train.launch.shell import LaunchError
from moe_train.launch.submit import SubmitError
from moe_train.launch.sweep import expand, format_table, parse_axes, submit_arrays, write_sweep

from .common import RecipeArgument, SetOption, fail


def sweep(
    recipe: RecipeArgument,
    grid: Annotated[
        list[str],
        typer.Option(
            "--grid",
            "-g",
            help="An axis: dotted.path=value1,value2 (values read as YAML; commas inside [..] stay). Repeatable; "
            "the sweep is the Cartesian product of all axes.",
            show_default=False,
        ),
    ],
    set: SetOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the table of points; write nothing.")] = False,
    submit: Annotated[
        bool, typer.Option("--submit", help="Submit the valid points as a SLURM job array (one per launch shape).")
    ] = False,
    max_parallel: Annotated[
        int | None, typer.Option("--max-parallel", min=1, help="With --submit: array tasks running at once (%N).")
    ] = None,
    preflight: Annotated[
        bool, typer.Option("--preflight", help="With --submit: run only each point's preflight, no training.")
    ] = False,
) -> None:
    """Expand RECIPE over the --grid axes: validate every point, list the invalid ones with their reasons and skip
    them, write one run folder per valid point under the recipe's run_dir (named from the overrides, e.g.
    lr-3e-4_ep-8), then print each point's torchrun command, or with --submit sbatch one job array.

    Examples:

        moe-train sweep qwen3-moe-tiny --grid train.lr=1e-3,3e-3 --grid parallel.ep=1,2 --dry-run

        moe-train sweep recipes/qwen3-30b-a3b.yaml --grid train.lr=1e-4,3e-4 --submit --max-parallel 2
    """
    if dry_run and submit:
        fail(["--dry-run and --submit exclude each other"])
    if (max_parallel is not None or preflight) and not submit:
        fail(["--max-parallel and --preflight apply to --submit"])
    sets = set or []
    try:
        axes = parse_axes(grid)
        sweep_dir, points = expand(recipe, sets, axes, preflight=preflight, for_submit=submit)
    except (LaunchError, RecipeError) as error:
        fail(error.problems)
    print(f"sweep of {recipe} in {sweep_dir}")
    print(format_table(points))
    if dry_run:
        return
    if not any(p.valid for p in points):
        fail(["no valid point in the sweep"])
    try:
        write_sweep(recipe, sets, axes, sweep_dir, points)
        if submit:
            for job in submit_arrays(sweep_dir, points, max_parallel=max_parallel, preflight=preflight):
                print(f"submitted job array {job.job_id} ({len(job.points)} task(s)): {job.script}")
                print(f"logs: {sweep_dir}/logs/slurm-{job.job_id}_<task>.out (linked from each point's logs/)")
            return
        for point in points:
            if point.valid:
                print(f"# {point.name}")
                print(render_torchrun(point.recipe, sweep_dir / point.name), end="")
    except LaunchError as error:
        fail(error.problems)
    except SubmitError as error:
        fail([str(error)], code=1)
