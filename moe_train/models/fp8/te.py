"""transformer-engine as the fp8 backend (`train.fp8.backend: te`): thin, behind the same GEMM site, UNVERIFIED.

Neither the CPU machine of CI nor the H200 the GPU check targets has transformer-engine (its CUDA wheels are far
larger than what that check can carry), so nothing here has run: docs/fp8.md says so. It is imported only when
a recipe selects it (models/fp8/select.py marks the modules with a `TeGemm` instead of an `Fp8Gemm`).

The engine keeps its own parameters (fp32 masters, FSDP2's bf16 gathers, tensor-parallel shards), so TE's modules
are used as functions of those weights: one `te.pytorch.Linear` (or `GroupedLinear`) per GEMM shape and device,
called through `torch.func.functional_call` with the engine's weight in place of its own, under TE's fp8
autocast with the recipe mapped: tensorwise -> `Float8CurrentScaling` (e4m3 forward, e5m2 gradients, as torchao's
tensorwise), blockwise -> `Float8BlockScaling` (1 x 128 / 128 x 128), mxfp8 -> `MXFP8BlockScaling`. TE has no
per-row recipe: `validate` refuses rowwise with te. TE's delayed scaling (`DelayedScaling`, an amax history) has
no `train.fp8.recipe` value yet. TE's backward runs inside its own autograd function, so the hand-written
sequence-parallel column backward (which calls `input_grad` / `weight_grad`) cannot use it: `validate` refuses
te with sequence parallelism. `GroupedLinear` takes the experts' row counts as a host list: one device-to-host
read per grouped GEMM, which the torchao path does not make.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

import torch
from torch.func import functional_call

from moe_train.models.fp8.scaling import Recipe

TE_PIN = "2.20.2"  # pyproject's te extra
_RECIPES = {"tensorwise": "Float8CurrentScaling", "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}


def te_recipe(recipe: Recipe):
    """TE's recipe object for `recipe` (rowwise has none: refused by validate)."""
    from transformer_engine.common import recipe as te_recipes

    if recipe not in _RECIPES:
        raise ValueError(f"transformer-engine has no {recipe} recipe (train.fp8.recipe: {', '.join(_RECIPES)})")
    if recipe == "tensorwise":
        return te_recipes.Float8CurrentScaling(fp8_format=te_recipes.Format.HYBRID)
    return getattr(te_recipes, _RECIPES[recipe])()


def _autocast(recipe: Recipe):
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):  # TE >= 2.8 names it autocast(recipe=...); fp8_autocast before
        return te.autocast(enabled=True, recipe=te_recipe(recipe))
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe(recipe))


@functools.cache
def _linear_module(in_features: int, out_features: int, dtype: torch.dtype, device: torch.device):
    import transformer_engine.pytorch as te

    return te.Linear(in_features, out_features, bias=False, params_dtype=dtype, device=device)


@functools.cache
def _grouped_module(experts: int, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device):
    import transformer_engine.pytorch as te

    return te.GroupedLinear(experts, in_features, out_features, bias=False, params_dtype=dtype, device=device)


@dataclass(frozen=True)
class TeGemm:
    """What a module marked for fp8 runs its GEMMs with under backend te (the same calls as `Fp8Gemm`)."""

    recipe: Recipe

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        module = _linear_module(weight.shape[1], weight.shape[0], weight.dtype, weight.device)
        with _autocast(self.recipe):
            out = functional_call(module, {"weight": weight}, (x,))
        return out if bias is None else out + bias

    def grouped_mm(self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        experts, out_features, in_features = weight.shape
        module = _grouped_module(experts, in_features, out_features, weight.dtype, weight.device)
        splits = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()  # GroupedLinear's host list
        with _autocast(self.recipe):
            return functional_call(module, {f"weight{e}": weight[e] for e in range(experts)}, (rows, splits))

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("backend te runs its GEMMs' backward inside TE (validate refuses te with "
                                  "parallel.sequence_parallel, whose column GEMM has a hand-written backward)")

    weight_grad = input_grad


def te_version() -> str | None:
    try:
        return importlib.metadata.version("transformer-engine")
    except importlib.metadata.PackageNotFoundError:
        return None


def te_problems(recipe: Recipe, device: torch.device) -> list[str]:
    """One line per reason backend te cannot train `recipe` here: TE does not import, TE says the GPU lacks fp8,
    or one 16 x 64 x 32 GEMM with its backward is off the exact product by 10% or more."""
    try:
        import transformer_engine.pytorch as te
    except ImportError as error:  # the CUDA wheels bring shared libraries: a broken install raises here too
        return [f"train.fp8.backend te needs transformer-engine {TE_PIN} (pip install 'moe-train[te]'), which does "
                f"not import: {' '.join(str(error).split())[:200]}"]
    name = f"transformer-engine {te_version()} with torch {torch.__version__}"
    available, reason = te.fp8.check_fp8_support()
    if not available:
        return [f"{name}: {reason}"]
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=generator).to(device, torch.bfloat16).requires_grad_(True)
    b = torch.randn(32, 64, generator=generator).to(device, torch.bfloat16).requires_grad_(True)
    try:
        out = TeGemm(recipe=recipe).linear(a, b, None)
        out.float().sum().backward()
    except (RuntimeError, TypeError, ValueError, AssertionError) as error:
        return [f"{name}: the {recipe} GEMM fails on {device.type}: {' '.join(str(error).split())[:200]}"]
    exact = (a.detach().float()[:, None, :] * b.detach().float()[None, :, :]).sum(-1)
    error = ((out.detach().float() - exact).norm() / exact.norm()).item()
    if not error < 0.1:
        return [f"{name}: the {recipe} GEMM on {device.type} is off by {error:.3f} (relative)"]
    return []


def te_stack(recipe: Recipe, device: torch.device) -> str:
    """The start-up log line of backend te."""
    return (f"fp8 {recipe}: transformer-engine {te_version()} (unverified), torch {torch.__version__}, "
            f"{device.type} linear GEMMs te.pytorch.Linear and routed experts te.pytorch.GroupedLinear under TE's "
            f"autocast with {_RECIPES.get(recipe, recipe)}")
