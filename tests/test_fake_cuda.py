"""The engine's CUDA branches at sm80, sm90 and sm100, run through torch's real meta checks on fake CUDA tensors
(tests/fake_cuda.py): what the kernel table sends to torch._scaled_mm, torch._scaled_grouped_mm,
torch._grouped_mm and torch.bmm must pass their dtype, shape and stride rules there, or the first GPU step
crashes where no CPU test goes (issue 33: tensorwise's e5m2 gradients into the e4m3-only grouped kernel).
Autograd cannot run on fake CUDA tensors (fake_cuda.py says why), so each backward GEMM is called as the
autograd Function's backward calls it. docs/gpu.md lists what this covers and what it cannot reach."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import SM80, SM90, SM100, fake_cuda, on_fake_cuda
from helpers import fast_sample

from moe_train.config import load_recipe
from moe_train.kernels import fp8_kernel
from moe_train.models.fp8 import gemm
from moe_train.models.fp8.gemm import Fp8Gemm, count_fp8_gemms
from moe_train.models.fp8.runtime import fp8_problems
from moe_train.models.linear import expert_offsets
from moe_train.models.model import Transformer
from moe_train.models.moe.experts import GroupedExperts, expert_kernel

CAPABILITIES = [SM80, SM90, SM100]
RECIPES = ["tensorwise", "rowwise", "blockwise", "mxfp8"]
BF16 = torch.bfloat16


def _cuda(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, device="cuda", dtype=dtype)


# ------------------------------------------------------------------------------------ fp8 products


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_fp8_product_passes_the_kernels_checks(capability, recipe):
    """Each role pair of a linear layer (input x weight, grad x weight, input x grad: with the input as it came
    and kept in fp8) and of the routed experts, real where the table says (then through the real kernel's meta
    checks) and emulated elsewhere; odd sizes, so the padding to the kernels' multiples runs."""
    with fake_cuda(capability), count_fp8_gemms() as tally:
        fp8 = Fp8Gemm(recipe)
        x, grad, weight = _cuda(3, 37, 200), _cuda(3, 37, 136), _cuda(136, 200)
        assert fp8.forward(x, weight).shape == (3, 37, 136)
        assert fp8.input_grad(grad, weight).shape == (3, 37, 200)
        assert fp8.weight_grad(grad, x).shape == (136, 200)
        kept = fp8.kept_input(x)
        assert fp8.weight_grad(grad, fp8.weight_grad_operand(kept.data, kept.scale)).shape == (136, 200)
        rows, grad_rows, experts = _cuda(96, 256), _cuda(96, 384), _cuda(4, 384, 256)
        offsets = torch.tensor([16, 48, 48, 96], device="cuda", dtype=torch.int32)  # an empty expert
        assert fp8.grouped_forward(rows, experts, offsets).shape == (96, 384)
        assert fp8.grouped_input_grad(grad_rows, experts, offsets).shape == (96, 256)
        assert fp8.grouped_weight_grad(grad_rows, rows, offsets).shape == (4, 384, 256)
        kept_rows = fp8.kept_rows(rows, offsets)
        assert fp8.grouped_weight_grad(grad_rows, kept_rows, offsets).shape == (4, 384, 256)
    linear = "real" if fp8_kernel(recipe, "cuda", capability)[0] else "emulated"
    grouped = "real" if fp8_kernel(recipe, "cuda", capability, grouped=True)[0] else "emulated"
    assert tally == {
        ("linear", "forward", linear): 1,
        ("linear", "input_grad", linear): 1,
        ("linear", "weight_grad", linear): 2,
        ("grouped", "forward", grouped): 1,
        ("grouped", "input_grad", grouped): 1,
        ("grouped", "weight_grad", "emulated"): 2,
    }


def test_the_e5m2_gradient_would_reach_the_grouped_kernel_without_the_fix(monkeypatch):
    """The crash the fix removes, kept visible: the same grouped input gradient on sm90 with the operand left in
    tensorwise's e5m2 (the kernel table's format rule switched off) fails the kernel's own check."""
    monkeypatch.setattr(gemm, "fp8_operand_format", lambda recipe_format, *args, **kwargs: recipe_format)
    with fake_cuda(SM90), pytest.raises(RuntimeError, match="Expected inputs of E4M3 FP8 type"):
        Fp8Gemm("tensorwise").grouped_input_grad(
            _cuda(96, 384), _cuda(4, 384, 256), torch.tensor([16, 48, 48, 96], device="cuda", dtype=torch.int32)
        )


def test_the_start_up_probe_tries_every_role_pair(monkeypatch):
    """A kernel that takes the forward's e4m3 x e4m3 but refuses an e5m2 gradient (as the grouped kernel does):
    the probe finds it at the input gradient's pair and falls back, naming the pair, instead of the first
    backward crashing."""
    real_scaled_mm = torch._scaled_mm

    def e4m3_only(a, b, *args, **kwargs):
        if torch.float8_e5m2 in (a.dtype, b.dtype):
            raise RuntimeError("Expected inputs of E4M3 FP8 type")
        return real_scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", e4m3_only)
    monkeypatch.setattr(gemm, "_FALLEN_BACK", {})
    cpu = torch.device("cpu")
    assert gemm.runs_real("tensorwise", cpu)
    assert fp8_problems("tensorwise", cpu) == []
    real, why = gemm.kernel_choice("tensorwise", cpu)
    assert not real and why.startswith("the real tensorwise fp8 GEMM raised at start-up: RuntimeError: Expected")
    assert why.endswith("(operands grad x weight)")


# --------------------------------------------------------------------------------------- bf16 experts


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_the_bf16_experts_pass_the_grouped_and_batched_gemm_checks(capability):
    """The experts' kernel by capability (grouped GEMM from sm90, the padded batched GEMM below), forward and
    the grouped GEMM's two backward products (rows' and weights' gradients) with 16-byte strides; a hidden
    size off the 16-byte rule is refused by the table and by the kernel's own check alike."""
    with fake_cuda(capability):
        with torch.device("meta"):
            experts = GroupedExperts(num_experts=4, hidden_size=64, ffn_hidden_size=48)
        on_fake_cuda(experts)
        rows, counts, probs = _cuda(40, 64), torch.tensor([8, 0, 20, 12], device="cuda"), _cuda(40, dtype=torch.float32)
        kernel, why = expert_kernel(BF16, rows.device, hidden_size=64, ffn_hidden_size=48)
        assert kernel == ("grouped_mm" if capability >= SM90 else "padded_bmm"), why
        assert experts(rows, counts, probs=probs, capacity=20).shape == (40, 64)
        offsets, grad, weight = expert_offsets(counts), _cuda(40, 48), experts.gate_proj
        assert torch._grouped_mm(grad, weight, offs=offsets).shape == (40, 64)  # the rows' gradient
        assert torch._grouped_mm(grad.t(), rows, offs=offsets).shape == (4, 48, 64)  # the weights' gradient
        assert experts._padded(rows, counts, probs[:, None].to(BF16), 20).shape == (40, 64)
        assert expert_kernel(BF16, rows.device, hidden_size=60, ffn_hidden_size=48)[0] == "padded_bmm"
        with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
            torch._grouped_mm(_cuda(40, 60), _cuda(4, 60, 48), offs=offsets)


# ---------------------------------------------------------------------------- the rest of the table


def test_the_chunked_loss_and_the_document_block_mask_build_on_cuda():
    """The chunked loss's forward over the head GEMM; packed documents get FlexAttention's block mask (the cuda
    row's `documents`), built for real on fake tensors."""
    from torch.nn.attention.flex_attention import BlockMask

    from moe_train.models.attention import attention_mask
    from moe_train.models.loss import linear_cross_entropy_sum

    with fake_cuda(SM90):
        hidden, head, targets = _cuda(128, 32), _cuda(500, 32), torch.randint(500, (128,), device="cuda")
        loss = linear_cross_entropy_sum(hidden, head, targets, chunk_tokens=48, vocab_size=500)
        assert loss.shape == () and loss.dtype == torch.float32
        positions = torch.cat([torch.arange(128), torch.arange(128)]).to("cuda").expand(2, 256)
        mask = attention_mask(positions)
        assert isinstance(mask, BlockMask) and mask.kv_num_blocks.shape == (2, 1, 2)


def test_the_shared_experts_run_on_the_side_stream_in_order():
    """The side stream's protocol (models/moe/layer.py): the side stream waits for the main stream's event
    before the shared experts read x, x is marked as used there, the shared experts run on it, and the main
    stream waits for the side stream before the output, marked as used on main, is read."""
    cfg = load_recipe("deepseek-v3-tiny", ["launch.device=cuda", "launch.gpu=h200"]).model
    with fake_cuda(SM90) as fake:
        with torch.device("meta"):
            model = Transformer(cfg)
        layer = next(
            block.ffn
            for block in on_fake_cuda(model).layers.values()
            if getattr(block.ffn, "shared_experts", None) is not None
        )
        layer.dispatcher.num_local_experts = cfg.moe.num_experts // 2  # as with expert parallelism: it overlaps
        seen = []
        layer.shared_experts.register_forward_pre_hook(lambda *_: seen.append(torch.cuda.current_stream().name))
        shared = layer._start_shared_experts(_cuda(64, cfg.hidden_size))
        layer._finish_shared_experts(shared)
    assert seen == ["side1"]
    assert fake.log == [
        ("record", "main"),
        ("wait", "side1", "main"),
        ("record_stream", (64, cfg.hidden_size), "side1"),
        ("record", "side1"),
        ("wait", "main", "side1"),
        ("record_stream", (64, cfg.hidden_size), "main"),
    ]


def test_the_fp8_gathered_weight_meets_the_real_kernel_padded():
    """FSDP2's fp8 all-gather hands the GEMM an `Fp8GatheredWeight` (fp8 data and its scale): on CUDA its operand
    is padded in fp8 to the kernel's multiples and must pass torch._scaled_mm's checks, forward and input
    gradient (the transposed weight)."""
    from moe_train.models.fp8.all_gather import Fp8GatheredWeight
    from moe_train.models.fp8.scaling import quantise

    with fake_cuda(SM90), count_fp8_gemms() as tally:
        q = quantise(_cuda(136, 200), recipe="tensorwise", role="weight")
        weight = Fp8GatheredWeight(q.data, q.scale, BF16)
        fp8 = Fp8Gemm("tensorwise")
        assert fp8.forward(_cuda(37, 200), weight).shape == (37, 136)
        assert fp8.input_grad(_cuda(37, 136), weight).shape == (37, 200)
    assert tally == {("linear", "forward", "real"): 1, ("linear", "input_grad", "real"): 1}


@pytest.mark.parametrize("name", fast_sample(["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "glm4-moe-tiny",
                                              "gpt-oss-tiny"], 3))
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_model_forward_of_each_family_runs_on_fake_cuda(name, precision):
    """The whole forward with its loss, bf16 and fp8 (tensorwise: real linear and grouped GEMMs on sm90), on
    fake CUDA tensors end to end. The backward cannot run here (autograd: fake_cuda.py), nor packed documents
    (FlexAttention: docs/gpu.md)."""
    from moe_train.models.fp8.select import apply_fp8

    sets = ["launch.device=cuda", "launch.gpu=h200", f"train.precision={precision}"]
    if name == "deepseek-v3-tiny" and precision == "fp8":  # validate: its kv_a_proj_with_mqa is 40 x 128
        sets.append("train.fp8.modules=[mlp,shared_experts,experts]")
    recipe = load_recipe(name, sets)
    cfg = recipe.model
    with fake_cuda(SM90), count_fp8_gemms() as tally:
        with torch.device("meta"):
            model = Transformer(cfg)
        if precision == "fp8":
            apply_fp8(model, recipe.train.fp8)
        ids = torch.randint(cfg.vocab_size, (2, 64), device="cuda")
        terms = on_fake_cuda(model)(ids, labels=ids)
        assert terms[0].shape == () and terms[0].device.type == "cuda"
    if precision == "fp8":
        assert tally[("linear", "forward", "real")] > 0
        assert (tally[("grouped", "forward", "real")] > 0) == (cfg.moe is not None)
