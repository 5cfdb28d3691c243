"""The fp8 products behind the GEMM site (models/linear.py): a linear layer's three GEMMs and the routed
experts' grouped GEMMs, each operand quantised by the recipe (scaling.py) along its reduction dimension.

A product A [M, K] @ B [N, K]^T runs one of two ways, chosen by the per-device kernel table
(moe_train/kernels.py, `fp8_scaled_mm`):
- real: `torch._scaled_mm` on the fp8 data with the inverse scales (tensorwise and rowwise, on the CPU and on
  CUDA), accumulating in fp32 and writing the compute dtype;
- emulated: both operands dequantised to the compute dtype (bf16) and multiplied there: the numerics of the
  quantisation exactly, the speed of bf16 or worse (blockwise and MX everywhere: their `_scaled_mm` scale
  layouts are not built; the routed experts everywhere: `torch._scaled_grouped_mm` has no CPU kernel and is
  not built on CUDA).

Forward y = x W^T quantises x (input) and W (weight) along `in`; backward quantises the output gradient
(grad) along `out` against W^T for the input gradient, and along the tokens against x^T for the weight
gradient, so each GEMM's scales run along its own reduction dimension (as torchao's rowwise recipe recasts
in backward). Only the high-precision x and W are saved for backward: what a bf16 GEMM saves, nothing more.
Master weights, the router, norms, softmax, the loss and the all-to-all payload never come here.

`count_fp8_gemms` tallies every fp8 GEMM a region runs (measure and the tests): kind (linear or grouped),
product (forward, input_grad, weight_grad), real or emulated.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_train.kernels import kernels_for
from moe_train.models.fp8.all_gather import Fp8GatheredWeight
from moe_train.models.fp8.scaling import Quantised, Recipe, Role, dequantised_along_groups, quantise

_TALLIES: list[Counter] = []


@contextlib.contextmanager
def count_fp8_gemms() -> Iterator[Counter]:
    """A Counter of (kind, product, mode) -> fp8 GEMMs run inside the block."""
    tally: Counter = Counter()
    _TALLIES.append(tally)
    try:
        yield tally
    finally:
        _TALLIES.remove(tally)


def _record(kind: str, product: str, mode: str) -> None:
    for tally in _TALLIES:
        tally[(kind, product, mode)] += 1


def runs_real(recipe: Recipe, device: torch.device) -> bool:
    """Whether `recipe`'s linear GEMMs run torch._scaled_mm on this device (the kernel table's fp8 row)."""
    return recipe in kernels_for(device.type).fp8_scaled_mm


def _scaled_mm_scale(scale: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    inverse = scale.reciprocal()
    return inverse.reshape(()) if recipe == "tensorwise" else inverse


def product(a: torch.Tensor, b: torch.Tensor | Quantised, *, recipe: Recipe, roles: tuple[Role, Role], real: bool,
            out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] with both operands in fp8 along K (b already in fp8: as it is)."""
    if a.shape[0] == 0 or b.shape[0] == 0 or a.shape[1] == 0:
        return a.new_zeros(a.shape[0], b.shape[0], dtype=out_dtype)
    qa = quantise(a, recipe=recipe, role=roles[0])
    qb = b if isinstance(b, Quantised) else quantise(b, recipe=recipe, role=roles[1])
    if real:
        return torch._scaled_mm(qa.data, qb.data.t(), scale_a=_scaled_mm_scale(qa.scale, recipe),
                                scale_b=_scaled_mm_scale(qb.scale, recipe).t(), out_dtype=out_dtype)
    return torch.mm(qa.dequantise(out_dtype), qb.dequantise(out_dtype).t())


def _weight_operand(weight: torch.Tensor, *, transposed: bool) -> torch.Tensor | Quantised:
    """A linear weight [out, in] (transposed: [in, out], for the input gradient) as `product` takes it: gathered
    by FSDP2 in fp8 (all_gather.py), its fp8 data and scale as they are; otherwise the high-precision weight."""
    if isinstance(weight, Fp8GatheredWeight):
        return weight.quantised(transposed=transposed)
    return weight.t().contiguous() if transposed else weight


@dataclass(frozen=True)
class Fp8Gemm:
    """What a module marked for fp8 (`Linear.fp8`, `GroupedExperts.fp8`) runs its GEMMs with."""

    recipe: Recipe

    # -------------------------------------------------------------------------------------------- linear
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = _Fp8Linear.apply(x, weight, self)
        return out if bias is None else out + bias

    def _run(self, a: torch.Tensor, b: torch.Tensor | Quantised, roles: tuple[Role, Role], product_name: str,
             out_dtype: torch.dtype) -> torch.Tensor:
        real = runs_real(self.recipe, a.device)
        _record("linear", product_name, "real" if real else "emulated")
        return product(a, b, recipe=self.recipe, roles=roles, real=real, out_dtype=out_dtype)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self._run(rows, _weight_operand(weight, transposed=False), ("input", "weight"), "forward", x.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """grad [..., out] @ weight [out, in] -> [..., in], reduced over `out`."""
        rows = grad.reshape(-1, grad.shape[-1])
        out = self._run(rows, _weight_operand(weight, transposed=True), ("grad", "weight"), "input_grad", grad.dtype)
        return out.view(*grad.shape[:-1], weight.shape[1])

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """grad [..., out]^T @ x [..., in] -> [out, in], reduced over the tokens."""
        grad_rows, rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        return self._run(grad_rows.t().contiguous(), rows.t().contiguous(), ("grad", "input"), "weight_grad",
                         grad.dtype)

    # ------------------------------------------------------------------------------------------- grouped
    def grouped_mm(self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _Fp8GroupedMM.apply(rows, weight, offsets, self)

    def _dequantised_experts(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each expert's [out, K] matrix quantised on its own (its blocks never span two experts)."""
        return quantise(weight, recipe=self.recipe, role="weight").dequantise(dtype)

    def grouped_forward(self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        _record("grouped", "forward", "emulated")
        a = quantise(rows, recipe=self.recipe, role="input").dequantise(rows.dtype)
        b = self._dequantised_experts(weight, rows.dtype)
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)

    def grouped_input_grad(self, grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        _record("grouped", "input_grad", "emulated")
        a = quantise(grad, recipe=self.recipe, role="grad").dequantise(grad.dtype)
        b = self._dequantised_experts(weight.transpose(-2, -1), grad.dtype)  # [E, in, out]: along `out`
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)

    def grouped_weight_grad(self, grad: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Expert e's grad_e^T @ rows_e -> [E, out, in], reduced over its own tokens: both operands quantised
        along each expert's tokens alone (scaling.dequantised_along_groups)."""
        _record("grouped", "weight_grad", "emulated")
        a = dequantised_along_groups(grad, offsets, recipe=self.recipe, role="grad", dtype=grad.dtype)
        b = dequantised_along_groups(rows, offsets, recipe=self.recipe, role="input", dtype=rows.dtype)
        return torch._grouped_mm(a.t(), b, offs=offsets)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, gemm: Fp8Gemm) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.gemm = gemm
        return gemm.forward(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        gemm: Fp8Gemm = ctx.gemm
        grad_input = gemm.input_grad(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = gemm.weight_grad(grad, x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, gemm: Fp8Gemm):
        ctx.save_for_backward(rows, weight, offsets)
        ctx.gemm = gemm
        return gemm.grouped_forward(rows, weight, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight, offsets = ctx.saved_tensors
        gemm: Fp8Gemm = ctx.gemm
        grad = grad.contiguous()
        grad_rows = gemm.grouped_input_grad(grad, weight, offsets) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = gemm.grouped_weight_grad(grad, rows, offsets).to(weight.dtype)
        return grad_rows, grad_weight, None, None
