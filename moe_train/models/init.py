"""Weight initialisation that depends only on the seed and each tensor's fully-qualified name.

Every tensor draws from its own torch.Generator seeded by a SHA-256 of (seed, name) (Python's hash() changes
between processes), on the CPU in fp32, whatever the target device, dtype or build order. So a model split
into pipeline stages, sharded by FSDP or built on another device starts from the same weights as the
single-process model: a parallel layout can be tested for equality with the plain run.
Rules: RMSNorm weights 1; biases and buffers (the router's expert bias) 0; every other tensor N(0, init_std).

A DTensor parameter (TP, FSDP2, or experts sharded over an expert mesh) is filled with its local slice of the
full tensor that the single-process model would draw: every rank draws the full tensor and keeps its shard
(no communication). A layout that keeps plain local tensors must slice `normal_by_name` of the global shape.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moe_train.models.norm import RMSNorm


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed, stable across processes, machines and Python versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def normal_by_name(shape: torch.Size, *, seed: int, name: str, std: float) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, init_std: float) -> None:
    """Fill every parameter and buffer of `model` in place by the rules above."""
    norm_weights = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, RMSNorm)}
    for name, param in model.named_parameters():
        if name in norm_weights:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            full = normal_by_name(param.shape, seed=seed, name=name, std=init_std)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)
    for _, buffer in model.named_buffers():
        buffer.zero_()


def materialize(model: nn.Module, *, device: torch.device | str, seed: int, init_std: float) -> None:
    """Allocate a meta-device model on `device` and initialise it (ties the head again if it ties)."""
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    init_weights(model, seed=seed, init_std=init_std)
