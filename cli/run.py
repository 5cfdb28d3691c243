"""`moe-train run`: train a recipe on this machine, in-process at world size 1, through torchrun otherwise."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from moe_train.checkpoint.layout import CheckpointError
from moe_train.checkpoint.manifest import sizes_only
from moe_train.checkpoint.resume import start_point
from moe_train.config import Recipe, RecipeError, load_recipe, unsupported
from moe_train.launch.job_env import job_environment
from moe_train.launch.render import torchrun_argv
from moe_train.launch.rundir import prepare_run_dir, read_run_recipe
from moe_train.launch.shell import LaunchError
from moe_train.run_files import PREEMPT_FILE

from .common import SetOption, fail, load_or_exit

DEFAULT_RECIPE = "qwen3-moe-tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_torchrun(recipe: Recipe, run_dir: Path, *, emulated_nodes: bool = False) -> int:
    """Start every rank with torchrun (this interpreter's), on a free local port; returns its exit code.
    `emulated_nodes`: all of a several-node CPU recipe's ranks start here (bootstrap emulates its nodes)."""
    if emulated_nodes:
        recipe = recipe.model_copy(update={"launch": recipe.launch.model_copy(
            update={"nodes": 1, "gpus_per_node": recipe.world_size})})
    argv = torchrun_argv(recipe, run_dir, host="127.0.0.1", port=_free_port(), rdzv_id=f"run-{os.getpid()}")
    argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    env = {**os.environ, **job_environment(recipe)}  # the rendered job's defaults (CUDA, determinism) too
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(argv, env=env, check=False).returncode


def run(
    recipe: Annotated[
        str,
        typer.Argument(help="A recipe file or built-in name; default: the tiny Qwen3-MoE on the builtin corpus."),
    ] = DEFAULT_RECIPE,
    set: SetOption = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            help="Ranks on this machine (sets launch.nodes=1, launch.gpus_per_node=N); above 1, torchrun starts "
            "them. N equal to the world size of a CPU recipe of several nodes keeps its launch section: its nodes "
            "are emulated (node = rank // gpus_per_node). Default: the recipe's launch section.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Train RECIPE here: writes the run folder, metrics.jsonl and checkpoints, resuming from its latest checkpoint.

    Examples:

        moe-train run                                   # qwen3-moe-tiny, under 3 minutes on a laptop CPU

        moe-train run qwen3-tiny --set train.steps=50 --set run_dir=runs/try

        moe-train run qwen3-moe-tiny --nproc 2          # two data-parallel ranks (gloo on CPU)
    """
    # OpenMP threads that busy-wait between kernels turned a 0.5 s step into 22-25 s on a shared 2-core machine
    # (measured); passive waiting costs nothing measurable. Set before torch is imported; torchrun's ranks inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    overrides = list(set or [])
    emulated = False
    if nproc is not None:
        emulated = _emulates_its_nodes(recipe, overrides, nproc)
        if not emulated:
            overrides += ["launch.nodes=1", f"launch.gpus_per_node={nproc}"]
    resolved = load_or_exit(recipe, overrides)
    problems = unsupported(resolved)
    if resolved.launch.nodes > 1 and not emulated:
        problems.append(f"launch.nodes: {resolved.launch.nodes} nodes; moe-train run trains on this machine only "
                        "(use moe-train submit, or --nproc N)")
    if problems:
        fail(problems)
    try:
        run_dir = prepare_run_dir(resolved)
        # What the ranks will read: the resolved recipe in the run folder (absolute run_dir, provenance).
        resolved = read_run_recipe(run_dir)
        start_point(  # sizes only here: the ranks check every checksum, sharing the reading
            ckpt_dir=Path(resolved.checkpoint_dir()),
            resume=resolved.checkpoint.resume,
            init_from=resolved.checkpoint.init_from,
            verify=sizes_only,
        )
    except LaunchError as error:
        fail(error.problems)
    except CheckpointError as error:
        fail([str(error)])
    # A notice left by an earlier stop would halt this run at its first step (the SLURM job removes it too).
    (run_dir / PREEMPT_FILE).unlink(missing_ok=True)
    if resolved.world_size > 1:
        raise typer.Exit(_launch_torchrun(resolved, run_dir, emulated_nodes=emulated))
    from moe_train.train import train_and_report

    raise typer.Exit(train_and_report(resolved))


def _emulates_its_nodes(recipe: str, overrides: list[str], nproc: int) -> bool:
    """Whether `--nproc N` runs a multi-node CPU recipe as written, its nodes emulated on this machine (N equal to
    its world size; the hierarchical dispatcher's nodes are rank // gpus_per_node). Any other recipe, one that
    loads only once --nproc sizes it included, trains on one node of N ranks."""
    try:
        written = load_recipe(recipe, overrides, check_files=False)
    except RecipeError:
        return False
    return written.launch.nodes > 1 and written.launch.device == "cpu" and nproc == written.world_size
