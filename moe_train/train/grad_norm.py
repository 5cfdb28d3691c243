"""The global gradient norm and clipping over every mesh the parameters live on.

Parameters are DTensors on different meshes (dense on dp, experts on edp; later tp, ep and pipeline stages),
and one foreach norm over DTensors of different meshes is refused. So the norm is taken per mesh (each a
full-tensor norm, identical on every rank of that mesh) and the squares are added; ranks that hold other
pipeline stages add theirs through `stage_group`. Every rank then agrees on the norm, hence on clipping and on
whether a step is non-finite.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _norm_of(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float | None,
    *,
    stage_group: dist.ProcessGroup | None = None,
    duplicates: Iterable[torch.nn.Parameter] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm` (None: no clipping); returns the norm
    before clipping (what metrics.jsonl logs as grad_norm: `host_norm` reads it), on the device: the step reads
    nothing on the host (step.py). `duplicates`: parameters that are another stage's copy (a pipeline's second
    embedding), clipped like the rest but counted once in the norm. `device`: the training device (ctx.device),
    where the sum lives even on a rank without a counted gradient: under pp > 1 that rank still all-reduces it,
    and NCCL takes no CPU tensor."""
    skip = {id(param) for param in duplicates}
    by_mesh: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
    counted: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh[mesh].append(param)
            if id(param) not in skip:
                counted[mesh].append(param)
    device = device if device is not None else _device_of(by_mesh)
    squares = torch.zeros((), dtype=torch.float32, device=device)
    if counted:
        squares = torch.stack([_norm_of([p.grad for p in params]).float() ** 2 for params in counted.values()]).sum()
    if stage_group is not None and dist.get_world_size(stage_group) > 1:
        dist.all_reduce(squares, group=stage_group)
    elif not by_mesh:
        return squares
    total = squares.sqrt()
    if max_norm is not None:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def host_norm(norm: torch.Tensor) -> float:
    """The norm read on the host; NaN for any non-finite one (JSON writes it as null, and infinity and NaN
    mean the same to the step: not applied)."""
    value = norm.item()
    return value if math.isfinite(value) else float("nan")


def _device_of(by_mesh: dict[object, list[torch.nn.Parameter]]) -> torch.device:
    for params in by_mesh.values():
        return params[0].grad.device
    return torch.device("cpu")
