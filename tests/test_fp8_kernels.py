"""Issue 22, part B: the real fp8 kernels by device and capability, their scale layouts, the start-up probe's
fallback, and backend te. The layouts are pure indexing and are checked here against hand references; the
kernels themselves need CUDA (sm90 / sm100) and are skipped here with that reason; transformer-engine is not
installed on this machine or on the H200 of bench/gpu/check.sh, so its GPU test is skipped with that reason,
while its refusal is checked for real."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

from moe_train.kernels import fp8_kernel
from moe_train.models.fp8 import gemm
from moe_train.models.fp8.gemm import (
    Fp8Gemm,
    count_fp8_gemms,
    fall_back,
    grouped_product,
    kernel_choice,
    product,
    runs_real,
)
from moe_train.models.fp8.layouts import blocked, kernel_multiples, padded, row_scales, scaled_mm_scales
from moe_train.models.fp8.runtime import fp8_problems, fp8_stack
from moe_train.models.fp8.scaling import quantise

CPU = torch.device("cpu")
HAS_TE = importlib.util.find_spec("transformer_engine") is not None


def _capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


@pytest.fixture
def fresh_fallbacks():
    """The probe's fallbacks are process-wide: each test starts and ends without any."""
    saved = dict(gemm._FALLEN_BACK)
    gemm._FALLEN_BACK.clear()
    yield
    gemm._FALLEN_BACK.clear()
    gemm._FALLEN_BACK.update(saved)


# ------------------------------------------------------------------------------------------- the table


@pytest.mark.parametrize(("device", "capability", "real_linear", "real_grouped"), [
    ("cpu", None, {"tensorwise", "rowwise"}, set()),
    ("meta", None, {"tensorwise", "rowwise"}, set()),  # fake tensors: the CPU's row
    ("cuda", (8, 0), set(), set()),  # A100: no fp8 tensor cores
    ("cuda", (8, 9), {"tensorwise", "rowwise"}, set()),  # L40S
    ("cuda", (9, 0), {"tensorwise", "rowwise", "blockwise"}, {"tensorwise", "rowwise"}),  # H100 / H200
    ("cuda", (10, 0), {"tensorwise", "rowwise", "mxfp8"}, {"tensorwise", "rowwise"}),  # B200: DeepSeek's sm90-only
    ("cuda", (12, 0), {"tensorwise", "rowwise"}, set()),
    ("cuda", None, set(), set()),  # capability unknown: nothing real
])
def test_the_kernel_table_chooses_by_device_kind_and_capability(device, capability, real_linear, real_grouped):
    recipes = ("tensorwise", "rowwise", "blockwise", "mxfp8")
    linear = {r for r in recipes if fp8_kernel(r, device, capability)[0]}
    grouped = {r for r in recipes if fp8_kernel(r, device, capability, grouped=True)[0]}
    assert (linear, grouped) == (real_linear, real_grouped)


def test_the_table_says_why_a_recipe_is_emulated():
    assert fp8_kernel("blockwise", "cuda", (10, 0)) == (
        False, "torch._scaled_mm takes blockwise scales from sm90 to below sm100, not on cuda sm100")
    assert fp8_kernel("tensorwise", "cuda", (8, 9)) == (True, "torch._scaled_mm on cuda sm89")
    assert fp8_kernel("rowwise", "cpu", grouped=True) == (
        False, "torch._scaled_grouped_mm has no rowwise kernel on cpu")


# ----------------------------------------------------------------------------------------------- layouts


def test_padded_appends_zero_rows_and_columns_only_where_needed():
    x = torch.arange(1.0, 16.0).view(3, 5)
    assert padded(x, 1, 5) is x
    y = padded(x, 4, 8)
    assert y.shape == (4, 8) and torch.equal(y[:3, :5], x) and y[3].abs().sum() == 0 and y[:, 5:].abs().sum() == 0
    assert kernel_multiples("blockwise", True) == (16, 512) and kernel_multiples("mxfp8", False) == (16, 32)


def test_the_blocked_mx_layout_follows_the_cublas_formula():
    rows, cols = 130, 9  # two tile rows (the second nearly empty), three tile columns (the last part-filled)
    scale = torch.arange(1.0, rows * cols + 1).view(rows, cols)
    flat = blocked(scale)
    tiles_c = 3
    expected = torch.ones(2 * 128 * tiles_c * 4)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_c + c // 4
            rr, cc = r % 128, c % 4
            expected[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = scale[r, c]
    assert torch.equal(flat, expected)


def test_blockwise_scales_take_the_strides_torch_reads():
    a, w = torch.randn(48, 300), torch.randn(200, 300)
    qa, qw = quantise(a, recipe="blockwise", role="input"), quantise(w, recipe="blockwise", role="weight")
    scale_a, scale_b = scaled_mm_scales(qa, qw, "blockwise")
    assert scale_a.shape == (48, 3) and scale_a.stride() == (1, 48)  # 1 x 128, outer-dim-major
    assert torch.equal(scale_a, 1 / qa.scale)
    assert scale_b.shape == (3, 2) and scale_b.t().is_contiguous()  # 128 x 128, [N/128, K/128] row-major
    assert torch.equal(scale_b.t(), 1 / qw.scale)
    qx = quantise(torch.randn(64, 300), recipe="blockwise", role="input")  # a weight gradient's 1 x 128 b
    _, scale_x = scaled_mm_scales(qa, qx, "blockwise")
    assert scale_x.shape == (3, 64) and scale_x.is_contiguous() and torch.equal(scale_x.t(), 1 / qx.scale)


def test_mx_scales_are_e8m0_in_the_blocked_layout():
    a, b = torch.randn(40, 96) * 5, torch.randn(24, 96) / 7
    qa, qb = quantise(a, recipe="mxfp8", role="input"), quantise(b, recipe="mxfp8", role="weight")
    scale_a, scale_b = scaled_mm_scales(qa, qb, "mxfp8")
    assert scale_a.dtype == torch.float8_e8m0fnu and scale_a.numel() == 128 * 4 == scale_b.numel()
    # powers of two survive E8M0 exactly: the blocked layout of the fp32 decode scales, value for value
    assert torch.equal(scale_a.float(), blocked(1 / qa.scale)) and torch.equal(scale_b.float(), blocked(1 / qb.scale))


@pytest.mark.parametrize(("recipe", "role_b"), [("tensorwise", "weight"), ("rowwise", "weight"),
                                              ("blockwise", "weight"), ("blockwise", "input"), ("mxfp8", "weight")])
def test_the_scales_pass_torchs_own_size_checks(recipe, role_b):
    """torch._scaled_mm's meta kernel runs the size checks of its CUDA kernel (torch/_meta_registrations.py):
    operands padded as gemm.py pads them on CUDA, scales laid out by layouts.py, on the meta device."""
    rows, cols = kernel_multiples(recipe, role_b == "weight")
    a, b = padded(torch.randn(40, 300), rows, cols), padded(torch.randn(200, 300), rows, cols)
    qa, qb = quantise(a, recipe=recipe, role="input"), quantise(b, recipe=recipe, role=role_b)
    scale_a, scale_b = scaled_mm_scales(qa, qb, recipe)
    meta = [t.to("meta") for t in (qa.data, qb.data, scale_a, scale_b)]
    out = torch._scaled_mm(meta[0], meta[1].t(), scale_a=meta[2], scale_b=meta[3], out_dtype=torch.bfloat16)
    assert out.shape == (a.shape[0], b.shape[0])
    if recipe == "blockwise" and role_b == "weight":  # the check can fail: the 128 x 128 scales untransposed
        with pytest.raises(RuntimeError, match="Invalid scaling configuration"):
            torch._scaled_mm(meta[0], meta[1].t(), scale_a=meta[2], scale_b=meta[3].t(), out_dtype=torch.bfloat16)


def test_grouped_row_scales_repeat_a_matrix_scale_on_its_rows():
    w = torch.randn(3, 8, 16)
    tensorwise = row_scales(quantise(w, recipe="tensorwise", role="weight"))
    assert tensorwise.shape == (3, 8) and tensorwise.is_contiguous()
    for e in range(3):  # each expert its own scale, the same on all its rows
        assert torch.all(tensorwise[e] == tensorwise[e, 0])
        torch.testing.assert_close(tensorwise[e, 0], w[e].abs().max() / 448)
    rowwise = row_scales(quantise(w, recipe="rowwise", role="weight"))
    assert torch.equal(rowwise, 1 / quantise(w, recipe="rowwise", role="weight").scale.squeeze(-1))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_padding_to_the_kernel_multiples_changes_no_product(recipe):
    a, b = torch.randn(37, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    kwargs = {"recipe": recipe, "roles": ("input", "weight"), "out_dtype": torch.bfloat16}
    plain = gemm._scaled_mm(a, b, multiples=None, **kwargs)
    padded_run = gemm._scaled_mm(a, b, multiples=(16, 16), **kwargs)
    assert padded_run.shape == (37, 24)
    torch.testing.assert_close(padded_run, plain)  # bf16's tolerance: at most a rounding of the fp32 sum apart


# ------------------------------------------------------------------------------------ the start-up probe


def test_the_probe_falls_back_to_emulated_when_the_real_kernel_raises(monkeypatch, fresh_fallbacks):
    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    assert runs_real("rowwise", CPU)
    assert fp8_problems("rowwise", CPU) == []  # a fallback, not a problem
    assert not runs_real("rowwise", CPU) and runs_real("tensorwise", CPU)  # only the recipe probed
    line = fp8_stack("rowwise", CPU)
    assert ("linear GEMMs emulated (quantise, dequantise, bf16 GEMM: the real rowwise fp8 GEMM raised at start-up: "
            "RuntimeError: no kernel image is available") in line
    x, w = torch.randn(4, 32).bfloat16().requires_grad_(True), torch.randn(16, 32).bfloat16()
    with count_fp8_gemms() as tally:
        Fp8Gemm(recipe="rowwise").linear(x, w, None).sum().backward()
    assert set(tally) == {("linear", "forward", "emulated"), ("linear", "input_grad", "emulated")}


def test_the_probe_falls_back_for_a_grouped_kernel_that_raises(monkeypatch, fresh_fallbacks):
    """The CPU's table names no grouped kernel; a table that did (as CUDA's) meets torch._scaled_grouped_mm,
    which has no CPU kernel: the probe's fallback path, for real."""
    def table(recipe, device_type, capability=None, *, grouped=False):
        return (True, "pretend") if grouped else fp8_kernel(recipe, device_type, capability)

    monkeypatch.setattr(gemm, "fp8_kernel", table)
    assert runs_real("tensorwise", CPU, grouped=True)
    assert fp8_problems("tensorwise", CPU) == []
    real, why = kernel_choice("tensorwise", CPU, grouped=True)
    assert not real and why.startswith("the real tensorwise grouped fp8 GEMM raised at start-up")


def test_the_probe_reports_an_emulated_gemm_that_is_wrong(monkeypatch, fresh_fallbacks):
    monkeypatch.setattr(torch, "mm", lambda a, b: torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype))
    fall_back("tensorwise", CPU, grouped=False, why="pretend")  # so the linear check runs emulated
    torchao = importlib.metadata.version("torchao")
    assert fp8_problems("tensorwise", CPU) == [
        f"torchao {torchao} with torch {torch.__version__}: the tensorwise fp8 GEMM on cpu is off by 1.000 (relative)"]


# --------------------------------------------------------------------------------------------- backend te


def test_backend_te_is_refused_with_one_line_where_transformer_engine_does_not_import():
    from moe_train.config import RecipeError, load_recipe

    cuda = ["train.precision=fp8", "train.fp8.backend=te", "launch.device=cuda", "launch.gpu=h100"]
    line = "train.fp8.backend: te needs transformer-engine (pip install 'moe-train[te]'), which does not import here"
    if HAS_TE:
        load_recipe("qwen3-moe-tiny", cuda)
    else:
        with pytest.raises(RecipeError) as refused:
            load_recipe("qwen3-moe-tiny", cuda)
        assert sum(line in problem for problem in refused.value.problems) == 1, refused.value.problems
    with pytest.raises(RecipeError) as refused:
        load_recipe("qwen3-moe-tiny", [*cuda, "train.fp8.recipe=rowwise", "parallel.tp=2", "launch.gpus_per_node=2",
                                       "parallel.sequence_parallel=true"])
    text = str(refused.value)
    assert "train.fp8.recipe: transformer-engine has no rowwise recipe" in text
    assert "train.fp8.backend: te with parallel.sequence_parallel" in text
    if not HAS_TE:  # the run's own start-up check says the same, naming the pinned version
        (problem,) = fp8_problems("tensorwise", CPU, backend="te")
        assert problem.startswith("train.fp8.backend te needs transformer-engine 2.20.2 (pip install 'moe-train[te]')")


# ------------------------------------------------------------------------------------------- on a GPU only

NEEDS_SM90 = pytest.mark.skipif(_capability() is None or _capability()[0] != 9,
                                reason="the real blockwise and grouped fp8 kernels need CUDA sm90 (none here)")


@NEEDS_SM90
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_real_linear_kernel_matches_the_emulated_gemm_on_sm90(recipe):
    cuda = torch.device("cuda")
    a, b = torch.randn(200, 640, device=cuda).bfloat16(), torch.randn(272, 640, device=cuda).bfloat16()
    assert runs_real(recipe, cuda)
    kwargs = {"recipe": recipe, "roles": ("input", "weight"), "out_dtype": torch.bfloat16}
    real, emulated = product(a, b, real=True, **kwargs), product(a, b, real=False, **kwargs)
    assert ((real.float() - emulated.float()).norm() / emulated.float().norm()).item() < 1e-2


@NEEDS_SM90
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_grouped_kernel_matches_the_emulated_gemm_on_sm90(recipe):
    cuda = torch.device("cuda")
    rows, weight = torch.randn(96, 128, device=cuda).bfloat16(), torch.randn(3, 64, 128, device=cuda).bfloat16()
    offsets = torch.tensor([32, 32, 96], dtype=torch.int32, device=cuda)  # one empty expert
    kwargs = {"recipe": recipe, "roles": ("input", "weight")}
    real = grouped_product(rows, weight, offsets, real=True, **kwargs)
    emulated = grouped_product(rows, weight, offsets, real=False, **kwargs)
    assert ((real.float() - emulated.float()).norm() / emulated.float().norm()).item() < 1e-2


@pytest.mark.skipif(not (HAS_TE and torch.cuda.is_available()),
                    reason="backend te needs transformer-engine and CUDA (neither here; unverified)")
def test_backend_te_gemm_is_fp8_close_to_the_exact_product():
    assert fp8_problems("tensorwise", torch.device("cuda"), backend="te") == []
