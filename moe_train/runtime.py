"""What the engine needs from the installed torch, checked once at start-up, and the process-group timeouts.

pyproject states the range of torch that is tested (`TESTED_TORCH`); pip enforces it on an ordinary install, but
a cluster image installs the project with `--no-deps` over its own torch, so the APIs the engine calls are
probed at start-up instead: a rank whose torch lacks one stops with one line naming the version, before any
collective, instead of an AttributeError in the middle of the first step.

Timeouts: start-up (rendezvous, the mesh groups, NCCL's communicators, the checkpoint load, the first step)
can take far longer than one training step on a large job, while a hung step should fail fast. So the process
group starts with `launch.startup_timeout_minutes` and `use_step_timeout` lowers every group to
`launch.timeout_minutes` once the first step has run.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.parallel.context import ParallelContext

# cuBLAS picks non-deterministic reduction splits unless its workspace is fixed; it reads this once, when CUDA
# starts, so it must be in the environment before the process touches CUDA (train.deterministic: bootstrap sets
# it, and the rendered job exports it, moe_train/launch/job_env.py).
DETERMINISTIC_ENV: dict[str, str] = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

TESTED_TORCH = ">=2.11,<2.14"  # pyproject's dependency; 2.11 is what current CUDA images (and the H200) ship

# (module path, attribute): the public APIs newer than torch's older releases that the engine calls.
REQUIRED_APIS: tuple[tuple[str, str], ...] = (
    ("torch.distributed", "all_gather_single"),
    ("torch.distributed", "reduce_scatter_single"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.fsdp", "fully_shard"),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy"),
    ("torch.nn.utils", "get_total_norm"),
    ("torch.nn.utils", "clip_grads_with_norm_"),
    ("torch.distributed.pipelining", "PipelineStage"),
)


def torch_problems() -> list[str]:
    """One line per API the installed torch lacks (empty when every one is there). Imports torch."""
    import importlib

    import torch

    missing = []
    for module_name, attribute in REQUIRED_APIS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        if module is None or not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute}")
    if not missing:
        return []
    return [f"torch {torch.__version__} lacks {', '.join(missing)} (moe-train is tested with torch {TESTED_TORCH})"]


def clear_dtensor_cache() -> None:
    """Empty DTensor's C++ sharding-propagation cache. Private API (torch._C), so absent is tolerated: the cache
    only goes stale when one process bootstraps twice (tests, `measure` run after run), never in a training
    job's fresh process, and those callers are tested on the torch this project pins."""
    import torch

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def use_step_timeout(ctx: ParallelContext, minutes: float) -> None:
    """Set the timeout of every process group this rank uses (the default one and each mesh dimension's) to
    `minutes`. `_set_pg_timeout` is private but has existed since torch 2.3 for gloo and NCCL; where it is
    absent the start-up timeout stays in force (longer, never wrong)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None or not dist.is_initialized():
        return
    timeout = timedelta(minutes=minutes)
    groups = {id(dist.group.WORLD): dist.group.WORLD}
    for mesh in (ctx.dense, ctx.expert, *ctx.flattened.values()):
        for name in mesh.mesh_dim_names:
            group = mesh.get_group(name)
            groups[id(group)] = group
    for group in ctx.named_groups.values():
        groups[id(group)] = group
    for group in groups.values():
        set_timeout(timeout, group)
