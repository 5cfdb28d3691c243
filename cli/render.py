"""`moe-train render`: the torchrun command or sbatch script of a recipe, with its run folder prepared."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from moe_train.atomic import write_atomic
from moe_train.launch.render import DEFAULT_RDZV_PORT, render_torchrun
from moe_train.launch.rundir import prepare_run_dir
from moe_train.launch.shell import LaunchError
from moe_train.launch.submit import write_job

from .common import RecipeArgument, SetOption, fail, load_or_exit


class Target(str, Enum):
    torchrun = "torchrun"
    slurm = "slurm"


def render(
    recipe: RecipeArgument,
    target: Annotated[
        Target,
        typer.Option("--target", "-t", help="torchrun: the command for one node; slurm: the sbatch script."),
    ] = Target.slurm,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to this file instead of standard output.")
    ] = None,
    set: SetOption = None,
    preflight: Annotated[
        bool, typer.Option("--preflight", help="Render the short job that only checks the allocation and meshes.")
    ] = False,
    rdzv_host: Annotated[
        str, typer.Option(help="torchrun: rendezvous host, the first node of a multi-node run.")
    ] = "localhost",
    rdzv_port: Annotated[int, typer.Option(help="torchrun: rendezvous port on that host.")] = DEFAULT_RDZV_PORT,
) -> None:
    """Print what starts RECIPE: the torchrun command (--target torchrun) or the sbatch script (--target slurm).

    The run folder is prepared first (RUN_DIR/recipe.yaml, the resolved recipe the ranks read; RUN_DIR/job.sbatch
    for slurm), so the printed command runs as is. Exit 2 when the recipe is invalid or RUN_DIR holds another run.

    Examples:

        moe-train render qwen3-moe-tiny --target torchrun --set launch.gpus_per_node=2

        moe-train render recipes/qwen3-30b-a3b.yaml --target slurm -o job.sbatch
    """
    loaded = load_or_exit(recipe, set)
    try:
        if target is Target.torchrun:
            text = render_torchrun(loaded, prepare_run_dir(loaded), host=rdzv_host, port=rdzv_port,
                                   preflight=preflight)
        else:
            _, _, text = write_job(loaded, preflight=preflight)
    except LaunchError as error:
        fail(error.problems)
    if target is Target.torchrun and loaded.launch.nodes > 1 and rdzv_host == "localhost":
        print(f"note: run the command on each of the {loaded.launch.nodes} nodes, with --rdzv-host set to the first "
              "node's address", file=sys.stderr)
    if output is None:
        print(text, end="")
    else:
        write_atomic(output, text)
        if target is Target.slurm:
            output.chmod(0o755)
