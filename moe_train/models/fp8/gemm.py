"""The fp8 products behind the GEMM site (models/linear.py): a linear layer's three GEMMs and the routed
experts' grouped GEMMs, each operand quantised by the recipe (scaling.py) along its reduction dimension.

A product A [M, K] @ B [N, K]^T runs one of two ways, chosen by the per-device kernel table by device kind and
compute capability (moe_train/kernels.py, `fp8_kernel`; `runs_real`):
- real: `torch._scaled_mm` on the fp8 data with the decode scales in the layout its recipe needs (layouts.py):
  tensorwise and rowwise on the CPU and on CUDA from sm89, blockwise on sm90, MX on sm100; on CUDA the operands
  are zero-padded to the kernel's multiples first (exact) and the output cut back. It accumulates in fp32 and
  writes the compute dtype. The routed experts' forward and input gradient: `torch._scaled_grouped_mm` with
  per-row scales (tensorwise, rowwise) on sm90 and sm100, e4m3 operands only (tensorwise's e5m2 output gradient
  is quantised in e4m3 for it: the kernel table's `fp8_operand_format`);
- emulated: both operands dequantised to the compute dtype (bf16) and multiplied there: the numerics of the
  quantisation exactly, the speed of bf16 or worse (every recipe and device the table names no kernel for; the
  experts' weight gradient everywhere; a kernel the start-up probe saw fail: `fall_back`).

Forward y = x W^T quantises x (input) and W (weight) along `in`; backward quantises the output gradient
(grad) along `out` against W^T for the input gradient, and along the tokens against x^T for the weight
gradient, so each GEMM's scales run along its own reduction dimension (as torchao's rowwise recipe recasts
in backward). Master weights, the router, norms, softmax, the loss and the all-to-all payload never come here.

What a GEMM keeps for backward (`train.fp8.saved_inputs`): `bf16` the high-precision x and W, what a bf16 GEMM
keeps, re-quantised in backward; `fp8` x already quantised the way its one backward reader, the weight
gradient, quantises it (along the tokens: x^T [in, tokens] in the recipe's activation blocks; tensorwise: the
forward's own fp8 x, one scale either way round; the grouped experts' rows along each expert's own tokens,
scaling.quantise_along_groups), fp8 data and fp32 scales, as Megatron-Core with transformer-engine and
DeepSeek-V3 ("cache the activations in FP8") keep them. Backward then computes what it computed from the bf16
x, bit for bit (the same quantisation of the same values). The input gradient reads only W and the output
gradient. W stays as it is (a parameter: no activation memory). GEMMs reading the same input (q/k/v, MLA's
two down projections, gate and up) share one fp8 copy (`_kept`).

`count_fp8_gemms` tallies every fp8 GEMM a region runs (measure and the tests): kind (linear or grouped),
product (forward, input_grad, weight_grad), real or emulated; `count_fp8_flops` their FLOPs by the same keys (2 x
M x N x K of the product as the model asks for it: CUDA's zero padding to the kernel's multiples is not counted),
which plan's `fp8_gemm_flops` predicts.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.weak import WeakIdKeyDictionary

from moe_train.kernels import fp8_kernel, fp8_operand_format
from moe_train.models.fp8.all_gather import Fp8GatheredWeight
from moe_train.models.fp8.layouts import kernel_multiples, padded, row_scales, scaled_mm_scales
from moe_train.models.fp8.scaling import (
    E5M2,
    FORMATS,
    GroupQuantised,
    Quantised,
    Recipe,
    Role,
    block_shape,
    dequantised_along_groups,
    fp8_dtype,
    padded_quantised,
    quantise,
    quantise_along_groups,
)

SavedInputs = Literal["bf16", "fp8"]

_GEMM_TALLIES: list[Counter] = []
_FLOP_TALLIES: list[Counter] = []


@contextlib.contextmanager
def _tallying(tallies: list[Counter]) -> Iterator[Counter]:
    tally: Counter = Counter()
    tallies.append(tally)
    try:
        yield tally
    finally:
        tallies.remove(tally)


def count_fp8_gemms() -> contextlib.AbstractContextManager[Counter]:
    """A Counter of (kind, product, mode) -> fp8 GEMMs run inside the block."""
    return _tallying(_GEMM_TALLIES)


def count_fp8_flops() -> contextlib.AbstractContextManager[Counter]:
    """A Counter of (kind, product, mode) -> FLOPs of the fp8 GEMMs run inside the block."""
    return _tallying(_FLOP_TALLIES)


def _record(kind: str, product: str, mode: str, *, rows: int, reduced: int, columns: int) -> None:
    """One fp8 GEMM of [rows, reduced] x [reduced, columns] (grouped: every group's rows together)."""
    for tally in _GEMM_TALLIES:
        tally[(kind, product, mode)] += 1
    for tally in _FLOP_TALLIES:
        tally[(kind, product, mode)] += 2 * rows * reduced * columns


# (device kind, recipe, grouped) -> why its real kernel is not used in this process (the start-up probe saw it fail)
_FALLEN_BACK: dict[tuple[str, str, bool], str] = {}


# device kind -> its compute capability, read once (the start-up probe reads it, before anything compiles, so a
# compiled region finds a plain dict entry). One process drives one GPU; a node's GPUs are of one kind.
_CAPABILITY: dict[str, tuple[int, int]] = {}


def capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of `device` (None off CUDA)."""
    if device.type != "cuda":
        return None
    if device.type not in _CAPABILITY:
        _CAPABILITY[device.type] = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
    return _CAPABILITY[device.type]


def kernel_choice(recipe: Recipe, device: torch.device, *, grouped: bool = False) -> tuple[bool, str]:
    """(real, why) for `recipe`'s linear (or routed experts' `grouped`) fp8 GEMMs on `device`: the kernel table's
    choice for its kind and capability, unless the start-up probe made this process fall back."""
    fallen = _FALLEN_BACK.get((device.type, recipe, grouped))
    if fallen is not None:
        return False, fallen
    return fp8_kernel(recipe, device.type, capability(device), grouped=grouped)


def runs_real(recipe: Recipe, device: torch.device, *, grouped: bool = False) -> bool:
    """Whether `recipe`'s linear (or `grouped`) GEMMs run torch's scaled kernel on this device."""
    return kernel_choice(recipe, device, grouped=grouped)[0]


def fall_back(recipe: Recipe, device: torch.device, *, grouped: bool, why: str) -> None:
    """Run `recipe`'s linear (or `grouped`) GEMMs emulated on this kind of device in this process, for `why`."""
    _FALLEN_BACK[(device.type, recipe, grouped)] = why


Operand = torch.Tensor | Quantised


def _quantised(x: Operand, *, recipe: Recipe, role: Role, multiples: tuple[int, int] | None) -> Quantised:
    """x in fp8 along K, zero-padded to `multiples` (rows, K) first (None: as it is): quantised here, or padded as
    quantising the padded tensor would have given it (`scaling.padded_quantised`: the same bits)."""
    if isinstance(x, Quantised):
        return x if multiples is None else padded_quantised(x, *multiples, recipe=recipe, role=role)
    return quantise(x if multiples is None else padded(x, *multiples), recipe=recipe, role=role)


def _scaled_mm(a: Operand, b: Operand, *, recipe: Recipe, roles: tuple[Role, Role],
               out_dtype: torch.dtype, multiples: tuple[int, int] | None) -> torch.Tensor:
    """torch._scaled_mm of a [M, K] @ b [N, K]^T, each operand zero-padded to `multiples` (rows, K) first (None:
    as they are, the CPU kernel's way) and the output cut back to [M, N]."""
    m, n = (x.data.shape[0] if isinstance(x, Quantised) else x.shape[0] for x in (a, b))
    qa, qb = (_quantised(x, recipe=recipe, role=role, multiples=multiples) for x, role in zip((a, b), roles,
                                                                                              strict=True))
    scale_a, scale_b = scaled_mm_scales(qa, qb, recipe)
    out = torch._scaled_mm(qa.data, qb.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out if out.shape == (m, n) else out[:m, :n]


def product(a: Operand, b: Operand, *, recipe: Recipe, roles: tuple[Role, Role], real: bool,
            out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] with both operands in fp8 along K: the one place a linear fp8 GEMM runs. An
    operand may come quantised already (a `Quantised`: the fp8 input a GEMM kept for its weight gradient)."""
    data_a, data_b = (x.data if isinstance(x, Quantised) else x for x in (a, b))
    if data_a.shape[0] == 0 or data_b.shape[0] == 0 or data_a.shape[1] == 0:
        return torch.zeros(data_a.shape[0], data_b.shape[0], dtype=out_dtype, device=data_a.device)
    if real:
        multiples = kernel_multiples(recipe, roles[1] == "weight") if data_a.device.type == "cuda" else None
        return _scaled_mm(a, b, recipe=recipe, roles=roles, out_dtype=out_dtype, multiples=multiples)
    qa, qb = (_quantised(x, recipe=recipe, role=role, multiples=None) for x, role in zip((a, b), roles, strict=True))
    return torch.mm(qa.dequantise(out_dtype), qb.dequantise(out_dtype).t())


def grouped_product(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, recipe: Recipe,
                    roles: tuple[Role, Role], real: bool) -> torch.Tensor:
    """rows [N, K] (sorted by expert, expert e's ending at offsets[e]) @ weight [E, out, K]^T per expert ->
    [N, out], each operand in fp8 along K, each expert's matrix quantised on its own: the one place a grouped fp8
    GEMM of the forward and the input gradient runs. Real: `torch._scaled_grouped_mm` with per-row scales (it
    writes bf16), each operand in a format it takes (the kernel table's `fp8_operand_format`: tensorwise's e5m2
    output gradient in e4m3)."""
    def formats(role: Role) -> torch.dtype:
        recipe_format = "e5m2" if fp8_dtype(recipe, role) == E5M2 else "e4m3"
        return FORMATS[fp8_operand_format(recipe_format, rows.device.type, grouped=True, real=real)]

    qa = quantise(rows, recipe=recipe, role=roles[0], dtype=formats(roles[0]))
    qb = quantise(weight, recipe=recipe, role=roles[1], dtype=formats(roles[1]))  # [E, out, K]: no block spans two
    if real:
        out = torch._scaled_grouped_mm(qa.data, qb.data.transpose(-2, -1), row_scales(qa), row_scales(qb),
                                       offsets.to(torch.int32), out_dtype=torch.bfloat16)
        return out.to(rows.dtype)
    return torch._grouped_mm(qa.dequantise(rows.dtype), qb.dequantise(rows.dtype).transpose(-2, -1), offs=offsets)


def _weight_operand(weight: torch.Tensor, *, transposed: bool) -> torch.Tensor | Quantised:
    """A linear weight [out, in] (transposed: [in, out], for the input gradient) as `product` takes it: gathered
    by FSDP2 in fp8 (all_gather.py), its fp8 data and scale as they are; otherwise the high-precision weight."""
    if isinstance(weight, Fp8GatheredWeight):
        return weight.quantised(transposed=transposed)
    return weight.t().contiguous() if transposed else weight


@dataclass(frozen=True)
class Fp8Gemm:
    """What a module marked for fp8 (`Linear.fp8`, `GroupedExperts.fp8`) runs its GEMMs with; `saved_inputs`:
    what its GEMMs keep of their input for backward (module docstring)."""

    recipe: Recipe
    saved_inputs: SavedInputs = "bf16"

    # -------------------------------------------------------------------------------------------- linear
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Without autograd (evaluation, or inside another GEMM's autograd Function: the sequence-parallel column
        # GEMM keeps its own input) nothing is kept, so nothing is quantised for backward.
        out = _Fp8Linear.apply(x, weight, self) if torch.is_grad_enabled() else self.forward(x, weight)
        return out if bias is None else out + bias

    def _run(self, a: torch.Tensor, b: torch.Tensor | Quantised, roles: tuple[Role, Role], product_name: str,
             out_dtype: torch.dtype) -> torch.Tensor:
        real = runs_real(self.recipe, a.device)
        _record("linear", product_name, "real" if real else "emulated", rows=a.shape[0], reduced=a.shape[1],
                columns=b.shape[0])
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

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor | Quantised) -> torch.Tensor:
        """grad [..., out]^T @ x [..., in] -> [out, in], reduced over the tokens; `x` as it came, or kept in fp8
        (`kept_input`, back in the weight gradient's orientation: `weight_grad_operand`)."""
        grad_rows = grad.reshape(-1, grad.shape[-1])
        rows = x if isinstance(x, Quantised) else x.reshape(-1, x.shape[-1]).t().contiguous()
        return self._run(grad_rows.t().contiguous(), rows, ("grad", "input"), "weight_grad", grad.dtype)

    def kept_input(self, x: torch.Tensor) -> Quantised:
        """x [..., in] in fp8 as the weight gradient quantises it: x^T [in, tokens] along the tokens; tensorwise
        the forward's x [tokens, in] itself (one scale, the same either way round: the transpose is taken in
        backward, `weight_grad_operand`)."""

        def make() -> Quantised:
            rows = x.reshape(-1, x.shape[-1])
            if self.recipe == "tensorwise":
                return quantise(rows, recipe="tensorwise", role="input")
            return quantise(rows.t().contiguous(), recipe=self.recipe, role="input")

        return _kept(x, self.recipe, None, make)

    def weight_grad_operand(self, data: torch.Tensor, scale: torch.Tensor) -> Quantised:
        """`kept_input`'s fp8 data and scales as the weight gradient's operand x^T [in, tokens]."""
        if self.recipe == "tensorwise":
            data = data.t().contiguous()
        return Quantised(data, scale, *block_shape(self.recipe, "input", tuple(data.shape)))

    # ------------------------------------------------------------------------------------------- grouped
    def grouped_mm(self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _Fp8GroupedMM.apply(rows, weight, offsets, self)

    def _run_grouped(self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, roles: tuple[Role, Role],
                     product_name: str) -> torch.Tensor:
        real = runs_real(self.recipe, rows.device, grouped=True)
        _record("grouped", product_name, "real" if real else "emulated", rows=rows.shape[0], reduced=rows.shape[1],
                columns=weight.shape[1])
        return grouped_product(rows, weight, offsets, recipe=self.recipe, roles=roles, real=real)

    def grouped_forward(self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self._run_grouped(rows, weight, offsets, ("input", "weight"), "forward")

    def grouped_input_grad(self, grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """grad [N, out] @ weight [E, out, in] per expert -> [N, in], reduced over `out`."""
        return self._run_grouped(grad, weight.transpose(-2, -1).contiguous(), offsets, ("grad", "weight"),
                                 "input_grad")

    def grouped_weight_grad(self, grad: torch.Tensor, rows: torch.Tensor | GroupQuantised,
                            offsets: torch.Tensor) -> torch.Tensor:
        """Expert e's grad_e^T @ rows_e -> [E, out, in], reduced over its own tokens: both operands quantised
        along each expert's tokens alone (scaling.quantise_along_groups); `rows` as they came, or kept so
        (`kept_rows`; in the dtype of the gradient, which is the rows' own: the forward's output dtype)."""
        a = dequantised_along_groups(grad, offsets, recipe=self.recipe, role="grad", dtype=grad.dtype)
        if isinstance(rows, GroupQuantised):
            b = rows.dequantise(offsets, grad.dtype)
        else:
            b = dequantised_along_groups(rows, offsets, recipe=self.recipe, role="input", dtype=rows.dtype)
        _record("grouped", "weight_grad", "emulated", rows=a.shape[1], reduced=a.shape[0], columns=b.shape[1])
        return torch._grouped_mm(a.t(), b, offs=offsets)

    def kept_rows(self, rows: torch.Tensor, offsets: torch.Tensor) -> GroupQuantised:
        """The grouped experts' input rows in fp8 as their weight gradient quantises them."""
        return _kept(rows, self.recipe, offsets,
                     lambda: quantise_along_groups(rows, offsets, recipe=self.recipe, role="input"))


# Inputs already kept in fp8 by a GEMM of this forward: input tensor -> (its version, the recipe, a weak reference
# to the offsets (grouped), weak references to the kept fp8 data and scales, what rebuilds the operand from them).
# Only weak references: an entry serves the next GEMM reading the same input while the first one's autograd node
# still holds the copy, and never keeps a copy alive itself (a recomputed region's first forward drops what its
# GEMMs save; so does the backward that used it).
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()

Kept = Quantised | GroupQuantised


def _rebuild(kept: Kept) -> Callable[[torch.Tensor, torch.Tensor], Kept]:
    if isinstance(kept, GroupQuantised):
        return functools.partial(GroupQuantised, recipe=kept.recipe)
    return functools.partial(Quantised, block_rows=kept.block_rows, block_cols=kept.block_cols)


def _kept(x: torch.Tensor, recipe: Recipe, offsets: torch.Tensor | None, make: Callable[[], Kept]) -> Kept:
    """`make()`, or what it gave for `x` (the same object, unchanged since) when that is still held."""
    if torch.compiler.is_compiling():
        return make()
    entry = _KEPT.get(x)
    if entry is not None:
        version, kept_recipe, offsets_ref, data_ref, scale_ref, rebuild = entry
        data, scale = data_ref(), scale_ref()
        same_offsets = offsets_ref() is offsets if offsets_ref is not None else offsets is None
        if data is not None and scale is not None and version == x._version and kept_recipe == recipe and \
                same_offsets:
            return rebuild(data, scale)
    kept = make()
    _KEPT[x] = (x._version, recipe, None if offsets is None else weakref.ref(offsets), weakref.ref(kept.data),
                weakref.ref(kept.scale), _rebuild(kept))
    return kept


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, gemm: Fp8Gemm) -> torch.Tensor:
        ctx.gemm = gemm
        ctx.kept_fp8 = gemm.saved_inputs == "fp8"
        if ctx.kept_fp8:
            kept = gemm.kept_input(x)
            ctx.save_for_backward(kept.data, kept.scale, weight)
        else:
            ctx.save_for_backward(x, weight)
        return gemm.forward(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gemm: Fp8Gemm = ctx.gemm
        if ctx.kept_fp8:
            data, scale, weight = ctx.saved_tensors
            x = gemm.weight_grad_operand(data, scale)
        else:
            x, weight = ctx.saved_tensors
        grad_input = gemm.input_grad(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = gemm.weight_grad(grad, x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, gemm: Fp8Gemm):
        ctx.gemm = gemm
        ctx.kept_fp8 = gemm.saved_inputs == "fp8"
        if ctx.kept_fp8:
            kept = gemm.kept_rows(rows, offsets)
            ctx.save_for_backward(kept.data, kept.scale, weight, offsets)
        else:
            ctx.save_for_backward(rows, weight, offsets)
        return gemm.grouped_forward(rows, weight, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gemm: Fp8Gemm = ctx.gemm
        if ctx.kept_fp8:
            data, scale, weight, offsets = ctx.saved_tensors
            rows = GroupQuantised(data, scale, gemm.recipe)
        else:
            rows, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = gemm.grouped_input_grad(grad, weight, offsets) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = gemm.grouped_weight_grad(grad, rows, offsets).to(weight.dtype)
        return grad_rows, grad_weight, None, None
