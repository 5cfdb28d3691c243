"""What torchrun (or srun + torchrun) starts on every rank: `python -m moe_train.entry --recipe R [--preflight]`.

Before any collective, each rank compares what the launcher gave it (WORLD_SIZE, LOCAL_WORLD_SIZE, the SLURM
node count, visible GPUs) with the recipe, so a job whose allocation does not match fails within seconds on
every rank with one line, instead of hanging in a rendezvous or a collective until a timeout. `--preflight`
then builds the dense and expert meshes, runs one all-reduce on every mesh dimension's group, prints the
rank table and exits: a cheap job of the real shape that proves the allocation before the real run.
`--restart` (the batch script passes it to a requeued job) trains with `checkpoint.resume: required`: a job that
continues an earlier one of its run must find that run's checkpoint, never silently start over (nor go back to a
`checkpoint.resume` path the first job started from).

Exit codes: 0 success, 1 a runtime failure (mismatch, collective failure), 2 an invalid or unsupported recipe.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moe_train.config import Recipe, RecipeError, load_recipe
from moe_train.config.fp8_auto import with_fp8_resolved
from moe_train.config.mesh_shape import MeshShape, coords_text, format_coords
from moe_train.parallel.bootstrap import LauncherEnv, LaunchMismatch, bootstrap, launcher_problems, shutdown
from moe_train.parallel.context import ParallelContext

__all__ = ["LauncherEnv", "launcher_problems", "main"]

PREFIX = "moe-train entry"


def _emit(text: str, stream=None) -> None:
    """One write per message, newline included: ranks share the launcher's pipe, and print()'s separate write
    of the newline let another rank's line land between a line and its end (seen under load)."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def _say(env: LauncherEnv, message: str, *, stream=None) -> None:
    _emit(f"{PREFIX}: rank {env.rank}/{env.world_size} on {env.host}: {message}", stream)


def preflight(recipe: Recipe, env: LauncherEnv, ctx: ParallelContext, started: float) -> int:
    """One all-reduce per mesh dimension, the rank table; every rank prints its own line too."""
    import torch
    import torch.distributed as dist

    expected = format_coords(ctx.shape, env.rank)
    actual = coords_text(ctx.dense.get_coordinate(), ctx.expert.get_coordinate())
    if actual != expected:
        _say(env, f"mesh coordinates {actual} differ from the layout's {expected}", stream=sys.stderr)
        return 1
    checked = 0
    for mesh in (ctx.dense, ctx.expert):
        for name in mesh.mesh_dim_names:
            ones = torch.ones(1, device=ctx.device)
            dist.all_reduce(ones, group=mesh.get_group(name))
            size = dist.get_world_size(mesh.get_group(name))
            if int(ones.item()) != size:
                _say(env, f"all-reduce over {name} summed {ones.item()} on {size} ranks", stream=sys.stderr)
                return 1
            checked += 1
    rows: list = [None] * env.world_size
    dist.all_gather_object(rows, (env.rank, env.host, env.local_rank, actual))
    elapsed = time.monotonic() - started
    if env.rank == 0:
        _emit(_table(recipe, ctx.shape, "nccl" if ctx.device.type == "cuda" else "gloo", rows))
    _say(env, f"local rank {env.local_rank}: {actual}; {checked} all-reduces ok in {elapsed:.1f}s")
    dist.barrier()
    return 0


def _table(recipe: Recipe, shape: MeshShape, backend: str, rows: list) -> str:
    launch = recipe.launch
    lines = [
        f"{PREFIX}: preflight of {recipe.name}: world size {recipe.world_size} = {launch.nodes} node(s) x "
        f"{launch.gpus_per_node}, backend {backend}, dense mesh (pp, dp, cp, tp) = {shape.dense}, "
        f"expert mesh (pp, edp, ep, etp) = {shape.expert}",
        f"{'rank':>6}  {'host':<20} {'local':>5}  (pp, dp, cp, tp | edp, ep, etp)",
    ]
    for rank, host, local, coords in sorted(rows):
        lines.append(f"{rank:>6}  {host:<20} {local:>5}  {coords}")
    return "\n".join(lines)


def _device_capability(recipe: Recipe, env: LauncherEnv) -> float | None:
    """This rank's CUDA compute capability (9.0: Hopper), which `train.fp8.recipe: auto` resolves from as plan
    resolves it from the hardware table; None on the CPU (or where CUDA does not answer: the table's then)."""
    import torch

    if recipe.launch.device != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(env.local_rank)
    return major + minor / 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_train.entry", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, type=Path, help="The resolved recipe (RUN_DIR/recipe.yaml).")
    parser.add_argument("--preflight", action="store_true", help="Check the allocation and meshes; no training.")
    parser.add_argument("--restart", action="store_true",
                        help="This job continues an earlier job of the run: resume from its checkpoint or fail.")
    args = parser.parse_args(argv)
    env = LauncherEnv()
    started = time.monotonic()
    try:
        recipe = load_recipe(args.recipe)
        recipe = with_fp8_resolved(recipe, capability=_device_capability(recipe, env))
        if args.restart:
            required = recipe.checkpoint.model_copy(update={"resume": "required"})
            recipe = recipe.model_copy(update={"checkpoint": required})
        ctx = bootstrap(recipe, preflight=args.preflight, env=env)
    except RecipeError as error:  # invalid, or a feature the trainer refuses: exit 2, before any mismatch
        for line in error.problems:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return 2
    except LaunchMismatch as error:
        _say(env, str(error), stream=sys.stderr)
        return 1
    except Exception as error:  # a failed rendezvous: one line naming the rank, exit 1
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        _say(env, f"start-up failed: {type(error).__name__}: {reason}", stream=sys.stderr)
        return 1
    if not args.preflight:
        from moe_train.train import train_and_report

        return train_and_report(recipe, ctx)
    try:
        return preflight(recipe, env, ctx, started)
    except Exception as error:  # a failed collective: one line naming the rank, exit 1
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        _say(env, f"preflight failed: {type(error).__name__}: {reason}", stream=sys.stderr)
        return 1
    finally:
        shutdown(ctx)


if __name__ == "__main__":
    sys.exit(main())
