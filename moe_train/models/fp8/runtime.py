"""The start-up check of the fp8 stack: torchao imports, its scaling works with the installed torch, and the
kernels the kernel table chose run here (or transformer-engine imports, for backend te).

torchao 0.18 (the `fp8` extra's bound) supports torch >= 2.11 (its __init__ skips its C++ kernels below that;
the engine uses only its Python scaling and casting functions). The tested pairs: torch 2.13 (CPU, this
project's CI) and torch 2.11 (the H200 image; not run there yet). Rather than trust a table, the check runs one
16 x 64 x 32 fp8 GEMM of the recipe the way training will and compares it with the high-precision product, so a
pair that imports but computes wrongly stops the run with one line. Where the kernel table chose a real kernel
(moe_train/kernels.py) the check runs it first, for every pair of operand roles its GEMMs take (the forward's
input x weight, the input gradient's grad x weight, the weight gradient's grad x input: tensorwise's gradients
are e5m2, which a kernel may refuse where it takes the forward's e4m3); if one raises or is off, this process
falls back to the emulated GEMM (gemm.py `fall_back`) and the start-up log line (`fp8_stack`) says why, with
the pair, rather than the run crashing in its first step (or its first backward). The routed experts' grouped
kernel is checked the same way where the table chose it.
"""

from __future__ import annotations

import importlib.metadata

import torch

TESTED_TORCHAO = ">=0.18,<0.19"  # pyproject's fp8 extra


def _error_words(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:200]


def _relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.float() - exact).norm() / exact.norm()).item()


# The products each kind of fp8 GEMM runs, by its operands' roles: the forward (input x weight), the input
# gradient (grad x weight) and the weight gradient (grad x input); the routed experts' weight gradient is emulated
# everywhere, so their real kernel serves the first two only.
ROLE_PAIRS: dict[bool, tuple[tuple[str, str], ...]] = {
    False: (("input", "weight"), ("grad", "weight"), ("grad", "input")),
    True: (("input", "weight"), ("grad", "weight")),
}


def _linear_error(recipe: str, device: torch.device, real: bool, roles: tuple[str, str]) -> float:
    from moe_train.models.fp8.gemm import product

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=generator).to(device)
    b = torch.randn(32, 64, generator=generator).to(device)
    out = product(a.bfloat16(), b.bfloat16(), recipe=recipe, roles=roles, real=real,  # type: ignore[arg-type]
                  out_dtype=torch.bfloat16)
    exact = (a[:, None, :] * b[None, :, :]).sum(-1)  # elementwise: the GEMM site stays the only product
    return _relative_error(out, exact)


def _grouped_error(recipe: str, device: torch.device, real: bool, roles: tuple[str, str]) -> float:
    """Two experts of 32 x 64, 48 rows split 16 / 32."""
    from moe_train.models.fp8.gemm import grouped_product

    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(48, 64, generator=generator).to(device)
    weight = torch.randn(2, 32, 64, generator=generator).to(device)
    offsets = torch.tensor([16, 48], dtype=torch.int32, device=device)
    out = grouped_product(rows.bfloat16(), weight.bfloat16(), offsets, recipe=recipe,  # type: ignore[arg-type]
                          roles=roles, real=real)
    exact = torch.cat([(rows[:16, None, :] * weight[0][None]).sum(-1), (rows[16:, None, :] * weight[1][None]).sum(-1)])
    return _relative_error(out, exact)


def _check(recipe: str, device: torch.device, pair: str, *, grouped: bool) -> list[str]:
    """Run the real kernel for every role pair its GEMMs take (`ROLE_PAIRS`) where the table chose one, falling
    back at the first pair that raises or is off, with that pair named; then the emulated GEMM."""
    from moe_train.models.fp8.gemm import fall_back, runs_real

    run = _grouped_error if grouped else _linear_error
    what = "grouped fp8 GEMM" if grouped else "fp8 GEMM"
    if runs_real(recipe, device, grouped=grouped):  # type: ignore[arg-type]
        why = None
        for roles in ROLE_PAIRS[grouped]:
            try:
                error = run(recipe, device, True, roles)
                why = None if error < 0.1 else f"off by {error:.3f} (relative) at start-up"
            except (RuntimeError, TypeError, NotImplementedError, ValueError, AttributeError) as failure:
                why = f"raised at start-up: {_error_words(failure)}"
            if why is not None:
                why = f"{why} (operands {roles[0]} x {roles[1]})"
                break
        if why is None:
            return []
        fall_back(recipe, device, grouped=grouped, why=f"the real {recipe} {what} {why}")  # type: ignore[arg-type]
    try:
        error = max(run(recipe, device, False, roles) for roles in ROLE_PAIRS[grouped])
    except (RuntimeError, TypeError, NotImplementedError) as failure:
        return [f"{pair}: the emulated {recipe} {what} fails on {device.type}: {_error_words(failure)}"]
    if not error < 0.1:  # e4m3 keeps 3 mantissa bits: a few percent of relative error
        return [f"{pair}: the {recipe} {what} on {device.type} is off by {error:.3f} (relative)"]
    return []


def fp8_problems(recipe: str, device: torch.device, *, backend: str = "torchao") -> list[str]:
    """One line per problem of the fp8 stack on `device` for `recipe` (empty: it works; a real kernel that fails
    is a fallback, not a problem). Describes the pair in the line it returns, for the log."""
    if backend == "te":
        from moe_train.models.fp8.te import te_problems

        return te_problems(recipe, device)
    try:
        version = importlib.metadata.version("torchao")
        import torchao.float8.float8_utils  # noqa: F401  (the scaling functions scaling.py calls)
    except (ImportError, importlib.metadata.PackageNotFoundError) as error:
        return [f"train.precision fp8 needs torchao {TESTED_TORCHAO} (pip install 'moe-train[fp8]'): {error}"]
    pair = f"torchao {version} with torch {torch.__version__}"
    return _check(recipe, device, pair, grouped=False) + _check(recipe, device, pair, grouped=True)


def fp8_stack(recipe: str, device: torch.device, *, backend: str = "torchao") -> str:
    """The library, torch, and how the recipe's linear and grouped GEMMs run (with why), for the start-up log."""
    if backend == "te":
        from moe_train.models.fp8.te import te_stack

        return te_stack(recipe, device)
    from moe_train.models.fp8.gemm import kernel_choice

    def mode(grouped: bool) -> str:
        real, why = kernel_choice(recipe, device, grouped=grouped)  # type: ignore[arg-type]
        return why if real else f"emulated (quantise, dequantise, bf16 GEMM: {why})"

    return (f"fp8 {recipe}: torchao {importlib.metadata.version('torchao')}, torch {torch.__version__}, "
            f"linear GEMMs {mode(False)}; routed experts {mode(True)}; their weight gradient emulated")
