"""What torchrun (or srun + torchrun) starts on every rank: `python -m moe_train.entry --recipe R [--preflight]`.

Before any collective, each rank compares what the launcher gave it (WORLD_SIZE, LOCAL_WORLD_SIZE, the SLURM
node count, visible GPUs) with the recipe, so a job whose allocation does not match fails within seconds on
every rank with one line, instead of hanging in a rendezvous or a collective until a timeout. `--preflight`
then builds the dense and expert meshes, runs one all-reduce on every mesh dimension's group, prints the
rank table and exits: a cheap job of the real shape that proves the allocation before the real run.

Exit codes: 0 success, 1 a runtime failure (mismatch, collective failure), 2 an invalid or unsupported recipe.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

from moe_train.config import Recipe, RecipeError, load_recipe, unsupported
from moe_train.parallel.mesh import MeshShape, build_meshes, coords_text, format_coords

PREFIX = "moe-train entry"


class LauncherEnv:
    """The rank's place as the launcher describes it; a plain process (no torchrun) is rank 0 of 1."""

    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.under_launcher = "WORLD_SIZE" in env
        self.rank = int(env.get("RANK", 0))
        self.world_size = int(env.get("WORLD_SIZE", 1))
        self.local_rank = int(env.get("LOCAL_RANK", 0))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))
        nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
        self.slurm_nodes = int(nodes) if nodes else None
        self.host = socket.gethostname()


def launcher_problems(recipe: Recipe, env: LauncherEnv) -> list[str]:
    """Mismatches between the launch (torchrun, SLURM allocation) and the recipe, found without any collective."""
    launch = recipe.launch
    out = []
    shape = f"launch.nodes {launch.nodes} x launch.gpus_per_node {launch.gpus_per_node} = {recipe.world_size}"
    if env.world_size != recipe.world_size:
        out.append(f"world size {env.world_size} from the launcher does not match the recipe's {shape}")
    if env.local_world_size != launch.gpus_per_node:
        out.append(f"{env.local_world_size} rank(s) on this node, the recipe's launch.gpus_per_node is "
                   f"{launch.gpus_per_node}")
    if env.slurm_nodes is not None and env.slurm_nodes != launch.nodes:
        out.append(f"the SLURM allocation has {env.slurm_nodes} node(s), the recipe's launch.nodes is {launch.nodes}")
    out += MeshShape.from_recipe(recipe).problems(recipe.world_size)
    if launch.device == "cuda":
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < env.local_world_size:
            out.append(f"{visible} CUDA device(s) visible, {env.local_world_size} rank(s) on this node need one each")
    return out


def _emit(text: str, stream=None) -> None:
    """One write per message, newline included: ranks share the launcher's pipe, and print()'s separate write
    of the newline let another rank's line land between a line and its end (seen under load)."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def _say(env: LauncherEnv, message: str, *, stream=None) -> None:
    _emit(f"{PREFIX}: rank {env.rank}/{env.world_size} on {env.host}: {message}", stream)


def _init_process_group(recipe: Recipe, env: LauncherEnv) -> str:
    import torch
    import torch.distributed as dist

    timeout = timedelta(minutes=recipe.launch.timeout_minutes)
    if recipe.launch.device == "cuda":
        torch.cuda.set_device(env.local_rank)
        backend = "nccl"
    else:
        torch.set_num_threads(1)
        backend = "gloo"
    if env.under_launcher:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return backend


def preflight(recipe: Recipe, env: LauncherEnv) -> int:
    """Meshes, one all-reduce per mesh dimension, the rank table; every rank prints its own line too."""
    import torch
    import torch.distributed as dist

    start = time.monotonic()
    backend = _init_process_group(recipe, env)
    try:
        shape = MeshShape.from_recipe(recipe)
        meshes = build_meshes(shape, recipe.launch.device)
        expected = format_coords(shape, env.rank)
        actual = coords_text(meshes.dense.get_coordinate(), meshes.expert.get_coordinate())
        if actual != expected:
            _say(env, f"mesh coordinates {actual} differ from the layout's {expected}", stream=sys.stderr)
            return 1
        device = torch.device("cuda", env.local_rank) if recipe.launch.device == "cuda" else torch.device("cpu")
        checked = 0
        for mesh in (meshes.dense, meshes.expert):
            for name in mesh.mesh_dim_names:
                group = mesh.get_group(name)
                ones = torch.ones(1, device=device)
                dist.all_reduce(ones, group=group)
                size = dist.get_world_size(group)
                if int(ones.item()) != size:
                    _say(env, f"all-reduce over {name} summed {ones.item()} on {size} ranks", stream=sys.stderr)
                    return 1
                checked += 1
        rows: list = [None] * env.world_size
        dist.all_gather_object(rows, (env.rank, env.host, env.local_rank, actual))
        elapsed = time.monotonic() - start
        if env.rank == 0:
            _emit(_table(recipe, shape, backend, rows))
        _say(env, f"local rank {env.local_rank}: {actual}; {checked} all-reduces ok in {elapsed:.1f}s")
        dist.barrier()
    finally:
        dist.destroy_process_group()
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


def train(recipe: Recipe) -> int:
    """Hand over to the trainer (the caller has refused features it cannot train yet); it maps its own errors
    to exit codes and one-line messages."""
    try:
        from moe_train.train import train_and_report
    except ImportError:
        print("error: training is not supported yet (moe_train.train has no train_and_report)", file=sys.stderr)
        return 2
    return train_and_report(recipe)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_train.entry", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, type=Path, help="The resolved recipe (RUN_DIR/recipe.yaml).")
    parser.add_argument("--preflight", action="store_true", help="Check the allocation and meshes; no training.")
    args = parser.parse_args(argv)
    env = LauncherEnv()
    try:
        recipe = load_recipe(args.recipe)
        # A feature the trainer refuses is invalid input too: exit 2 here, before a launcher mismatch (exit 1).
        invalid = [] if args.preflight else unsupported(recipe)
    except RecipeError as error:
        invalid = error.problems
    if invalid:
        for line in invalid:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return 2
    problems = launcher_problems(recipe, env)
    if problems:
        _say(env, "; ".join(problems), stream=sys.stderr)
        return 1
    if not args.preflight:
        return train(recipe)
    try:
        return preflight(recipe, env)
    except Exception as error:  # a failed rendezvous or collective: one line naming the rank, exit 1
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        _say(env, f"preflight failed: {type(error).__name__}: {reason}", stream=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
