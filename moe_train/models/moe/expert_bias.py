"""Aux-loss-free load balancing (DeepSeek-V3): nudge each expert's selection bias against its load.

The trainer calls this after each optimizer step with the token counts of the whole global batch (all-reduced
over ranks first), so every replica of the bias moves identically. It is a plain in-place update, never a
gradient: the bias only affects which experts are chosen, not the weights.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> None:
    """bias += rate * sign(mean load - load): overloaded experts go down, underloaded go up, balanced stay."""
    load = tokens_per_expert.to(device=bias.device, dtype=torch.float32)
    bias.add_(torch.sign(load.mean() - load).to(bias.dtype), alpha=rate)
