"""Weight initialisation that depends only on the seed and each tensor's fully-qualified name.

Every tensor draws from its own torch.Generator seeded by a SHA-256 of (seed, name) (the name as `drawn_name`
spells it; Python's hash() changes between processes), on the CPU in fp32, whatever the target device, dtype or
build order. So a model split into pipeline stages, sharded by FSDP, TP or EP, or built on another device starts
from the same weights as the single-process model: a parallel layout can be tested for equality with the plain run.
Rules: RMSNorm weights 1; biases (linear, router, expert stacks) and buffers (the router's expert bias,
telemetry; not its placement table) 0;
every other tensor N(0, init_std). An expert stack [E, ...] draws each expert separately, by the name
`{stack}.{e}`: a rank draws only the experts of its shard (a DeepSeek-V3 expert stack is tens of GB per projection
in fp32 and must never be drawn whole on one rank); any other sharded tensor draws the whole tensor and keeps its
slice. Under an expert placement row s of a stack holds expert `expert_ids[s]` and draws by that expert's name, so
every placement starts from the same experts.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_train.models.moe.experts import GroupedExperts
from moe_train.models.moe.router import Router
from moe_train.models.norm import RMSNorm


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed, stable across processes, machines and Python versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def drawn_name(name: str) -> str:
    """The name a tensor draws by: transformers' (our block's `ffn` is their `mlp`), so the weights a seed gives
    do not change when our module names do (a run started before the `mlp` -> `ffn` rename draws the same)."""
    return name.replace(".ffn.", ".mlp.")


def normal_by_name(shape: torch.Size | tuple[int, ...], *, seed: int, name: str, std: float) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(name_seed(seed, drawn_name(name)))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def local_region(param: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the full tensor that this rank holds: everything for a plain tensor, the DTensor's shard
    otherwise (any placements over any mesh)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def _draw(name: str, param: torch.Tensor, *, expert_stack: bool, seed: int, std: float,
          expert_ids: tuple[int, ...] | None = None) -> torch.Tensor:
    """This rank's part of parameter `name`, drawn as the single-process model draws the whole."""
    region = local_region(param)
    if not expert_stack:
        return normal_by_name(param.shape, seed=seed, name=name, std=std)[region]
    experts = [s if expert_ids is None else expert_ids[s] for s in range(region[0].start, region[0].stop)]
    drawn = [normal_by_name(param.shape[1:], seed=seed, name=f"{name}.{e}", std=std)[region[1:]] for e in experts]
    if not drawn:
        return torch.empty(0, *(r.stop - r.start for r in region[1:]))
    return torch.stack(drawn)


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, init_std: float) -> None:
    """Fill every parameter and buffer of `model` in place by the rules above (this rank's shards only)."""
    norm_weights = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, RMSNorm)}
    expert_stacks = {
        f"{name}.{param_name}": module.expert_ids
        for name, module in model.named_modules()
        if isinstance(module, GroupedExperts)
        for param_name, _ in module.named_parameters(recurse=False)
    }
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if name in norm_weights:
            local.fill_(1.0)
        elif name.endswith((".bias", "_bias")):  # linear and expert-stack biases (`<stack>_bias`)
            local.zero_()
        else:
            local.copy_(_draw(name, param, expert_stack=name in expert_stacks, seed=seed, std=init_std,
                              expert_ids=expert_stacks.get(name)))
    _zero_buffers(model)


def _zero_buffers(model: nn.Module) -> None:
    """Every buffer to zero but the routers' placement tables, which are refilled from their lists."""
    for _, buffer in model.named_buffers():
        buffer.zero_()
    for module in model.modules():
        if isinstance(module, Router):
            module.reset_placement()


def materialize(model: nn.Module, *, device: torch.device | str) -> None:
    """Allocate a meta-device model on `device` without initialising its parameters (a checkpoint load or
    `init_weights` fills them); buffers (expert bias, telemetry) start at zero, the head is tied again."""
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    with torch.no_grad():
        _zero_buffers(model)
