"""The start-up check of the fp8 stack: torchao imports and its scaling works with the installed torch.

torchao 0.18 (the `fp8` extra's bound) supports torch >= 2.11 (its __init__ skips its C++ kernels below that;
the engine uses only its Python scaling and casting functions). The tested pairs: torch 2.13 (CPU, this
project's CI) and torch 2.11 (the H200 image; not run there yet). Rather than trust a table, the check runs one
16 x 16 fp8 GEMM of the recipe the way training will (real `_scaled_mm` or emulated) and compares it with the
high-precision product, so a pair that imports but computes wrongly stops the run with one line.
"""

from __future__ import annotations

import importlib.metadata

import torch

TESTED_TORCHAO = ">=0.18,<0.19"  # pyproject's fp8 extra


def fp8_problems(recipe: str, device: torch.device) -> list[str]:
    """One line per problem of the fp8 stack on `device` for `recipe` (empty: it works). Describes the pair in
    the line it returns, for the log."""
    try:
        version = importlib.metadata.version("torchao")
        import torchao.float8.float8_utils  # noqa: F401  (the scaling functions scaling.py calls)
    except (ImportError, importlib.metadata.PackageNotFoundError) as error:
        return [f"train.precision fp8 needs torchao {TESTED_TORCHAO} (pip install 'moe-train[fp8]'): {error}"]
    from moe_train.models.fp8.gemm import product, runs_real

    pair = f"torchao {version} with torch {torch.__version__}"
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=generator).to(device)
    b = torch.randn(32, 64, generator=generator).to(device)
    real = runs_real(recipe, device)  # type: ignore[arg-type]
    try:
        out = product(a.bfloat16(), b.bfloat16(), recipe=recipe, roles=("input", "weight"), real=real,  # type: ignore[arg-type]
                      out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError, NotImplementedError) as error:
        return [f"{pair}: the {recipe} fp8 GEMM fails on {device.type}: {' '.join(str(error).split())[:200]}"]
    exact = (a[:, None, :] * b[None, :, :]).sum(-1)  # elementwise: the GEMM site stays the only product
    error = ((out.float() - exact).norm() / exact.norm()).item()
    if not error < 0.1:  # e4m3 keeps 3 mantissa bits: a few percent of relative error
        return [f"{pair}: the {recipe} fp8 GEMM on {device.type} is off by {error:.3f} (relative)"]
    return []


def fp8_stack(recipe: str, device: torch.device) -> str:
    """The pair and how the recipe's linear GEMMs run, for the start-up log."""
    from moe_train.models.fp8.gemm import runs_real

    mode = "torch._scaled_mm" if runs_real(recipe, device) else "emulated (quantise, dequantise, bf16 GEMM)"  # type: ignore[arg-type]
    return (f"fp8 {recipe}: torchao {importlib.metadata.version('torchao')}, torch {torch.__version__}, "
            f"{device.type} linear GEMMs {mode}, routed experts emulated")
