"""The layouts torch's scaled GEMM kernels read fp8 operands and their scales in: pure tensor functions (indexing,
no arithmetic on values), tested on the CPU against hand references, used by gemm.py on CUDA.

`torch._scaled_mm(a [M, K] row-major, b [K, N] column-major, scale_a, scale_b)` tells the recipe from the scales'
dtype, shapes and strides (aten/src/ATen/native/cuda/ScaledBlas.cpp, torch 2.11 to 2.13); every scale is a
decode scale (the dequantised value is data * scale: the inverse of scaling.py's):

| recipe | scale_a | scale_b |
|---|---|---|
| tensorwise | one fp32 | one fp32 |
| rowwise | [M, 1] fp32 | [1, N] fp32 |
| blockwise, a 1 x 128 | [M, ceil(K/128)] fp32, outer-dim-major (strides 1, M) | |
| blockwise, b 128 x 128 (a weight) | | [ceil(K/128), ceil(N/128)], its transpose row-major |
| blockwise, b 1 x 128 (weight gradient) | | [ceil(K/128), N] row-major (its transpose outer-dim-major) |
| mxfp8 (1 x 32) | E8M0, cuBLAS's blocked layout of [M, ceil(K/32)] | the same of [N, ceil(K/32)] |

cuBLAS's blocked layout of block scales ("1D block scaling factors layout"): the scale matrix padded to
multiples of 128 rows and 4 columns and cut into 128 x 4 tiles, tiles in row-major order, each 512 entries long,
the entry of row r, column c of a tile at (r % 32) * 16 + (r // 32) * 4 + c. torchao's `to_blocked` writes the
same layout with a view and a permute; `blocked` here is written from the formula.

Shape rules the kernels add (the same file): a's K and b's K and N multiples of 16; the blockwise scale strides
also want 16-byte alignment (a 128 x 128 scale row of ceil(K/128) fp32 values: K a multiple of 512; a 1 x 128
column of M values: M a multiple of 4). `padded` appends zero rows and columns, which change no product and no
scale (a zero never raises a block's amax), so gemm.py pads the operands it hands a real kernel and cuts the
output back. `torch._scaled_grouped_mm` (2-D rows x 3-D experts) takes per-row fp32 scales: [M] for the rows,
[E, N] for the experts (`row_scales`).
"""

from __future__ import annotations

import torch

from moe_train.models.fp8.scaling import BLOCK, Quantised, Recipe

CUDA_MULTIPLE = 16  # cuBLAS fp8 GEMMs: K of a, K and N of b
BLOCK_SCALE_ALIGN = 4  # fp32 (or E8M0 tile columns) per 16 bytes of a scale's leading dimension
MX_TILE_ROWS, MX_TILE_COLS = 128, 4


def padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x [R, C] with zero rows and columns appended up to multiples of `rows` and `cols`; x itself if aligned."""
    pad_rows, pad_cols = -x.shape[0] % rows, -x.shape[1] % cols
    if not pad_rows and not pad_cols:
        return x
    return torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))


def kernel_multiples(recipe: Recipe, b_role_weight: bool) -> tuple[int, int]:
    """(rows, K) multiples gemm.py pads both operands of a real `_scaled_mm` to (see the module docstring)."""
    if recipe == "blockwise":
        return CUDA_MULTIPLE, BLOCK * BLOCK_SCALE_ALIGN if b_role_weight else CUDA_MULTIPLE
    if recipe == "mxfp8":
        return CUDA_MULTIPLE, 32  # whole MX blocks along K
    return CUDA_MULTIPLE, CUDA_MULTIPLE


def outer_dim_major(scale: torch.Tensor) -> torch.Tensor:
    """scale [M, C] with the same values and strides (1, M): column-major, as cuBLAS reads 1 x 128 scales."""
    return scale.t().contiguous().t()


def blocked(scale: torch.Tensor) -> torch.Tensor:
    """scale [R, C] in cuBLAS's blocked layout (module docstring), flat, padded with ones (the tiles' spare rows
    and columns scale only the zero rows and columns `padded` adds, or nothing)."""
    rows, cols = scale.shape
    tiles_r, tiles_c = -(-rows // MX_TILE_ROWS), -(-cols // MX_TILE_COLS)
    full = scale.new_ones(tiles_r * MX_TILE_ROWS, tiles_c * MX_TILE_COLS)
    full[:rows, :cols] = scale
    # [tile row, r // 32, r % 32, tile col, c] -> [tile row, tile col, r % 32, r // 32, c]
    tiles = full.view(tiles_r, MX_TILE_ROWS // 32, 32, tiles_c, MX_TILE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def scaled_mm_scales(qa: Quantised, qb: Quantised, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode scales of a [M, K] and b [N, K] (both quantised along K) as `torch._scaled_mm(a, b.t())` takes
    them for `recipe` (module docstring)."""
    inv_a, inv_b = qa.scale.reciprocal(), qb.scale.reciprocal()
    if recipe == "tensorwise":
        return inv_a.reshape(()), inv_b.reshape(())
    if recipe == "rowwise":
        return inv_a, inv_b.t()
    if recipe == "blockwise":
        if qb.block_rows == BLOCK:  # a weight's 128 x 128 blocks: [N/128, K/128] row-major, transposed
            return outer_dim_major(inv_a), inv_b.contiguous().t()
        return outer_dim_major(inv_a), inv_b.t().contiguous()
    return blocked(inv_a).to(torch.float8_e8m0fnu), blocked(inv_b).to(torch.float8_e8m0fnu)


def row_scales(q: Quantised) -> torch.Tensor:
    """One fp32 decode scale per row of q.data [..., rows, K] as [..., rows] (tensorwise's one scale per matrix
    repeated on its rows): what `torch._scaled_grouped_mm` takes for rowwise scaling."""
    assert q.block_cols == q.data.shape[-1], "per-row scales need one block along K"
    inverse = q.scale.reciprocal()
    return inverse.expand(*q.data.shape[:-1], 1).squeeze(-1).contiguous()
