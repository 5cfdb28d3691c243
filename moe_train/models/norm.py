"""RMSNorm, computed in fp32 whatever the activation dtype (as transformers does), so bf16 runs stay stable.

The backward is written out (`_RMSNorm`) rather than left to autograd: autograd differentiates the forward's
six elementwise ops one by one, broadcasts over the normalised dimension included, which made a norm's
backward ten times its forward (the four norms of a qwen3-moe-tiny layer, q/k norms over head_dim 16 among
them, were ~15% of the default run's step). The forward and what it keeps for backward are unchanged: the fp32
input, the fp32 reciprocal rms per token and the normalised value in the activation dtype
(moe_train/plan/saved_tensors.py counts those bytes).
"""

from __future__ import annotations

import torch
from torch import nn


class _RMSNorm(torch.autograd.Function):
    """weight * (x / rms(x)): rms over the last dimension in fp32, the product in the activation dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normalized = (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x32, rstd, normalized, weight)
        ctx.input_dtype = x.dtype
        return weight * normalized

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x32, rstd, normalized, weight = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normalized).sum(dim=tuple(range(grad.dim() - 1)))
        if ctx.needs_input_grad[0]:
            # d/dx of x * rstd with rstd = (mean x^2 + eps)^-1/2: rstd * (g - x * rstd^2 * mean(g * x)).
            g = (grad * weight).float()
            grad_x = (rstd * (g - x32 * (rstd.square() * (g * x32).mean(-1, keepdim=True)))).to(ctx.input_dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """x / rms(x) * weight. The weight is created uninitialised: `models.init` sets it to ones by name."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)
