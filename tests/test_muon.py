"""Muon's maths (train/muon.py): Newton-Schulz against the SVD, one update written out by hand, the split of
parameters between Muon and AdamW, and the AdamW half equal to the AdamW optimizer bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from moe_train.config import load_recipe
from moe_train.config.loader import RecipeError
from moe_train.models import build_model
from moe_train.plan.muon_cost import newton_schulz_flops
from moe_train.train.muon import NS_COEFFICIENTS, Muon, muon_param_groups, newton_schulz
from moe_train.train.optimizer import build_optimizer


def _with_singular_values(rows: int, cols: int, values: torch.Tensor, *, seed: int) -> tuple[torch.Tensor, ...]:
    """U diag(values) V^T with random orthonormal U, V (float64): the matrix and its U V^T."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    return u @ torch.diag(values) @ v.T, u, v


def _scalar_iterate(value: torch.Tensor, steps: int) -> torch.Tensor:
    """What the iteration does to one singular value s: s <- a s + b s^3 + c s^5."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        value = a * value + b * value**3 + c * value**5
    return value


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (64, 64)])
@pytest.mark.parametrize("decades", [2, 4])
def test_newton_schulz_against_the_svd(shape: tuple[int, int], decades: int) -> None:
    """Newton-Schulz of U S V^T is U p(S / |S|_F) V^T, p the quintic iterated ns_steps times: the matrix's own
    singular vectors (off-diagonal of U^T X V at fp32 rounding) and each value the scalar iterate's. The known
    error of five steps: every normalised singular value >= 2e-3 lands in [0.68, 1.21] (the coefficients trade
    convergence to exactly 1 for speed), so with values over two decades X is within 0.32 of the SVD's U V^T in
    the spectral norm; over four, the smallest stay below the band, as the scalar map says."""
    rows, cols = shape
    values = torch.logspace(0, -decades, min(shape), dtype=torch.float64)
    matrix, u, v = _with_singular_values(rows, cols, values, seed=0)
    out = newton_schulz(matrix.float(), steps=5).double()
    assert out.shape == matrix.shape
    core = u.T @ out @ v
    diagonal = torch.diagonal(core)
    assert (core - torch.diag(diagonal)).abs().max() < 1e-5
    normalised = values / values.norm()
    torch.testing.assert_close(diagonal, _scalar_iterate(normalised, 5), rtol=1e-4, atol=1e-5)
    banded = normalised >= 2e-3
    assert diagonal[banded].min() > 0.68 and diagonal[banded].max() < 1.21
    left, _, right = torch.linalg.svd(matrix, full_matrices=False)
    distance = torch.linalg.matrix_norm(out - left @ right, ord=2)
    assert (distance < 0.32) == bool(banded.all()), distance


def test_newton_schulz_orthogonalises_each_expert_alone() -> None:
    """A stack [E, out, in] gives each expert's own Newton-Schulz, bit for bit."""
    stack = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(1))
    batched = newton_schulz(stack, steps=5)
    for e in range(3):
        assert torch.equal(batched[e], newton_schulz(stack[e], steps=5))


def test_newton_schulz_flops_count_the_wide_orientation() -> None:
    # X X^T: 2 m^2 n, G G: 2 m^3, P X: 2 m^2 n per step, m = min
    assert newton_schulz_flops(32, 96, steps=5) == 5 * (4 * 32 * 32 * 96 + 2 * 32**3)
    assert newton_schulz_flops(96, 32, steps=5) == newton_schulz_flops(32, 96, steps=5)


def _tiny(overrides: list[str]):
    return load_recipe("deepseek-v3-tiny", ["model.num_layers=2", "train.precision=fp32", *overrides])


def test_muon_takes_hidden_matrices_and_adamw_the_rest() -> None:
    recipe = _tiny(["train.optimizer=muon"])
    model = build_model(recipe.model, seed=1)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in g["params"]] for g in muon_param_groups(model, train=recipe.train))
    assert "layers.1.ffn.experts.gate_proj" in muon and "layers.1.ffn.shared_experts.down_proj.weight" in muon
    assert "layers.0.self_attn.q_b_proj.weight" in muon and "layers.0.ffn.up_proj.weight" in muon
    assert "mtp.0.block.self_attn.o_proj.weight" in muon
    assert sorted(decay) == [
        "embed_tokens.weight",
        "layers.1.ffn.router.weight",
        "lm_head.weight",
        "mtp.0.block.ffn.router.weight",
        "mtp.0.eh_proj.weight",
    ]
    assert all(model.get_parameter(n).ndim == 1 for n in no_decay) and "norm.weight" in no_decay
    assert len(muon) + len(decay) + len(no_decay) == len(names)
    # exclude names modules: the shared experts leave Muon, the router joins it
    recipe = _tiny(["train.optimizer=muon", 'train.muon.exclude=["embed_tokens","lm_head","shared_experts"]'])
    muon, decay, _ = ([names[id(p)] for p in g["params"]] for g in muon_param_groups(model, train=recipe.train))
    assert "layers.1.ffn.router.weight" in muon and "layers.1.ffn.shared_experts.up_proj.weight" in decay


def test_expert_bias_stacks_are_vectors_to_both_optimizers() -> None:
    """gpt-oss's routed experts carry [E, width] bias stacks: one vector an expert, so neither orthogonalised by
    Muon nor decayed by AdamW, although they have two dimensions."""
    recipe = load_recipe("gpt-oss-tiny", ["model.num_layers=2", "train.precision=fp32", "train.optimizer=muon",
                                          'model.layer_types=["sliding_attention","full_attention"]'])
    model = build_model(recipe.model, seed=1)
    names = {id(p): n for n, p in model.named_parameters()}
    stacks = [n for n, p in model.named_parameters() if n.endswith("_proj_bias") and p.ndim == 2]
    assert len(stacks) == 6  # gate, up and down of two layers
    muon, decay, no_decay = ([names[id(p)] for p in g["params"]] for g in muon_param_groups(model, train=recipe.train))
    assert set(stacks) <= set(no_decay) and not set(stacks) & set(muon + decay)
    assert "layers.0.ffn.experts.gate_proj" in muon
    from moe_train.train.optimizer import param_groups

    decayed, undecayed = ({names[id(p)] for p in g["params"]} for g in param_groups(model, weight_decay=0.1))
    assert set(stacks) <= undecayed and not set(stacks) & decayed


def test_one_update_written_out_by_hand() -> None:
    """Two steps on one [2, 3] matrix with ns_steps 1, nesterov, Moonlight's scale and decoupled decay, each
    term computed here from the definitions (not from train/muon.py)."""
    recipe = _tiny(
        [
            "train.optimizer=muon",
            "train.muon.ns_steps=1",
            "train.muon.momentum=0.9",
            "train.muon.weight_decay=0.5",
            "train.lr=0.1",
        ]
    )
    weight = torch.nn.Parameter(torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, 1.0]]))
    opt = Muon([{"params": [weight], "muon": True, "weight_decay": 0.5}], train=recipe.train)
    grads = [torch.tensor([[0.3, -0.1, 0.2], [0.4, 0.0, -0.5]]), torch.tensor([[-0.2, 0.1, 0.0], [0.1, 0.2, 0.3]])]
    want = weight.detach().clone()
    buffer = torch.zeros(2, 3)
    a, b, c = 3.4445, -4.7750, 2.0315
    for grad in grads:
        weight.grad = grad.clone()
        opt.step()
        buffer = 0.9 * buffer + grad
        update = grad + 0.9 * buffer  # nesterov
        x = update / (torch.sqrt((update**2).sum()) + 1e-7)  # wide: no transpose
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
        want = want * (1 - 0.1 * 0.5) - 0.1 * 0.2 * math.sqrt(3) * x
        torch.testing.assert_close(weight.detach(), want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[weight]["momentum_buffer"], buffer, rtol=1e-6, atol=1e-7)


def _small_model() -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(50, 16)
    model.proj = torch.nn.Linear(16, 24)
    model.norm = torch.nn.LayerNorm(24)
    return model


def test_adamw_half_equals_the_adamw_optimizer_bit_for_bit() -> None:
    """With every matrix excluded Muon is AdamW: the same parameters after three steps, bit for bit, in both
    moment dtypes."""
    for dtype in ("fp32", "bf16"):
        common = [f"train.adam_moment_dtype={dtype}", "train.lr=1e-2"]
        models, optims = [], []
        for overrides in (common, [*common, "train.optimizer=muon", 'train.muon.exclude=["embed_tokens","proj"]']):
            model = _small_model()
            models.append(model)
            optims.append(build_optimizer(model, train=_tiny(overrides).train))
        assert isinstance(optims[1], Muon) and not optims[1].param_groups[0]["params"]
        for step in range(3):
            for model in models:
                for i, p in enumerate(model.parameters()):
                    p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (i + 1) + step).view_as(p)
            for opt in optims:
                opt.step()
        for (name, want), got in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
            assert torch.equal(want, got), (dtype, name)


def test_muon_fields_are_checked() -> None:
    with pytest.raises(RecipeError, match="train.muon.momentum"):
        _tiny(["train.optimizer=muon", "train.muon.momentum=1.5"])
    with pytest.raises(RecipeError, match="train.optimizer"):
        _tiny(["train.optimizer=sgd"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny"])
def test_plan_counts_muon_state_and_flops_as_measured(name: str, no_process_group) -> None:
    """plan's optimizer bytes and FLOPs under train.optimizer muon equal measure's (a real step at world size 1).
    Bytes: one momentum buffer per Muon element, two moments per AdamW one, fp32 and bf16 moments, less AdamW's
    4-byte step scalars (which plan leaves out, as it does for AdamW alone). FLOPs: flops.optimizer, the
    Newton-Schulz products the FLOP counter saw in the update, equal to ns_steps x the products of each Muon
    matrix (each expert of a stack alone, in the wide orientation) and to plan's, at 5 and 3 steps; the model's
    own phases and total unchanged by them."""
    from helpers import shrink

    from moe_train.config.hardware import HARDWARE
    from moe_train.measure.driver import Target, measure
    from moe_train.plan.estimate import estimate, plan_json

    for dtype, steps in (("fp32", 5), ("bf16", 3)):
        overrides = shrink(
            "model.num_layers=2",
            "train.global_batch_size=2",
            "train.steps=2",
            "train.precision=fp32",
            "train.optimizer=muon",
            f"train.muon.ns_steps={steps}",
            f"train.adam_moment_dtype={dtype}",
            without=("train.precision",),
        )
        if name == "deepseek-v3-tiny":
            overrides = [*overrides, "model.first_k_dense=1"]
        if name == "gpt-oss-tiny":
            overrides = [*overrides, 'model.layer_types=["sliding_attention","full_attention"]']
        recipe = load_recipe(name, overrides)
        report = measure(recipe, Target())
        planned = plan_json(estimate(recipe, HARDWARE["h100"]))
        model = build_model(recipe.model)
        muon, *adamw = muon_param_groups(model, train=recipe.train)
        adamw_tensors = sum(len(group["params"]) for group in adamw)
        moment = 4 if dtype == "fp32" else 2
        muon_elements = sum(p.numel() for p in muon["params"])
        adamw_elements = sum(p.numel() for group in adamw for p in group["params"])
        assert muon_elements > 0 and adamw_elements > 0
        assert report["optimizer_bytes"] == moment * (muon_elements + 2 * adamw_elements) + 4 * adamw_tensors
        assert planned["memory_bytes"]["optimizer"] == report["optimizer_bytes"] - 4 * adamw_tensors, (name, dtype)

        by_matrix = sum((p.shape[0] if p.ndim == 3 else 1) * newton_schulz_flops(*p.shape[-2:], steps=steps)
                        for p in muon["params"])
        assert report["flops"]["optimizer"] == by_matrix > 0
        assert planned["flops"] == report["flops"], (name, steps)
        assert report["flops"]["total"] == sum(report["flops"][k] for k in ("forward", "backward", "recompute"))


# (id, recipe, tp, overrides): FSDP2 alone, FSDP2 x TP+SP (column weights gathered over dp then tp, row weights
# tp then dp), EP2 x ETP2 folded onto dp2 x tp2, MLA under dp2 x tp2, and dp3 (FSDP2's padded uneven chunks)
SHARDED = [
    ("dp2", "qwen3-moe-tiny", 1, ["launch.gpus_per_node=2", "train.global_batch_size=4"]),
    ("dp2-tp2-sp", "qwen3-moe-tiny", 2, ["launch.gpus_per_node=4", "train.global_batch_size=4",
                                         "parallel.sequence_parallel=true"]),
    ("ep2-etp2", "qwen3-moe-tiny", 2, ["launch.gpus_per_node=4", "train.global_batch_size=4", "parallel.ep=2",
                                       "parallel.etp=2", "model.moe.dispatcher=allgather"]),
    ("mla-dp2-tp2", "deepseek-v3-tiny", 2, ["launch.gpus_per_node=4", "train.global_batch_size=4"]),
    ("mla-dp3", "deepseek-v3-tiny", 1, ["launch.gpus_per_node=3", "train.global_batch_size=6"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "name", "tp", "overrides"), SHARDED, ids=[case[0] for case in SHARDED])
def test_plan_prices_muon_gathers_as_measured(case: str, name: str, tp: int, overrides: list[str],
                                              no_process_group) -> None:
    """Each sharded Muon update gathered whole (train/muon.py): plan's bytes per `<group>/<op>` (and every other
    figure) equal measure's on fake ranks, exactly. At dp2 the gathers add to AdamW's step what a hand count
    says: each rank sends its half of every Muon matrix, in fp32."""
    from helpers import plan_against_measure, tiny_recipe

    from moe_train.measure.driver import Target, measure

    recipes = {optimizer: tiny_recipe(name, tp, False, "none", "fp32", f"train.optimizer={optimizer}", *overrides)
               for optimizer in ("adamw", "muon")}
    reports = {optimizer: measure(recipe, Target(fake=True)) for optimizer, recipe in recipes.items()}
    assert plan_against_measure(recipes["muon"], reports["muon"], tolerance=1e-9) == []
    gathered = {key: reports["muon"]["comm_bytes"][key] - reports["adamw"]["comm_bytes"].get(key, 0)
                for key in reports["muon"]["comm_bytes"] if key.endswith("/all_gather")}
    assert sum(gathered.values()) > 0
    if case == "dp2":
        muon, *_ = muon_param_groups(build_model(recipes["muon"].model), train=recipes["muon"].train)
        assert gathered == {"dp/all_gather": 4 * sum(p.numel() for p in muon["params"]) // 2}
