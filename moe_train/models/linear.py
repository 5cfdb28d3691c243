"""The model's GEMM site: every matrix product with a weight runs through a function of this file.

Attention projections, MLPs, shared experts, the router, MTP's projection and the head call `linear` (through
the `Linear` module, or directly on a weight); the routed experts call `grouped_mm` (or `batched_mm` on rows
padded per expert, where the grouped GEMM does not run); the tensor-parallel styles (parallel/tensor.py) call
the same functions on their local shards, and the sequence-parallel column GEMM's hand-written backward calls
`linear_input_grad` / `linear_weight_grad`, as does the chunked head + loss (models/loss.py
`linear_cross_entropy_sum`). So a precision or kernel choice (FP8 with its scales) is made in one place, for
every layout. No other module of models/ or parallel/ calls F.linear, matmul or a grouped GEMM
(tests/test_gemm_site.py checks).

FP8 (`train.precision: fp8`): each function takes the `fp8` of the module it serves (`Linear.fp8`,
`GroupedExperts.fp8`, set by models/fp8/select.py for the GEMMs `train.fp8.modules` names; None: the compute
dtype's GEMM) and hands the product to models/fp8/gemm.py, the site's fp8 half.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_train.models.fp8.gemm import Fp8Gemm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias) -> [..., out]."""
    if fp8 is not None:
        return fp8.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, *, fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """The gradient of `linear`'s input: grad [..., out] @ weight [out, in] -> [..., in]."""
    if fp8 is not None:
        return fp8.input_grad(grad, weight)
    return grad.matmul(weight)


def linear_weight_grad(grad: torch.Tensor, x: torch.Tensor, *, fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """The gradient of `linear`'s weight: grad [..., out]^T @ x [..., in] -> [out, in], summed over the rows."""
    if fp8 is not None:
        return fp8.weight_grad(grad, x)
    return grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


def attention_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, k] @ b [..., k, n]: the weightless products of attention written by hand (context
    parallelism's score tiles and their gradients, parallel/ring_attention.py), here so that the site still
    holds every matrix product a precision or kernel choice may have to see."""
    return a.matmul(b)


def expert_offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """[E] int32 end row of each expert's rows: what `grouped_mm` takes (computed once per expert layer)."""
    return torch.cumsum(tokens_per_expert, 0).to(torch.int32)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
               fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """rows [N, in] sorted by expert (expert e's rows end at offsets[e]) @ weight [E, out, in]^T per expert ->
    [N, out], all experts in one kernel (torch._grouped_mm; `GroupedExperts` falls back to `linear` per
    expert where it cannot run)."""
    if fp8 is not None:
        return fp8.grouped_mm(rows, weight, offsets)
    return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


def batched_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [E, rows, in] @ weight [E, out, in]^T per expert -> [E, rows, out]: every expert's (padded) rows in one
    batched GEMM (`GroupedExperts`' padded path, where torch._grouped_mm does not run)."""
    return torch.bmm(x, weight.transpose(-2, -1))


# The input and weight gradients of `grouped_mm` and `batched_mm` (compute dtype), written as their autograd
# formulas compute them (the same kernels on the same operands, so bit for bit: tests/test_deferred_wgrad.py), for
# the routed experts' delayed weight gradients (models/moe/deferred_wgrad.py), which take the two apart.
def grouped_mm_input_grad(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad [N, out] @ weight [E, out, in] per expert -> [N, in]."""
    return torch._grouped_mm(grad, weight, offs=offsets)


def grouped_mm_weight_grad(grad: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Expert e's grad_e^T @ rows_e -> [E, out, in], summed over its own rows."""
    return torch._grouped_mm(grad.t(), rows, offs=offsets)


def batched_mm_input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad [E, rows, out] @ weight [E, out, in] -> [E, rows, in]."""
    return torch.bmm(grad, weight)


def batched_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(x [E, rows, in]^T @ grad [E, rows, out])^T -> [E, out, in], summed over the rows."""
    return torch.bmm(x.transpose(1, 2), grad).transpose(1, 2)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose product runs through `linear`; `fp8` (a class
    default of None, set per module by models/fp8/select.py) is what its GEMMs run in fp8 with.

    Layouts: `parallel` (a class default of None, set per module by tensor parallelism, parallel/tensor.py) is
    the GEMM under tp, column-parallel (weight rows sharded, the input entering the tp region) or row-parallel
    (columns sharded, the partial sums reduced); called with the module and the input."""

    fp8: Fp8Gemm | None = None
    parallel: Callable[[Linear, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            return self.parallel(self, x)
        return linear(x, self.weight, self.bias, fp8=self.fp8)
