"""The routed experts' weighted SwiGLU, silu(gate) * up * probs, keeping for backward only its inputs.

Autograd's composite keeps gate (for silu), silu(gate) and up (for the first product), and the unweighted
product and probs (for the weighting): two [rows, ffn] tensors more than the backward needs, since silu(gate)
and the product are each one elementwise op from gate and up. This Function keeps gate, up and probs and forms
silu(gate) and the product again in backward, by the same ops as the forward, so they come back bit for bit;
the gradients are then formed by the ops autograd's composite runs, in its order (mul's backward, its
broadcast sum to probs' shape, `aten.silu_backward`), so they equal today's bit for bit as well, in every dtype.
It frees what recomputing `moe_act` (parallel.recompute) freed, without the recompute.

gpt-oss's clamped form (`ClampedWeightedSwiGLU`) likewise keeps gate, up and probs where autograd's composite
kept seven [rows, ffn] tensors (the clamps' inputs, the sigmoid and the products), its gradients written out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class WeightedSwiGLU(torch.autograd.Function):
    """silu(gate) * up * probs (probs broadcast over the ffn dimension, [rows, 1] or [experts, rows, 1])."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, probs)
        return F.silu(gate) * up * probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, probs = ctx.saved_tensors
        silu = F.silu(gate)
        grad_act = grad * probs
        grad_probs = None
        if ctx.needs_input_grad[2]:
            grad_probs = (grad * (silu * up)).sum_to_size(probs.shape)
        grad_up = grad_act * silu if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad_act * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, grad_probs


def weighted_swiglu(gate: torch.Tensor, up: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return WeightedSwiGLU.apply(gate, up, probs)


class ClampedWeightedSwiGLU(torch.autograd.Function):
    """gpt-oss's (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) * probs, g = min(gate, limit): the same
    forward ops as transformers' GptOssExperts, backward from gate, up and probs alone (a clamp passes the
    gradient where its input is within its bounds, bounds included, as torch's clamp does)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, probs: torch.Tensor, limit: float,
                alpha: float) -> torch.Tensor:
        ctx.save_for_backward(gate, up, probs)
        ctx.limit, ctx.alpha = limit, alpha
        clamped = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (clamped * torch.sigmoid(clamped * alpha)) * probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, probs = ctx.saved_tensors
        limit, alpha = ctx.limit, ctx.alpha
        clamped = gate.clamp(max=limit)
        sigmoid = torch.sigmoid(clamped * alpha)
        glu, shifted = clamped * sigmoid, up.clamp(-limit, limit) + 1
        grad_probs = (grad * (shifted * glu)).sum_to_size(probs.shape) if ctx.needs_input_grad[2] else None
        grad_act = grad * probs
        grad_up = grad_act * glu * ((up >= -limit) & (up <= limit)) if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            grad_glu = grad_act * shifted * (sigmoid * (1 + clamped * alpha * (1 - sigmoid)))
            grad_gate = grad_glu * (gate <= limit)
        return grad_gate, grad_up, grad_probs, None, None


def clamped_weighted_swiglu(gate: torch.Tensor, up: torch.Tensor, probs: torch.Tensor, *, limit: float,
                            alpha: float) -> torch.Tensor:
    return ClampedWeightedSwiGLU.apply(gate, up, probs, limit, alpha)
