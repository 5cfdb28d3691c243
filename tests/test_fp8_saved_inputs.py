"""`train.fp8.saved_inputs: fp8` (issues 22 and 25): fp8 GEMMs keep their inputs for backward in fp8, quantised as
the weight gradient reads them, instead of in bf16. The same numbers bit for bit (one GEMM, and whole training
runs of each recipe: losses, gradients, parameters), fewer bytes kept, as many as plan says (measure --fake, tiny
layouts and recompute policies, and a full-size DeepSeek-V3 MoE layer in MXFP8)."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
from helpers import GPU, NO_PIPELINE, fast_sample, plan_against_measure, recompute, tiny_recipe
from workers.record import record_run

from moe_train.config import load_recipe
from moe_train.measure.driver import Target, measure
from moe_train.measure.targets import as_fake_runs
from moe_train.models.declarations.saves import grouped_scale_bytes, linear_scale_bytes
from moe_train.models.fp8 import gemm as fp8_gemm
from moe_train.models.fp8.gemm import Fp8Gemm
from moe_train.models.fp8.layouts import padded
from moe_train.models.fp8.scaling import padded_quantised, quantise
from moe_train.parallel.recompute import recomputed
from moe_train.plan.estimate import estimate, plan_json

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def _kept_storages(run) -> tuple[dict[int, tuple[torch.dtype, int]], object]:
    """(storage -> (dtype, bytes) of every non-parameter tensor autograd saves while `run()` runs forward, its
    result)."""
    kept: dict[int, tuple[torch.dtype, int]] = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter):
            kept[tensor.untyped_storage()._cdata] = (tensor.dtype, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return kept, out


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemms_keep_one_fp8_copy_of_a_shared_input_and_give_the_same_gradients(recipe):
    """Two linear GEMMs reading one x (gate and up) and two grouped GEMMs reading one set of expert rows (an
    expert empty): bf16 keeps x and the rows; fp8 one fp8 copy of each (1 byte an element) and its fp32 scales;
    every gradient bit-equal."""
    generator = torch.Generator().manual_seed(3)
    x0 = (torch.randn(4, 96, 128, generator=generator) * torch.linspace(0.1, 8, 128)).to(torch.bfloat16)
    rows0 = torch.randn(300, 64, generator=generator).to(torch.bfloat16)
    offsets = torch.tensor([70, 70, 230, 300], dtype=torch.int32)
    w = [torch.randn(48, 128, generator=generator).to(torch.bfloat16) for _ in range(2)]
    e = [torch.randn(4, 32, 64, generator=generator).to(torch.bfloat16) for _ in range(2)]
    results = {}
    for saved in ("bf16", "fp8"):
        gemm = Fp8Gemm(recipe=recipe, saved_inputs=saved)
        x, rows = x0.clone().requires_grad_(), rows0.clone().requires_grad_()
        weights = [t.clone().requires_grad_() for t in (*w, *e)]

        def run(gemm=gemm, x=x, rows=rows, weights=weights):
            linear = gemm.linear(x, weights[0], None) * gemm.linear(x, weights[1], None)
            grouped = gemm.grouped_mm(rows, weights[2], offsets) * gemm.grouped_mm(rows, weights[3], offsets)
            return linear.float().square().sum() + grouped.float().square().sum()

        kept, loss = _kept_storages(run)
        loss.backward()
        results[saved] = kept, [t.grad for t in (x, rows, *weights)]
    (bf16_kept, bf16_grads), (fp8_kept, fp8_grads) = results["bf16"], results["fp8"]
    for want, got in zip(bf16_grads, fp8_grads, strict=True):
        assert torch.equal(want, got)
    # What bf16 keeps, but x and the rows in fp8 (one copy each, however many GEMMs read them) with their scales,
    # as plan prices them.
    x_rows, in_features = x0.numel() // x0.shape[-1], x0.shape[-1]
    want = Counter(bf16_kept.values())
    want -= Counter([(torch.bfloat16, 2 * x0.numel()), (torch.bfloat16, 2 * rows0.numel())])
    fp8 = torch.float8_e4m3fn
    want += Counter([(fp8, x0.numel()), (fp8, rows0.numel()),
                     (torch.float32, linear_scale_bytes(recipe, x_rows, in_features)),
                     (torch.float32, grouped_scale_bytes(recipe, *rows0.shape, experts=offsets.numel()))])
    assert Counter(fp8_kept.values()) == want

@pytest.mark.parametrize("recipe", RECIPES)
def test_a_kept_input_padded_for_a_real_kernel_is_the_padded_tensor_quantised(recipe):
    """CUDA's kernels take operands zero-padded to their multiples (layouts.padded): padding a kept fp8 input
    (scaling.padded_quantised) gives the bits of quantising the padded bf16 input, each role's blocks; and the
    real product (torch._scaled_mm, padded) of a kept operand equals that of the bf16 one bit for bit."""
    generator = torch.Generator().manual_seed(11)
    for role, shape in (("input", (70, 200)), ("weight", (130, 45)), ("grad", (33, 129))):
        x = (torch.randn(shape, generator=generator) * 4).to(torch.bfloat16)
        for multiples in ((16, 16), (16, 512), (16, 32)):
            want = quantise(padded(x, *multiples), recipe=recipe, role=role)
            got = padded_quantised(quantise(x, recipe=recipe, role=role), *multiples, recipe=recipe, role=role)
            assert (got.block_rows, got.block_cols) == (want.block_rows, want.block_cols)
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(got.scale, want.scale), (role, multiples)
    if recipe in ("tensorwise", "rowwise"):  # the CPU's _scaled_mm
        a = torch.randn(40, 200, generator=generator).to(torch.bfloat16)
        b = torch.randn(24, 200, generator=generator).to(torch.bfloat16)
        kept = quantise(b, recipe=recipe, role="input")
        for multiples in (None, (16, 32)):
            want = fp8_gemm._scaled_mm(a, b, recipe=recipe, roles=("grad", "input"), out_dtype=torch.bfloat16,
                                       multiples=multiples)
            got = fp8_gemm._scaled_mm(a, kept, recipe=recipe, roles=("grad", "input"), out_dtype=torch.bfloat16,
                                      multiples=multiples)
            assert torch.equal(got, want)


def test_a_recomputed_region_holds_no_fp8_copy():
    """Inside a checkpointed region the GEMMs' saves are dropped after forward; the shared-input cache holds only
    weak references, so no fp8 copy of the region's input outlives its forward (it would be memory that neither
    measure nor plan counts)."""
    gemm = Fp8Gemm(recipe="rowwise", saved_inputs="fp8")
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w1, w2 = (torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = recomputed(lambda t: gemm.linear(t, w1, None) + gemm.linear(t, w2, None), x)
    gc.collect()
    entry = fp8_gemm._KEPT.get(x)
    assert entry is not None and entry[3]() is None and entry[4]() is None  # data and scales: freed
    out.float().sum().backward()
    assert x.grad is not None and w1.grad is not None


# ------------------------------------------------------------------------------------ training, bit for bit

SHORT = ["train.seq_length=16", "train.global_batch_size=2", "train.micro_batch_size=2", "train.warmup_steps=1",
         "train.lr=1e-3", "train.eval_interval=null", "checkpoint.interval=null", "logging.interval=1",
         "train.precision=fp8"]
# deepseek-v3-tiny as a dense and a MoE layer: MLA, a dense MLP, shared and routed experts (no MTP); qwen3-moe-tiny
# as one layer: GQA's q, k and v reading one input, routed experts. One deepseek run under every selective policy
# whose region meets an fp8 GEMM (each re-runs its GEMMs from inputs kept in bf16), one qwen run under two.
DEEPSEEK = ("deepseek-v3-tiny", ["model.num_layers=2", "model.first_k_dense=1", "model.mtp_layers=0"])
QWEN = ("qwen3-moe-tiny", ["model.num_layers=1"])
TRAINED = {
    "tensorwise": (*DEEPSEEK, []),
    "rowwise": (*QWEN, ["parallel.recompute.modules=[moe_act,layernorm]"]),
    "blockwise": (*QWEN, []),
    "mxfp8": (*DEEPSEEK, ["parallel.recompute.modules=[mla_up_proj,mlp,shared_experts,moe_act,layernorm]"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_training_with_fp8_inputs_kept_equals_bf16_kept_bit_for_bit(recipe, tmp_path, no_process_group):
    """2 steps: every loss, every gradient of the first step, every parameter after the last, bit-equal."""
    name, shape, policy = TRAINED[recipe]
    runs = {saved: record_run(name, [*shape, *SHORT, f"train.fp8.recipe={recipe}", *policy,
                                     f"train.fp8.saved_inputs={saved}"],
                              world=1, run_dir=tmp_path / saved, steps=2) for saved in ("bf16", "fp8")}
    bf16, fp8 = runs["bf16"], runs["fp8"]
    assert sum(fp8["fp8_gemms"].values()) > 0 and fp8["fp8_gemms"] == bf16["fp8_gemms"]
    assert fp8["losses"] == bf16["losses"]
    for kind in ("grads", "state"):
        assert bf16[kind].keys() == fp8[kind].keys()
        for name_, value in bf16[kind].items():
            assert torch.equal(fp8[kind][name_], value), (kind, name_)


# ---------------------------------------------------------------------------------- plan = measure, exactly

# (model, tp, sp, policy, recipe, fp8 modules): each recipe, GQA and MLA, tensor parallelism with and without SP
# (column GEMMs under SP keep their bf16 shard), the policies whose regions start at an fp8 GEMM's input
# (mla_up_proj's latents, mlp's input) or end before one (moe_act, layernorm, core_attn), and an fp8 head
# (unchunked: the chunked loss's GEMMs are never fp8; at TP2 vocabulary-parallel, a column GEMM).
DEFAULT = "attention,mlp,shared_experts,experts"
TINY = [
    ("deepseek-v3-tiny", 1, False, "mla_up_proj+moe_act+layernorm", "mxfp8", DEFAULT),
    ("deepseek-v3-tiny", 2, False, "mla_up_proj+mlp", "blockwise", DEFAULT),
    ("deepseek-v3-tiny", 2, True, "moe_act+layernorm+core_attn", "rowwise", DEFAULT),
    ("deepseek-v3-tiny", 1, False, "shared_experts+mlp", "tensorwise", DEFAULT),
    ("qwen3-moe-tiny", 2, False, "full-uniform-1", "tensorwise", DEFAULT),
    ("qwen3-tiny", 2, False, "none", "mxfp8", "attention,mlp,head"),
]


def _plan_bytes(recipe) -> float:
    return sum(v for k, v in plan_json(estimate(as_fake_runs(recipe), GPU))["activation_bytes_per_layer"].items()
               if k != "other")


@pytest.mark.parametrize(("name", "tp", "sp", "policy", "recipe", "modules"), fast_sample(TINY, 6),
                         ids=[f"{n}-tp{t}{'sp' if s else ''}-{p}-{r}" for n, t, s, p, r, _ in TINY])
def test_plan_keeps_the_fp8_inputs_measure_counts(name, tp, sp, policy, recipe, modules, no_process_group):
    """Every layer's saved bytes (and every other figure) exactly as measured, with the fp8 inputs kept: fewer
    bytes than bf16 kept (plan, held to measure for bf16 by tests/test_plan_measure.py), but under full
    recompute (a layer keeps its bf16 input only)."""
    sets = ["train.precision=fp8", f"train.fp8.recipe={recipe}", f"train.fp8.modules=[{modules}]",
            "model.mtp_layers=0", "train.loss_chunk_tokens=0"]
    kept = tiny_recipe(name, tp, sp, policy, "bf16", *sets, "train.fp8.saved_inputs=fp8")
    assert plan_against_measure(kept, measure(kept, Target(fake=True)), tolerance=1e-9) == []
    bf16 = _plan_bytes(tiny_recipe(name, tp, sp, policy, "bf16", *sets, "train.fp8.saved_inputs=bf16"))
    assert _plan_bytes(kept) == bf16 if policy.startswith("full") else _plan_bytes(kept) < bf16


@pytest.mark.slow
def test_a_full_size_deepseek_v3_moe_layer_in_mxfp8_keeps_what_plan_says(no_process_group):
    """DeepSeek-V3's dense and first MoE layer at EP8 (TP1, the published row's) under the published selective
    recompute, MXFP8: exactly as planned; the MoE layer keeps what its fp8 GEMM inputs save less than with bf16
    inputs (1.82 -> 1.46 GB when written)."""
    overrides = [*NO_PIPELINE, "model.num_layers=2", "model.first_k_dense=1", "model.mtp_layers=0", "launch.nodes=1",
                 "launch.gpus_per_node=8", "parallel.ep=8", "train.global_batch_size=8", "train.micro_batch_size=1",
                 *recompute("mla_up_proj+moe_act+layernorm"), "train.precision=fp8", "train.fp8.recipe=mxfp8"]
    recipe = load_recipe("deepseek-v3", [*overrides, "train.fp8.saved_inputs=fp8"], check_files=False)
    report = measure(recipe, Target(fake=True))
    assert plan_against_measure(recipe, report, tolerance=1e-9) == []
    bf16 = load_recipe("deepseek-v3", [*overrides, "train.fp8.saved_inputs=bf16"], check_files=False)
    planned = plan_json(estimate(as_fake_runs(bf16), GPU))["activation_bytes_per_layer"]["1"]
    assert report["activation_bytes_per_layer"]["1"] < 0.85 * planned


def test_a_run_may_switch_what_its_fp8_gemms_keep_on_resume():
    """The same numbers bit for bit, so the run folder ignores the field (launch/rundir.py); the recipe does not."""
    from moe_train.launch.rundir import recipe_differences

    base = ["train.precision=fp8", "train.fp8.recipe=rowwise"]
    kept, plain = (load_recipe("qwen3-moe-tiny", [*base, f"train.fp8.saved_inputs={v}"]) for v in ("fp8", "bf16"))
    assert recipe_differences(plain, kept) == []
    assert recipe_differences(plain, load_recipe("qwen3-moe-tiny", ["train.precision=fp8"])) == ["train.fp8.recipe"]
