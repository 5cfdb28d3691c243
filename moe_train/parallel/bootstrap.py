"""One start-up path for every process that trains or checks a layout: `run` in-process, the entry under
torchrun/srun, `--preflight` and `measure`.

`bootstrap(recipe)` checks the launch against the recipe once (before any collective, so a job whose
allocation does not match fails within seconds on every rank instead of hanging in a rendezvous), creates the
process group once (a one-rank group when no launcher started us, so the engine has one code path at every
world size), builds the dense and expert meshes once and returns the parallel context.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from moe_train.config import RecipeError, unsupported
from moe_train.config.mesh_shape import MeshShape
from moe_train.parallel.context import ParallelContext
from moe_train.parallel.mesh import build_meshes
from moe_train.runtime import clear_dtensor_cache, torch_problems

if TYPE_CHECKING:
    from moe_train.config import Recipe


class LaunchMismatch(Exception):
    """The launcher gave this rank a world the recipe does not describe: a runtime failure (exit 1)."""


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
        # SLURM's name for the node (several nodes may share a machine, as in the test cluster), else the host's.
        self.host = env.get("SLURMD_NODENAME") or socket.gethostname()


def launcher_problems(recipe: Recipe, env: LauncherEnv) -> list[str]:
    """Mismatches between the launch (torchrun, SLURM allocation) and the recipe, found without any collective."""
    launch = recipe.launch
    out = []
    shape = f"launch.nodes {launch.nodes} x launch.gpus_per_node {launch.gpus_per_node} = {recipe.world_size}"
    if env.world_size != recipe.world_size:
        out.append(f"world size {env.world_size} from the launcher does not match the recipe's {shape}")
    # On CPU every rank of a several-node recipe may run on this machine, each node emulated by gpus_per_node
    # consecutive ranks (rank // gpus_per_node): what tests the node-aware dispatcher here (`run --nproc N`
    # with N the recipe's world size).
    emulated = launch.device == "cpu" and env.local_world_size == env.world_size == recipe.world_size
    if env.under_launcher and env.local_world_size != launch.gpus_per_node and not emulated:
        out.append(f"{env.local_world_size} rank(s) on this node, the recipe's launch.gpus_per_node is "
                   f"{launch.gpus_per_node}")
    if env.slurm_nodes is not None and env.slurm_nodes != launch.nodes:
        out.append(f"the SLURM allocation has {env.slurm_nodes} node(s), the recipe's launch.nodes is {launch.nodes}")
    out += MeshShape.from_recipe(recipe).problems(recipe.world_size)
    out += torch_problems()
    if recipe.train.precision == "fp8":
        import torch

        from moe_train.models.fp8.runtime import fp8_problems

        out += fp8_problems(recipe.train.fp8.recipe, torch.device("cpu" if launch.device == "cpu" else "cuda"),
                            backend=recipe.train.fp8.backend)
    if launch.device == "cuda":
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < env.local_world_size:
            out.append(f"{visible} CUDA device(s) visible, {env.local_world_size} rank(s) on this node need one each")
    return out


def bootstrap(recipe: Recipe, *, preflight: bool = False, env: LauncherEnv | None = None,
              distinct_groups: bool = False) -> ParallelContext:
    """Check the launch, create the process group (unless one exists) and both meshes; return the context.
    `distinct_groups`: every mesh dimension gets its own process group (see `build_meshes`; measure uses it).

    Raises RecipeError (exit 2) for a recipe that uses a feature the engine cannot train yet (not for a
    preflight, which only proves the allocation), LaunchMismatch (exit 1) when the launcher's world differs
    from the recipe's. Every rank calls this with the same recipe.
    """
    import torch
    import torch.distributed as dist

    env = env or LauncherEnv()
    problems = [] if preflight else unsupported(recipe)
    if problems:
        raise RecipeError(problems)
    if dist.is_initialized():  # a test harness or an earlier bootstrap of this process made the group
        env.world_size, env.rank = dist.get_world_size(), dist.get_rank()
    mismatch = launcher_problems(recipe, env)
    if mismatch:
        raise LaunchMismatch("; ".join(mismatch))
    from moe_train.train.determinism import apply_determinism

    apply_determinism(recipe.train.deterministic)  # before CUDA starts: cuBLAS reads its workspace setting once
    if recipe.launch.device == "cuda":
        from moe_train.train.device_stats import enable_tf32

        enable_tf32()
        torch.cuda.set_device(env.local_rank)
        device, backend = torch.device("cuda", env.local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        if env.world_size > 1:
            torch.set_num_threads(1)  # ranks share the cores; oversubscription is many times slower
    created = not dist.is_initialized()
    if created:
        # The start-up timeout until the first step has run (moe_train/runtime.py: use_step_timeout). device_id
        # binds NCCL to this rank's GPU: communicators are created eagerly on it, not guessed at first use.
        timeout = timedelta(minutes=recipe.launch.startup_timeout_minutes)
        device_id = device if device.type == "cuda" else None
        if backend == "nccl":  # read when the NCCL group is created: a hang's collectives land in the run folder
            from moe_train.train.hang_report import enable_flight_recorder

            enable_flight_recorder(Path(recipe.resolved_run_dir()) / "logs")
        if env.under_launcher:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    device_id=device_id)
    meshes = build_meshes(MeshShape.from_recipe(recipe), recipe.launch.device, distinct_groups=distinct_groups)
    forget_dtensor_shardings()
    return ParallelContext(
        shape=meshes.shape,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=device,
        dense=meshes.dense,
        expert=meshes.expert,
        dense_split=meshes.dense_split,
        expert_split=meshes.expert_split,
        owns_process_group=created,
        distinct_groups=distinct_groups,
    )


def forget_dtensor_shardings() -> None:
    """Empty DTensor's sharding caches (Python and C++). They keep each decision with its meshes, and meshes of
    the same shape compare equal whatever their process groups: after an earlier bootstrap in this process
    (tests, `measure --fake` run after run) DTensor would reduce over that bootstrap's groups, which may be gone
    ("Could not resolve the process group") or not the ones this context names."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_dtensor_cache()


def shutdown(ctx: ParallelContext) -> None:
    """Destroy the process group if bootstrap created it (every rank, after its last collective)."""
    import torch.distributed as dist

    if ctx.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
