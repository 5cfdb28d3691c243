"""FP8 quantisation of one GEMM operand, by recipe: the scales, the cast and its inverse.

Every operand of every fp8 product is written as a 2-D tensor [rows, K] whose last dimension is the product's
reduction dimension K (`gemm.py` transposes where needed), and quantised in blocks of (block rows, block
columns); one scale per block:

| recipe | activations and gradients | weights | scale | source |
|---|---|---|---|---|
| tensorwise | whole tensor | whole tensor | fp32 | torchao's default recipe |
| rowwise | 1 x K (one per row) | 1 x K | fp32, a power of 2 | torchao's rowwise recipe |
| blockwise | 1 x 128 | 128 x 128 | fp32 | DeepSeek-V3 (arXiv 2412.19437, section 3.3.2) |
| mxfp8 | 1 x 32 | 1 x 32 | E8M0 (a power of 2) | OCP Microscaling v1.0 |

The scale multiplies the high-precision value before the saturated cast (`fp8 = sat(x * scale)`), so the
dequantised value is `fp8 / scale`: torchao's convention (`tensor_to_scale`, `to_fp8_saturated`, whose
functions compute the tensorwise and rowwise scales and the cast). tensorwise's gradients are e5m2 (range for
gradients, torchao's choice), every other operand e4m3. A block's scale maps its largest magnitude onto the
format's largest finite value, so only MX saturates: its shared exponent is floor(log2(amax)) - 8 (e4m3's
largest exponent), which puts amax in [256, 512) and clips what exceeds 448, as the specification says.
A block of zeros gets the largest scale torchao allows (amax clamped to 1e-12) and stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Recipe = Literal["tensorwise", "rowwise", "blockwise", "mxfp8"]
Role = Literal["input", "weight", "grad"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
BLOCK = 128  # DeepSeek-V3's tile
MX_BLOCK = 32  # OCP MX block
_E4M3_EMAX = 8  # e4m3's largest exponent: 448 = 1.75 * 2**8
_EPS = 1e-12  # torchao's amax floor (float8_utils.EPS)


@dataclass(frozen=True)
class Quantised:
    """An operand in fp8: `data` [..., rows, K] and one scale per (block_rows x block_cols) block of each
    matrix, [..., ceil(rows / block_rows), ceil(K / block_cols)] fp32; the dequantised value is data / scale.
    Leading dimensions (the experts of a grouped GEMM) are matrices of their own: no block spans two."""

    data: torch.Tensor
    scale: torch.Tensor
    block_rows: int
    block_cols: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantise(self, dtype: torch.dtype) -> torch.Tensor:
        inverse = _expand(self.scale.reciprocal(), self.block_rows, self.block_cols, self.data.shape)
        return (self.data.to(torch.float32) * inverse).to(dtype)


def _expand(scale: torch.Tensor, block_rows: int, block_cols: int, shape: torch.Size) -> torch.Tensor:
    """One value per block -> one per element of a [..., rows, K] tensor."""
    rows, cols = shape[-2:]
    return scale.repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_cols, -1)[..., :cols]


def fp8_dtype(recipe: Recipe, role: Role) -> torch.dtype:
    return E5M2 if recipe == "tensorwise" and role == "grad" else E4M3


FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def block_shape(recipe: Recipe, role: Role, shape: tuple[int, ...]) -> tuple[int, int]:
    """(block rows, block columns) of an operand [..., rows, K] under `recipe`."""
    rows, cols = shape[-2:]
    if recipe == "tensorwise":
        return max(rows, 1), max(cols, 1)
    if recipe == "rowwise":
        return 1, max(cols, 1)
    if recipe == "blockwise":
        return (BLOCK, BLOCK) if role == "weight" else (1, BLOCK)
    return 1, MX_BLOCK


def block_amax(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """max |x| of each (block_rows x block_cols) block of each matrix of x [..., rows, K], the last blocks cut
    short."""
    *batch, rows, cols = x.shape
    pad_rows, pad_cols = -rows % block_rows, -cols % block_cols
    padded = torch.nn.functional.pad(x.abs().float(), (0, pad_cols, 0, pad_rows))
    blocks = padded.view(*batch, (rows + pad_rows) // block_rows, block_rows, (cols + pad_cols) // block_cols,
                         block_cols)
    return blocks.amax(dim=(-3, -1))


def _scale(amax: torch.Tensor, recipe: Recipe, dtype: torch.dtype) -> torch.Tensor:
    from torchao.float8.float8_utils import amax_to_scale

    if recipe == "mxfp8":  # E8M0: 2 ** -(floor(log2 amax) - emax)
        return torch.exp2(_E4M3_EMAX - torch.floor(torch.log2(amax.clamp(min=_EPS))))
    return amax_to_scale(amax, dtype, round_scales_to_power_of_2=recipe == "rowwise")


def quantise(x: torch.Tensor, *, recipe: Recipe, role: Role, amax: torch.Tensor | None = None,
             dtype: torch.dtype | None = None) -> Quantised:
    """x [..., rows, K] (K: the product's reduction dimension) in fp8 with the recipe's scales. `amax`: the
    blocks' largest magnitudes when they were taken over more than x (FSDP2's fp8 all-gather quantises each
    shard with the whole weight's, all_gather.py); None: x's own. `dtype`: the fp8 format, where the kernel
    takes another than the recipe's role has (gemm.py: the grouped kernel's e4m3); None: `fp8_dtype`."""
    from torchao.float8.float8_utils import to_fp8_saturated

    dtype = dtype or fp8_dtype(recipe, role)
    block_rows, block_cols = block_shape(recipe, role, tuple(x.shape))
    scale = _scale(block_amax(x, block_rows, block_cols) if amax is None else amax, recipe, dtype)
    data = to_fp8_saturated(x.float() * _expand(scale, block_rows, block_cols, x.shape), dtype)
    return Quantised(data=data, scale=scale, block_rows=block_rows, block_cols=block_cols)


def padded_quantised(q: Quantised, rows: int, cols: int, *, recipe: Recipe = "tensorwise",
                     role: Role = "weight") -> Quantised:
    """`q` (of x [R, C]) as `quantise` of x with zero rows and columns appended up to multiples of `rows` and
    `cols` gives it (layouts.padded, which a real CUDA kernel needs of its operands): fp8 zero is every bit clear,
    and a zero never raises a block's amax, so each block keeps its scale; the blocks the padding adds get an
    all-zero block's. Tensorwise (FSDP2's fp8 all-gather, a kept input): the one scale as it is. What lets an
    operand already in fp8 (gathered so, or a GEMM input kept so for backward) meet a kernel's multiples with the
    bits its high-precision tensor would get."""
    r, c = q.data.shape
    pad_rows, pad_cols = -r % rows, -c % cols
    if not pad_rows and not pad_cols:
        return q
    data = torch.nn.functional.pad(q.data.view(torch.uint8), (0, pad_cols, 0, pad_rows)).view(q.data.dtype)
    if recipe == "tensorwise":
        return Quantised(data=data, scale=q.scale, block_rows=data.shape[0], block_cols=data.shape[1])
    block_rows, block_cols = block_shape(recipe, role, tuple(data.shape))
    zero_block = _scale(q.scale.new_zeros(1, 1), recipe, fp8_dtype(recipe, role))
    scale = zero_block.expand(-(-data.shape[0] // block_rows), -(-data.shape[1] // block_cols)).clone()
    scale[: q.scale.shape[0], : q.scale.shape[1]] = q.scale
    return Quantised(data=data, scale=scale, block_rows=block_rows, block_cols=block_cols)


def _group_blocks(offsets: torch.Tensor, rows: int, recipe: Recipe) -> tuple[torch.Tensor, int]:
    """(the scale row of each of `rows` rows sorted by expert, how many scale rows): one per expert (rowwise), one
    per block of 128 (blockwise) or 32 (MX) of an expert's rows, numbered expert after expert. Expert e's blocks
    are ceil(n_e / block), together at most rows // block + E: that bound sizes the scales, so nothing is read
    back to the host and the size is known beforehand (the plan prices it: plan/saved_tensors.py)."""
    index = torch.arange(rows, device=offsets.device)
    group = torch.searchsorted(offsets, index.to(offsets.dtype), right=True).clamp(max=offsets.numel() - 1)
    if recipe == "rowwise":
        return group, offsets.numel()
    block = BLOCK if recipe == "blockwise" else MX_BLOCK
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]])
    blocks = (offsets - starts + block - 1) // block
    first = torch.cumsum(blocks, 0) - blocks
    return (first[group] + (index - starts[group]) // block).long(), rows // block + offsets.numel()


@dataclass(frozen=True)
class GroupQuantised:
    """x [N, C] (rows sorted by expert) quantised along its rows within each expert's rows
    (`quantise_along_groups`): `data` [N, C] fp8 and `scale` [scale rows, C] fp32 (`_group_blocks`); tensorwise:
    one [1, 1] scale for the tensor."""

    data: torch.Tensor
    scale: torch.Tensor
    recipe: Recipe

    def dequantise(self, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.recipe == "tensorwise":
            shape = tuple(self.data.shape)
            return Quantised(self.data, self.scale, *block_shape("tensorwise", "input", shape)).dequantise(dtype)
        key, _ = _group_blocks(offsets, self.data.shape[0], self.recipe)
        return (self.data.to(torch.float32) / self.scale[key]).to(dtype)


def quantise_along_groups(x: torch.Tensor, offsets: torch.Tensor, *, recipe: Recipe, role: Role) -> GroupQuantised:
    """x [N, C] (rows sorted by expert, expert e's ending at offsets[e]) quantised along its rows within each
    expert's rows: an operand of a grouped weight gradient, whose reduction dimension is each expert's own
    tokens. Per column: one scale per expert (rowwise), per block of 128 (blockwise) or 32 (MX) of the
    expert's rows, one for the tensor (tensorwise); a block never spans two experts. No host read."""
    if recipe == "tensorwise":
        q = quantise(x, recipe=recipe, role=role)
        return GroupQuantised(data=q.data, scale=q.scale, recipe=recipe)
    from torchao.float8.float8_utils import to_fp8_saturated

    rows, cols = x.shape
    fmt = fp8_dtype(recipe, role)
    key, buckets = _group_blocks(offsets, rows, recipe)
    magnitude = x.abs().float()
    amax = magnitude.new_zeros(buckets, cols).scatter_reduce(0, key[:, None].expand(rows, cols), magnitude, "amax")
    scale = _scale(amax, recipe, fmt)
    return GroupQuantised(data=to_fp8_saturated(x.float() * scale[key], fmt), scale=scale, recipe=recipe)


def dequantised_along_groups(x: torch.Tensor, offsets: torch.Tensor, *, recipe: Recipe, role: Role,
                             dtype: torch.dtype) -> torch.Tensor:
    """`quantise_along_groups` and back to `dtype`: what a grouped weight gradient multiplies (emulated)."""
    return quantise_along_groups(x, offsets, recipe=recipe, role=role).dequantise(offsets, dtype)
