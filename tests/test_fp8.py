"""FP8 (issue 22): each recipe's quantisation against hand-computed values, the GEMMs against a reference written
here from the recipes' definitions, the GEMM site's fp8 marks, and short training runs against bf16."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import read_metrics, shrink

from moe_train.models.fp8.gemm import Fp8Gemm, count_fp8_gemms, product
from moe_train.models.fp8.runtime import fp8_problems
from moe_train.models.fp8.scaling import E4M3, E5M2, quantise
from moe_train.models.linear import grouped_mm, linear

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


# ---------------------------------------------------------------------------------- quantisation by hand


def test_tensorwise_one_scale_maps_amax_to_the_format_maximum():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    q = quantise(x, recipe="tensorwise", role="input")
    assert q.data.dtype == E4M3 and q.scale.tolist() == [[112.0]]  # 448 / 4
    assert q.data.float().tolist() == [[112.0, -224.0], [56.0, 448.0]]
    assert torch.equal(q.dequantise(torch.float32), x)
    grad = quantise(x, recipe="tensorwise", role="grad")  # gradients in e5m2: range over precision
    assert grad.data.dtype == E5M2 and grad.scale.item() == E5M2_MAX / 4


def test_rowwise_scales_are_per_row_powers_of_two():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    q = quantise(x, recipe="rowwise", role="weight")
    assert q.scale.tolist() == [[128.0], [64.0]]  # 448/2 = 224 and 448/4 = 112, rounded down to powers of 2
    assert q.data.float().tolist() == [[128.0, -256.0], [32.0, 256.0]]
    assert torch.equal(q.dequantise(torch.float32), x)


def test_blockwise_activations_per_1x128_and_weights_per_128x128():
    x = torch.ones(2, 256)
    x[0, 130] = 8.0  # only block (0, 1) of the activation tiles, and block (0, 1) of the weight blocks
    x[1, 5] = 2.0
    act = quantise(x, recipe="blockwise", role="input")
    assert act.scale.tolist() == [[448.0, 56.0], [224.0, 448.0]]
    weight = quantise(torch.ones(256, 256).index_put_((torch.tensor([3]), torch.tensor([200])), torch.tensor(7.0)),
                      recipe="blockwise", role="weight")
    assert weight.scale.tolist() == [[448.0, 64.0], [448.0, 448.0]]
    cut = quantise(torch.ones(3, 130), recipe="blockwise", role="weight")  # the last blocks cut short
    assert cut.scale.shape == (1, 2) and torch.equal(cut.dequantise(torch.float32), torch.ones(3, 130))


def test_mx_blocks_of_32_share_a_power_of_two_and_saturate():
    x = torch.ones(1, 64)
    x[0, 0] = 300.0  # block 0: floor(log2 300) = 8 = e4m3's largest exponent: scale 2^0
    x[0, 40] = 500.0  # block 1: floor(log2 500) = 8 too: 500 > 448 saturates
    q = quantise(x, recipe="mxfp8", role="input")
    assert q.scale.tolist() == [[1.0, 1.0]]
    out = q.dequantise(torch.float32)
    assert out[0, 0].item() == 288.0  # e4m3 steps by 32 between 256 and 512: 300 rounds to 288
    assert out[0, 40].item() == E4M3_MAX and out[0, 1].item() == 1.0
    small = quantise(torch.full((1, 32), 0.1), recipe="mxfp8", role="input")
    assert small.scale.item() == 2.0 ** (8 - math.floor(math.log2(0.1)))  # 2^12


@pytest.mark.parametrize("recipe", RECIPES)
def test_zeros_stay_zero_with_a_finite_scale(recipe):
    q = quantise(torch.zeros(4, 64), recipe=recipe, role="input")
    assert torch.isfinite(q.scale).all() and torch.equal(q.dequantise(torch.bfloat16), torch.zeros(4, 64).bfloat16())


# ------------------------------------------------------------------------------------- GEMMs by reference


def _reference_qdq(x: torch.Tensor, rows: int, cols: int, *, power_of_two: str | None) -> torch.Tensor:
    """Quantise-dequantise block by block, written from the recipes' definitions with loops."""
    out = torch.empty_like(x)
    for r in range(0, x.shape[0], rows):
        for c in range(0, x.shape[1], cols):
            block = x[r:r + rows, c:c + cols].float()
            amax = max(block.abs().max().item(), 1e-12)
            if power_of_two == "mx":
                scale = 2.0 ** (8 - math.floor(math.log2(amax)))
            elif power_of_two == "floor":
                scale = 2.0 ** math.floor(math.log2(E4M3_MAX / amax))
            else:
                scale = torch.tensor(E4M3_MAX / amax, dtype=torch.float64).float().item()
            data = (block * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
            out[r:r + rows, c:c + cols] = data.float() / scale
    return out


REFERENCE = {  # recipe: (a's block, b's block as a weight, power-of-two rule)
    "tensorwise": (None, None, None),
    "rowwise": ((1, None), (1, None), "floor"),
    "blockwise": ((1, 128), (128, 128), None),
    "mxfp8": ((1, 32), (1, 32), "mx"),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_gemm_against_the_hand_reference(recipe):
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(20, 300, generator=generator).bfloat16()
    b = torch.randn(140, 300, generator=generator).bfloat16()
    blocks_a, blocks_b, rule = REFERENCE[recipe]

    def block(shape, t):
        return (t.shape[0], t.shape[1]) if shape is None else (shape[0], shape[1] or t.shape[1])

    ref_a = _reference_qdq(a.float(), *block(blocks_a, a), power_of_two=rule)
    ref_b = _reference_qdq(b.float(), *block(blocks_b, b), power_of_two=rule)
    expected = ref_a.bfloat16() @ ref_b.bfloat16().t()
    emulated = product(a, b, recipe=recipe, roles=("input", "weight"), real=False, out_dtype=torch.bfloat16)
    assert torch.equal(emulated, expected)
    if recipe in ("tensorwise", "rowwise"):  # the real kernel: fp32 accumulation of the same fp8 values
        real = product(a, b, recipe=recipe, roles=("input", "weight"), real=True, out_dtype=torch.bfloat16)
        torch.testing.assert_close(real.float(), ref_a @ ref_b.t(), rtol=1e-2, atol=1e-1)
    exact = a.float() @ b.float().t()
    error = ((emulated.float() - exact).norm() / exact.norm()).item()
    assert 1e-3 < error < 0.08  # fp8, not bf16: a few percent


@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_and_grouped_gradients_are_fp8_close_to_bf16(recipe):
    """Every product of both GEMM kinds runs in fp8 (counted), and lands within fp8's error of bf16's."""
    gemm = Fp8Gemm(recipe=recipe)
    generator = torch.Generator().manual_seed(1)

    def run(fp8):
        x = torch.randn(3, 40, 160, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
        w = torch.randn(48, 160, generator=torch.Generator().manual_seed(2)).bfloat16().requires_grad_()
        rows = torch.randn(50, 64, generator=torch.Generator().manual_seed(3)).bfloat16().requires_grad_()
        experts = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(4)).bfloat16().requires_grad_()
        offsets = torch.tensor([10, 10, 30, 50], dtype=torch.int32)  # expert 1 has no rows
        (linear(x, w, fp8=fp8).square().sum() + grouped_mm(rows, experts, offsets, fp8=fp8).square().sum()).backward()
        return [x.grad, w.grad, rows.grad, experts.grad]

    del generator
    with count_fp8_gemms() as tally:
        fp8_grads = run(gemm)
    mode = "real" if recipe in ("tensorwise", "rowwise") else "emulated"
    assert dict(tally) == {**{("linear", p, mode): 1 for p in ("forward", "input_grad", "weight_grad")},
                           **{("grouped", p, "emulated"): 1 for p in ("forward", "input_grad", "weight_grad")}}
    for got, want in zip(fp8_grads, run(None), strict=True):
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert 1e-3 < error < 0.1, error
    assert torch.equal(fp8_grads[3][1], torch.zeros_like(fp8_grads[3][1]))  # the empty expert


def test_the_torchao_torch_pair_passes_the_start_up_check():
    for recipe in RECIPES:
        assert fp8_problems(recipe, torch.device("cpu")) == []


# ----------------------------------------------------------------------------------------------- training

# One layer (attention and routed experts), one micro-batch of 2 x 32 tokens per step, 30 steps: the loss falls
# from ~5.6 (uniform over 257 bytes) to ~3.3.
SHORT = shrink("model.num_layers=1", "train.global_batch_size=2", "train.warmup_steps=2", "train.steps=30",
               without=("train.precision",))


def _train(name: str, run_dir, *sets: str) -> tuple[list[float], Counter]:
    from moe_train.config import load_recipe
    from moe_train.train.loop import Trainer

    trainer = Trainer(load_recipe(name, [*SHORT, f"run_dir={run_dir}", *sets]))
    with count_fp8_gemms() as tally:
        trainer.train()
    return [r["loss"] for r in read_metrics(run_dir, "train")], tally


def _assert_trains_like(fp8: list[float], bf16: list[float], tally: Counter, recipe: str) -> None:
    """The last loss within 5% of bf16's and below 0.8x the first; not bf16's numbers; the GEMMs ran in fp8."""
    assert fp8[-1] == pytest.approx(bf16[-1], rel=0.05) and fp8[-1] < 0.8 * fp8[0], (recipe, fp8, bf16)
    assert fp8 != bf16
    mode = "real" if recipe in ("tensorwise", "rowwise") else "emulated"
    assert {key[2] for key in tally if key[0] == "linear"} == {mode}
    assert tally[("grouped", "forward", "emulated")] > 0  # the routed experts' grouped GEMMs, emulated


@pytest.fixture(scope="module")
def qwen_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8-qwen")
    runs = {"bf16": (_train("qwen3-moe-tiny", root / "bf16", "train.precision=bf16"), root / "bf16")}
    for recipe in ("tensorwise", "rowwise"):
        runs[recipe] = (_train("qwen3-moe-tiny", root / recipe, "train.precision=fp8", f"train.fp8.recipe={recipe}"),
                        root / recipe)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_qwen3_moe_fp8_trains_like_bf16(qwen_runs, recipe):
    (bf16, none), _ = qwen_runs["bf16"]
    assert sum(none.values()) == 0
    (fp8, tally), _ = qwen_runs[recipe]
    _assert_trains_like(fp8, bf16, tally, recipe)


# deepseek-v3-tiny as one MoE layer (MLA, shared and routed experts; no dense layer, no MTP: half the work).
ONE_MOE_LAYER = ("model.first_k_dense=0", "model.mtp_layers=0")


@pytest.mark.slow
def test_deepseek_v3_blockwise_emulated_trains_like_bf16(tmp_path):
    bf16, _ = _train("deepseek-v3-tiny", tmp_path / "bf16", *ONE_MOE_LAYER, "train.precision=bf16")
    fp8, tally = _train("deepseek-v3-tiny", tmp_path / "fp8", *ONE_MOE_LAYER, "train.precision=fp8",
                        "train.fp8.recipe=blockwise")
    _assert_trains_like(fp8, bf16, tally, "blockwise")


@pytest.mark.slow
def test_fp8_checkpoint_exports_to_hf_and_continues_in_bf16(qwen_runs, tmp_path):
    """The checkpoint holds fp32 master weights: transformers loads its export, and a bf16 run resumes it."""
    import transformers

    from moe_train.checkpoint.convert import to_hf
    from moe_train.checkpoint.layout import latest_checkpoint
    from moe_train.checkpoint.state import load_model_weights
    from moe_train.config import load_recipe
    from moe_train.models import build_model
    from moe_train.models.init import materialize

    (fp8, _), run_dir = qwen_runs["rowwise"]
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    to_hf(ckpt, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.dtype == torch.float32
    ours = build_model(load_recipe("qwen3-moe-tiny", SHORT).model, device="meta")
    materialize(ours, device="cpu")
    load_model_weights(ckpt, ours, own=False)
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)

    continued, tally = _train("qwen3-moe-tiny", tmp_path / "bf16", "train.precision=bf16", "train.steps=32",
                              f"checkpoint.resume={ckpt}")
    assert len(continued) == 2 and sum(tally.values()) == 0
    assert continued[0] == pytest.approx(fp8[-1], rel=0.25)  # from where fp8 left off, not from scratch (~5.5)


def test_measure_reports_fp8_gemms_by_count(no_process_group):
    """One micro-batch through one layer of qwen3-moe-tiny: 4 attention projections x 3 products (linear),
    3 expert projections x 3 products (grouped), as written out from the config."""
    from moe_train.config import load_recipe
    from moe_train.measure.driver import Target, measure

    report = measure(load_recipe("qwen3-moe-tiny", [*SHORT, "train.precision=fp8"]), Target())
    assert report["fp8_gemms"] == {**{f"linear/{p}/real": 4 for p in ("forward", "input_grad", "weight_grad")},
                                   **{f"grouped/{p}/emulated": 3 for p in ("forward", "input_grad", "weight_grad")}}


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_weight_gradient_scales_each_experts_tokens_alone(recipe):
    """The grouped weight gradient (one GEMM for all experts) equals each expert's own fp8 product of its
    segments (quantised from row 0 of the segment: blocks never span two experts), expert 1 empty."""
    generator = torch.Generator().manual_seed(5)
    grad = torch.randn(300, 24, generator=generator) * torch.linspace(0.1, 10, 300)[:, None]
    rows = torch.randn(300, 40, generator=generator)
    offsets = torch.tensor([70, 70, 230, 300], dtype=torch.int32)
    got = Fp8Gemm(recipe=recipe).grouped_weight_grad(grad, rows, offsets)
    starts = [0, 70, 70, 230]
    for expert, (start, end) in enumerate(zip(starts, offsets.tolist(), strict=True)):
        g, r = grad[start:end], rows[start:end]
        if recipe == "tensorwise":  # one scale for the whole tensor
            want = quantise(grad, recipe=recipe, role="grad").dequantise(torch.float32)[start:end].t() @ \
                quantise(rows, recipe=recipe, role="input").dequantise(torch.float32)[start:end]
        else:
            want = product(g.t().contiguous(), r.t().contiguous(), recipe=recipe, roles=("grad", "input"),
                           real=False, out_dtype=torch.float32)
        torch.testing.assert_close(got[expert], want, rtol=1e-5, atol=1e-5, msg=f"expert {expert}")


@pytest.mark.slow
def test_plan_holds_fp8_to_measure_exactly(no_process_group):
    """fp8 saves what bf16 saves (the high-precision operands), adds no collective and counts the same FLOPs, so
    plan (which prices fp8's memory and traffic as bf16's) equals measure exactly: deepseek-v3-tiny at TP2 with
    sequence parallelism, fake ranks (MLA, a dense layer, shared and routed experts). Its fp8 GEMMs per micro-batch:
    layer 0's 5 MLA projections and 3 MLP GEMMs, layer 1's 5 and 3 shared-expert GEMMs; 3 grouped ones."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import HARDWARE
    from moe_train.measure.driver import Target, measure
    from moe_train.measure.versus_plan import against
    from moe_train.plan.estimate import estimate, plan_json

    recipe = load_recipe("deepseek-v3-tiny", [
        "model.num_layers=2", "model.mtp_layers=0", "train.seq_length=64", "train.precision=fp8",
        "train.micro_batch_size=1", "train.global_batch_size=1", "parallel.tp=2", "launch.gpus_per_node=2",
        "parallel.sequence_parallel=true"], check_files=False)
    report = measure(recipe, Target(fake=True))
    figures = against(plan_json(estimate(recipe, HARDWARE["h100"])), report)
    assert figures and [f.name for f in figures if f.relative_error > (0 if f.name == "param_bytes" else 1e-9)] == []
    assert report["fp8_gemms"] == {**{f"linear/{p}/real": 16 for p in ("forward", "input_grad", "weight_grad")},
                                   **{f"grouped/{p}/emulated": 3 for p in ("forward", "input_grad", "weight_grad")}}
    # the fp8 GEMMs' FLOPs (`flops/fp8` above, what plan's fp8 speed-up applies to): all but the router's, the
    # head's and SDPA's
    assert 0 < report["fp8_gemm_flops"] < report["flops"]["total"]


@pytest.mark.slow
def test_plan_prices_only_the_fp8_modules_flops_at_the_fp8_speed(no_process_group):
    """plan's fp8_gemm_flops follows train.fp8.modules, equal to measure's under recomputation (selective, whose
    reruns count again) and with the head in fp8 through the chunked loss (whose backward recomputes each chunk's
    logits): qwen3-moe-tiny on one fake rank. Only the fp8 FLOPs get fp8_gemm_speedup: the step's compute time
    falls from the experts alone to every module, and with no fp8 module it is bf16's."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import HARDWARE
    from moe_train.measure.driver import Target, measure
    from moe_train.measure.versus_plan import against
    from moe_train.plan.estimate import estimate, plan_json

    base = ["model.num_layers=2", "train.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=1"]
    compute, fp8_flops = {}, {}
    for modules in ("[experts]", "[attention,experts,head]"):
        recipe = load_recipe("qwen3-moe-tiny", [
            *base, "train.precision=fp8", f"train.fp8.modules={modules}", "train.loss_chunk_tokens=16",
            "parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe_act,core_attn]"],
            check_files=False)
        report, plan = measure(recipe, Target(fake=True)), estimate(recipe, HARDWARE["h100"])
        assert [f.name for f in against(plan_json(plan), report) if f.relative_error > 1e-9] == [], modules
        fp8_flops[modules], compute[modules] = report["fp8_gemm_flops"], plan.time["compute"]
    assert 0 < fp8_flops["[experts]"] < fp8_flops["[attention,experts,head]"]
    bf16 = estimate(load_recipe("qwen3-moe-tiny", [*base, "train.precision=bf16"], check_files=False),
                    HARDWARE["h100"])
    assert compute["[attention,experts,head]"] < compute["[experts]"] < bf16.time["compute"]


# ------------------------------------------------------------------------------------- train.adam_moment_dtype


@pytest.mark.slow
def test_bf16_adam_moments_halve_the_optimizer_state_as_planned(no_process_group):
    """Measured optimizer bytes drop by 4 per parameter (m and v: 8 -> 4), as plan says; the update stays
    AdamW's: the first step's parameters agree with fp32 moments' to bf16's rounding of the moments."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import HARDWARE
    from moe_train.measure.driver import Target, measure
    from moe_train.plan.estimate import estimate, plan_json

    reports, plans = {}, {}
    for dtype in ("fp32", "bf16"):
        recipe = load_recipe("qwen3-moe-tiny", [*SHORT, "train.precision=fp32", f"train.adam_moment_dtype={dtype}"])
        reports[dtype] = measure(recipe, Target())
        plans[dtype] = plan_json(estimate(recipe, HARDWARE["h100"]))["memory_bytes"]["optimizer"]
    params = reports["fp32"]["param_bytes"] // 4
    assert reports["fp32"]["optimizer_bytes"] - reports["bf16"]["optimizer_bytes"] == 4 * params
    assert plans["fp32"] - plans["bf16"] == 4 * params and plans["bf16"] == 4 * params


def test_bf16_moment_adamw_matches_adamw_to_bf16_rounding():
    from moe_train.train.optimizer import Bf16MomentAdamW

    generator = torch.Generator().manual_seed(0)
    start = torch.randn(64, 32, generator=generator)
    exact, rounded = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference = torch.optim.AdamW([exact], lr=1e-2, fused=True)
    optimizer = Bf16MomentAdamW([rounded], lr=1e-2, fused=True)
    for _ in range(5):
        grad = torch.randn(64, 32, generator=generator)
        exact.grad, rounded.grad = grad.clone(), grad.clone()
        reference.step()
        optimizer.step()
    state = optimizer.state[rounded]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and state["step"].item() == 5
    difference = (exact - rounded).abs().max().item()
    assert 0 < difference < 1e-3  # five steps of 1e-2: the moments' bf16 rounding, no more
    reloaded = Bf16MomentAdamW([rounded], lr=1e-2, fused=True)
    reloaded.load_state_dict(optimizer.state_dict())  # torch casts the moments to the parameter's fp32
    rounded.grad = torch.ones(64, 32)
    reloaded.step()
    assert reloaded.state[rounded]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_stack_of_experts_quantises_each_expert_alone(recipe):
    experts = torch.randn(3, 130, 150, generator=torch.Generator().manual_seed(7)) * torch.tensor([1.0, 50.0, 0.01])[
        :, None, None]
    together = quantise(experts, recipe=recipe, role="weight").dequantise(torch.float32)
    for expert in range(3):
        alone = quantise(experts[expert], recipe=recipe, role="weight").dequantise(torch.float32)
        assert torch.equal(together[expert], alone), expert


# ------------------------------------------------------------------------------------ FSDP2's fp8 all-gather


def test_shards_quantised_with_the_whole_amax_are_the_quantised_whole_and_run_the_same_gemms():
    """What FSDP2's fp8 all-gather does (models/fp8/all_gather.py): each rank's rows of the bf16 weight quantised
    with the whole weight's amax, gathered, are bit for bit the quantised weight (an uneven last shard padded
    with zeros); the GEMM site runs that data and scale as they are, as many fp8 GEMMs, the same bits as from the
    bf16 weight, forward and input gradient."""
    from moe_train.models.fp8.all_gather import Fp8GatheredWeight
    from moe_train.models.fp8.scaling import block_amax

    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(45, 64, generator=generator) * torch.linspace(0.01, 3, 45)[:, None]).bfloat16()
    amax = block_amax(weight, 45, 64)
    shards = [torch.nn.functional.pad(part, (0, 0, 0, 16 - part.shape[0])) for part in weight.split(16)]
    gathered = torch.cat([quantise(s, recipe="tensorwise", role="weight", amax=amax).data for s in shards])[:45]
    whole = quantise(weight, recipe="tensorwise", role="weight")
    assert torch.equal(gathered.view(torch.uint8), whole.data.view(torch.uint8))
    fp8_weight = Fp8GatheredWeight(gathered, whole.scale.reshape(()), torch.bfloat16)
    x = torch.randn(2, 10, 64, generator=generator).bfloat16()
    grad = torch.randn(2, 10, 45, generator=generator).bfloat16()
    gemm = Fp8Gemm(recipe="tensorwise")
    with count_fp8_gemms() as plain_tally:
        want = gemm.forward(x, weight), gemm.input_grad(grad, weight)
    with count_fp8_gemms() as tally:
        got = gemm.forward(x, fp8_weight), gemm.input_grad(grad, fp8_weight)
    assert tally == plain_tally and sum(tally.values()) == 2
    for a, b in zip(got, want, strict=True):
        assert type(a) is torch.Tensor and torch.equal(a, b)
    assert torch.equal(fp8_weight.detach() + 0, (gathered.float() / whole.scale).bfloat16())  # other ops: dequantised
    # the CUDA kernels' zero padding (layouts.padded), applied to the gathered operand, is the padded weight quantised
    from moe_train.models.fp8.layouts import padded
    from moe_train.models.fp8.scaling import padded_quantised

    pad, want = padded_quantised(fp8_weight.quantised(transposed=False), 16, 48), quantise(
        padded(weight, 16, 48), recipe="tensorwise", role="weight")
    assert pad.data.shape == (48, 96) and (pad.block_rows, pad.block_cols) == (want.block_rows, want.block_cols)
    assert torch.equal(pad.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(pad.scale, want.scale)


def test_chunked_loss_runs_an_fp8_head_through_the_fp8_site():
    """`head` in train.fp8.modules with train.loss_chunk_tokens: each chunk's logits (forward, and again in
    backward) and its input and weight gradients are fp8 GEMMs of the head, and the loss and the head's gradient
    are the unchunked fp8 head's within fp8's error (each chunk's activations take their own scale)."""
    from moe_train.config import load_recipe
    from moe_train.config.schema import Fp8Config
    from moe_train.models import build_model
    from moe_train.models.fp8.select import apply_fp8

    torch.manual_seed(0)
    model = build_model(load_recipe("qwen3-tiny", ["model.num_layers=1"]).model).train()
    assert apply_fp8(model, Fp8Config(modules=["head"])) == {"head": 1}
    ids = torch.randint(0, 257, (2, 32))
    labels = ids.roll(-1, dims=1)
    runs = {}
    for chunk in (0, 16):
        model.zero_grad()
        model.lm_loss.chunk_tokens = chunk
        with count_fp8_gemms() as tally:
            terms = model(ids, labels=labels)
            terms.lm_sum.backward()
        runs[chunk] = terms.lm_sum.detach(), model.lm_head.weight.grad.clone(), dict(tally)
    (loss, grad, tally), (chunked_loss, chunked_grad, chunked_tally) = runs[0], runs[16]
    assert tally == {("linear", p, "real"): 1 for p in ("forward", "input_grad", "weight_grad")}
    assert chunked_tally == {("linear", "forward", "real"): 8, ("linear", "input_grad", "real"): 4,
                             ("linear", "weight_grad", "real"): 4}
    assert chunked_loss == pytest.approx(loss.item(), rel=1e-2)
    assert (chunked_grad - grad).norm() / grad.norm() < 0.1


FSDP_DP2 = ["model.num_layers=2", "train.seq_length=32", "train.precision=fp8", "train.micro_batch_size=1",
            "train.global_batch_size=4", "launch.gpus_per_node=2"]  # DP2: 2 micro-batches per rank
GATHER = "train.fp8.fp8_all_gather=true"
PER_STEP_HEAD = ["parallel.param_gather=per_step", "train.fp8.modules=[attention,experts,head]"]


@pytest.mark.slow
def test_plan_holds_the_fp8_all_gather_to_measure_exactly(no_process_group):
    """FSDP2 DP2 in fp8 (qwen3-moe-tiny, fake ranks), with and without the fp8 gather, per micro-batch and per
    step with the head in fp8: every figure of plan equals measure's, the all-gather bytes and the fp8 weights'
    amax all-reduces among them, and so do the bytes of the gathered parameters FSDP2 holds (what per-step
    gathers hold over the step). With the fp8 gather each block gather sends its 4 attention weights' shard
    (98,304 elements over 2 layers, half on each rank; the head's padded vocabulary x 128 likewise) at 1 byte
    instead of 2, after all-reducing their amaxes (4 bytes each); each unit is gathered 2 x 2 times per step
    (2 micro-batches, forward and backward) or once (per step)."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import HARDWARE
    from moe_train.measure.driver import Target, measure
    from moe_train.measure.versus_plan import against
    from moe_train.plan.estimate import estimate, plan_json

    reports = {}
    for key, sets in {"bf16": [], "fp8": [GATHER], "bf16-step": PER_STEP_HEAD,
                      "fp8-step": [*PER_STEP_HEAD, GATHER]}.items():
        recipe = load_recipe("qwen3-moe-tiny", [*FSDP_DP2, *sets], check_files=False)
        report, plan = measure(recipe, Target(fake=True)), plan_json(estimate(recipe, HARDWARE["h100"]))
        assert [f.name for f in against(plan, report) if f.relative_error > 0] == [], key
        assert report["gathered_param_bytes"] == plan["params"]["gathered_bytes"] > 0, key
        reports[key] = report
    attention = 2 * (128 * 128 + 64 * 128 + 64 * 128 + 128 * 128)  # q, k, v, o of 2 layers: 1 byte saved each
    vocab = recipe.model.padded_vocab_size() * 128
    for plain, fp8, gathers, saved, weights in (("bf16", "fp8", 4, attention, 8),
                                                ("bf16-step", "fp8-step", 1, attention + vocab, 9)):
        comm, plain_comm = reports[fp8]["comm_bytes"], reports[plain]["comm_bytes"]
        assert plain_comm["dp/all_gather"] - comm["dp/all_gather"] == gathers * saved // 2, fp8
        assert comm["dp/all_reduce"] - plain_comm["dp/all_reduce"] == gathers * 4 * weights, fp8
        assert reports[plain]["gathered_param_bytes"] - reports[fp8]["gathered_param_bytes"] == saved, fp8
