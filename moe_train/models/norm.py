"""RMSNorm, computed in fp32 whatever the activation dtype (as transformers does), so bf16 runs stay stable.

The backward is written out (`_RMSNorm`) rather than left to autograd: autograd differentiates the forward's
six elementwise ops one by one, broadcasts over the normalised dimension included, which made a norm's
backward ten times its forward (the four norms of a qwen3-moe-tiny layer, q/k norms over head_dim 16 among
them, were ~15% of the default run's step). It keeps for backward only the input as it came (in bf16 runs not
its fp32 copy: widening is exact) and the fp32 reciprocal rms per token; the normalised value the weight's
gradient needs is formed again from those two, the same operations on the same numbers as the forward
(moe_train/plan/saved_tensors.py counts those bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_train.models.layout_region import LayoutRegion


class _RMSNorm(torch.autograd.Function):
    """weight * (x / rms(x)): rms over the last dimension in fp32, the product in the activation dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        x32 = x.float()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            normalized = (x32 * rstd).to(x.dtype)
            grad_weight = (grad * normalized).sum(dim=tuple(range(grad.dim() - 1)))
        if ctx.needs_input_grad[0]:
            # d/dx of x * rstd with rstd = (mean x^2 + eps)^-1/2: rstd * (g - x * rstd^2 * mean(g * x)).
            g = (grad * weight).float()
            grad_x = (rstd * (g - x32 * (rstd.square() * (g * x32).mean(-1, keepdim=True)))).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """x / rms(x) * weight. The weight is created uninitialised: `models.init` sets it to ones by name.

    Layouts (`layout_forward`): a decoder block's two norms are the `layernorm` region of recomputation and
    offloading (parallel/recompute.py, parallel/offload.py)."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.layout_forward = LayoutRegion(RMSNorm._forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout_forward(self, x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)
