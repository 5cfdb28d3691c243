"""What a forward saves for backward, as the declarations list it: one `Saved` per storage autograd keeps, and
the savers every module shares (a norm, a GEMM's input in bf16 or fp8, a SwiGLU) (no torch).

Each item carries the region a recompute or offload policy names (what it can drop) and how it shards: the
layout's token counts (`ActivationLayout`) and the module's head or ffn shards. Tensor and sequence parallelism
follow Korthikanti et al. (2022): head- and ffn-sharded tensors divide by tp; the rest (norms, the inputs of
column-parallel GEMMs) divide by tp only under sequence parallelism, where a GEMM after an all-gather keeps
only its sequence shard (and all-gathers it again in backward).
- RMSNorm computes in fp32 but keeps its input as it came (bf16 runs: not an fp32 copy) and the fp32
  reciprocal rms per token; its backward forms the normalised value again (models/norm.py).
- A linear layer keeps its input.
- fp8 GEMMs with `train.fp8.saved_inputs: fp8` keep their input in fp8 instead (`gemm_input`, models/fp8/gemm.py):
  1 byte an element and the fp32 scales of the weight gradient's quantisation (along the tokens), one copy per
  input however many GEMMs read it; the grouped experts' rows with one scale row per block of each expert's
  rows (`grouped_scale_bytes`).
- SwiGLU keeps gate, up, silu(gate) and their product (the down projection's input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP32 = 4
INT64 = 8
INT32 = 4
FP8 = 1
BLOCKS = {"blockwise": 128, "mxfp8": 32}  # activation blocks along the tokens (models/fp8/scaling.py)
SWIGLU = ("gate", "up", "silu", "down_input")  # the names a SwiGLU's saves take after its prefix (`swiglu_items`)


@dataclass(frozen=True)
class Saved:
    """One saved storage: `region` names the code that saves it (what a recompute policy can drop)."""

    region: str
    name: str
    bytes: float


def norm_items(region: str, prefix: str, tokens: float, width: float, a: int, *, storage_width: float | None = None):
    """RMSNorm: its input as it came (the whole storage it views: `storage_width`), fp32 reciprocal rms per token."""
    return [
        Saved(region, f"{prefix}.input", a * tokens * (storage_width or width)),
        Saved(region, f"{prefix}.rstd", FP32 * tokens),
    ]


def linear_scale_bytes(recipe: str, rows: float, cols: float) -> float:
    """fp32 scales of a GEMM input x [rows, cols] kept as its weight gradient reads it, x^T along the rows: one
    (tensorwise), one per column (rowwise), per column and block of 128 (blockwise) or 32 (MX) rows."""
    if recipe == "tensorwise":
        return FP32
    if recipe == "rowwise":
        return FP32 * cols
    return FP32 * cols * math.ceil(rows / BLOCKS[recipe])


def grouped_scale_bytes(recipe: str, rows: float, cols: float, experts: float) -> float:
    """fp32 scales of the grouped experts' rows [rows, cols] kept along each expert's rows: one (tensorwise), one
    row of scales per expert (rowwise), per block of an expert's rows, at most rows // block + experts of them
    (blockwise, MX; models/fp8/scaling.py `_group_blocks`)."""
    if recipe == "tensorwise":
        return FP32
    if recipe == "rowwise":
        return FP32 * experts * cols
    return FP32 * (math.floor(rows / BLOCKS[recipe]) + experts) * cols


def gemm_input(region: str, name: str, rows: float, cols: float, a: int, recipe: str | None, *,
               experts: float | None = None) -> list[Saved]:
    """A GEMM's input x [rows, cols] as its GEMM keeps it: as it came, or in fp8 (`recipe`) with its scales
    (`{name}.scale`); `experts`: the grouped experts' rows, scaled per expert."""
    if recipe is None:
        return [Saved(region, name, a * rows * cols)]
    scales = (linear_scale_bytes(recipe, rows, cols) if experts is None
              else grouped_scale_bytes(recipe, rows, cols, experts))
    return [Saved(region, name, FP8 * rows * cols), Saved(region, f"{name}.scale", scales)]


def swiglu_items(region: str, prefix: str, rows: float, ffn: float, a: int, down: str | None = None) -> list[Saved]:
    """`down`: the recipe in which the down projection keeps its input (the product), None: as it came."""
    return [
        Saved(region, f"{prefix}.gate", a * rows * ffn),
        Saved(region, f"{prefix}.up", a * rows * ffn),
        Saved(region, f"{prefix}.silu", a * rows * ffn),
        *gemm_input(region, f"{prefix}.down_input", rows, ffn, a, down),
    ]


def without(items: list[Saved], names: set[str]) -> list[Saved]:
    """`items` but `names` (and their fp8 scales)."""
    names = names | with_scales(names)
    return [i for i in items if i.name not in names]


def with_scales(names: set[str]) -> set[str]:
    """`names` and their fp8 scales' names (`gemm_input`)."""
    return names | {f"{n}.scale" for n in names}


def kept_as_input(items: list[Saved], region: str, name: str, bytes_: float) -> list[Saved]:
    """A recomputed region's input that one of its own fp8 GEMMs kept in fp8 (`name`, with `name.scale`): the
    region keeps the input as it came instead (checkpoint saves a region's inputs; what its GEMMs saved goes)."""
    if not any(i.name == f"{name}.scale" for i in items):
        return items
    return [*without(items, {name}), Saved(region, name, bytes_)]
