"""The MoE layer: routing by hand and against transformers, grouped experts, capacity, losses, bias update."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from host_reads import HostReads

from moe_train.config.routing_shapes import expert_capacity
from moe_train.config.schema import MoEConfig
from moe_train.kernels import KERNELS
from moe_train.models.moe import (
    MoELayer,
    global_aux_loss,
    seq_aux_loss,
    update_expert_bias,
    z_loss,
)
from moe_train.models.moe.capacity import capacity_keep_mask
from moe_train.models.moe.experts import GroupedExperts, expert_kernel, grouped_mm_supported
from moe_train.models.moe.router import count_per_expert

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: extra threads only spin-wait when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def moe_config(**fields) -> MoEConfig:
    router = fields.pop("router", {})
    base = {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 32}
    return MoEConfig.model_validate({**base, **fields, "router": router})


def make_layer(hidden_size: int, moe: MoEConfig, seed: int = 0, std: float = 0.5) -> MoELayer:
    """A layer built on meta, materialised and filled with random weights (the model's init does this by name)."""
    with torch.device("meta"):
        layer = MoELayer(hidden_size=hidden_size, cfg=moe)
    layer.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in layer.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.zero_()
    layer.reset_telemetry()  # to_empty leaves buffers uninitialised
    return layer


def routed(layer: MoELayer, x: torch.Tensor):
    """The routing the layer's forward computes for x (the router is deterministic): indices, weights, scores."""
    return layer.router(x.reshape(-1, x.shape[-1]))


def dropped_fraction(layer: MoELayer) -> float:
    """The layer's telemetry since its last reset: the share of token->expert assignments dropped."""
    return layer.dropped_assignments.item() / layer.assignments.item()


def set_router_logits(layer: MoELayer, logits: torch.Tensor) -> torch.Tensor:
    """Make the router produce `logits` [T, E] exactly: inputs are one-hot rows, weight = logits^T (H = T)."""
    with torch.no_grad():
        layer.router.weight.copy_(logits.t())
    return torch.eye(logits.shape[0])


# --------------------------------------------------------------------------------------------------- router


def test_softmax_router_by_hand():
    moe = moe_config(num_experts=4, top_k=2, router={"score_function": "softmax", "normalize_topk": True})
    layer = make_layer(4, moe)
    x = set_router_logits(layer, torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 4)))
    routing = layer.router(x)
    assert torch.allclose(routing.scores[0], torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert routing.topk_indices[0].tolist() == [3, 2]
    assert torch.allclose(routing.topk_weights[0], torch.tensor([4 / 7, 3 / 7]))

    unnormalised = make_layer(4, moe_config(num_experts=4, top_k=2, router={"normalize_topk": False}))
    x = set_router_logits(unnormalised, torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 4)))
    assert torch.allclose(unnormalised.router(x).topk_weights[0], torch.tensor([0.4, 0.3]))


def sigmoid_logits(scores: list[float]) -> torch.Tensor:
    s = torch.tensor(scores, dtype=torch.float64)
    return torch.log(s / (1 - s)).float()


@pytest.mark.parametrize("grouped", [False, True])
def test_sigmoid_router_bias_selects_only_and_groups_limit(grouped: bool):
    # scores s = [0.9, 0.3, 0.6, 0.5], bias [0, 0, 0.35, 0.2] -> choice [0.9, 0.3, 0.95, 0.7].
    # Ungrouped: top-2 of the choice = {2, 0}. Two groups of 2, keep 1 group: group sums of top-2 choices are
    # 1.2 and 1.65 -> group {2, 3}. Weights always come from the unbiased s, normalised, times 2.0.
    router = {
        "score_function": "sigmoid",
        "expert_bias": True,
        "topk_scaling_factor": 2.0,
        **({"num_groups": 2, "group_top_k": 1} if grouped else {}),
    }
    layer = make_layer(4, moe_config(num_experts=4, top_k=2, router=router))
    x = set_router_logits(layer, sigmoid_logits([0.9, 0.3, 0.6, 0.5]).expand(4, 4))
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.35, 0.2]))
    routing = layer.router(x)
    s = torch.tensor([0.9, 0.3, 0.6, 0.5])
    expected = [2, 3] if grouped else [2, 0]
    assert sorted(routing.topk_indices[0].tolist()) == sorted(expected)
    chosen = s[routing.topk_indices[0]]
    assert torch.allclose(routing.topk_weights[0], chosen / chosen.sum() * 2.0)
    assert torch.allclose(routing.scores[0], s)


def test_bad_group_settings_are_refused():
    with pytest.raises(ValueError, match="group_top_k"):
        MoELayer(hidden_size=8, cfg=moe_config(num_experts=8, top_k=8, router={"num_groups": 4, "group_top_k": 2}))
    with pytest.raises(ValueError, match="num_groups"):
        MoELayer(hidden_size=8, cfg=moe_config(num_experts=8, top_k=2, router={"num_groups": 3, "group_top_k": 1}))


# --------------------------------------------------------------------------------------- against transformers


def fused_gate_up(experts: GroupedExperts) -> torch.Tensor:
    """transformers' in-memory expert layout: gate rows, then up rows, in one [E, 2I, H] tensor."""
    return torch.cat((experts.gate_proj, experts.up_proj), dim=1)


def qwen3_block(layer: MoELayer, moe: MoEConfig, hidden_size: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=hidden_size,
        moe_intermediate_size=moe.ffn_hidden_size,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.router.normalize_topk,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    block.load_state_dict(
        {
            "gate.weight": layer.router.weight,
            "experts.gate_up_proj": fused_gate_up(layer.experts),
            "experts.down_proj": layer.experts.down_proj,
        }
    )
    return block


def deepseek_block(layer: MoELayer, moe: MoEConfig, hidden_size: int):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=hidden_size,
        moe_intermediate_size=moe.ffn_hidden_size,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        n_shared_experts=moe.shared_expert_ffn_hidden_size // moe.ffn_hidden_size,
        n_group=moe.router.num_groups,
        topk_group=moe.router.group_top_k,
        routed_scaling_factor=moe.router.topk_scaling_factor,
        norm_topk_prob=moe.router.normalize_topk,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    block = DeepseekV3MoE(config)
    state = {
        "gate.weight": layer.router.weight,
        "gate.e_score_correction_bias": layer.router.expert_bias,
        "experts.gate_up_proj": fused_gate_up(layer.experts),
        "experts.down_proj": layer.experts.down_proj,
    }
    state.update({f"shared_experts.{k}": v for k, v in layer.shared_experts.state_dict().items()})
    block.load_state_dict(state)
    return block


@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_qwen3_moe_block_matches_transformers(use_grouped_mm: bool, normalize: bool):
    moe = moe_config(num_experts=8, top_k=2, ffn_hidden_size=32, router={"normalize_topk": normalize})
    layer = make_layer(64, moe, seed=1, std=0.2)
    layer.experts.use_grouped_mm = use_grouped_mm
    block = qwen3_block(layer, moe, 64)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    expected = block(x)
    _, hf_weights, hf_indices = block.gate(x.view(-1, 64))
    out = layer(x)
    routing = routed(layer, x)
    assert torch.equal(routing.topk_indices, hf_indices)
    assert torch.allclose(routing.topk_weights, hf_weights, atol=1e-6)
    assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (8, 3)])
def test_deepseek_v3_moe_block_matches_transformers(groups: tuple[int, int]):
    num_groups, group_top_k = groups
    moe = moe_config(
        num_experts=16,
        top_k=4,
        ffn_hidden_size=32,
        shared_expert_ffn_hidden_size=32,
        router={
            "score_function": "sigmoid",
            "num_groups": num_groups,
            "group_top_k": group_top_k,
            "topk_scaling_factor": 2.5,
            "expert_bias": True,
            "load_balancing": "seq_aux_loss",
            "aux_loss_coeff": 1e-4,
        },
    )
    layer = make_layer(64, moe, seed=3, std=0.2)
    with torch.no_grad():  # a non-zero bias that changes choices
        layer.router.expert_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(4)) * 0.1)
    block = deepseek_block(layer, moe, 64)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5))
    expected = block(x)
    _, hf_weights, hf_indices = block.gate(x)
    out = layer(x)
    routing = routed(layer, x)
    ours = routing.topk_indices.sort(dim=-1)
    theirs = hf_indices.sort(dim=-1)
    assert torch.equal(ours.values, theirs.values)
    assert torch.allclose(routing.topk_weights.gather(1, ours.indices), hf_weights.gather(1, theirs.indices))
    assert (out - expected).abs().max().item() < 1e-5


def test_global_aux_loss_over_all_layers_equals_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    generator = torch.Generator().manual_seed(6)
    moe = moe_config(num_experts=8, top_k=2)
    layers = [make_layer(32, moe, seed=s, std=0.2) for s in range(3)]
    logits, probs, indices = [], [], []
    for layer in layers:
        routing = routed(layer, torch.randn(2, 10, 32, generator=generator))
        logits.append(routing.logits)
        probs.append(routing.scores)
        indices.append(routing.topk_indices)
    expected = load_balancing_loss_func(tuple(logits), num_experts=8, top_k=2)
    rows = torch.cat(probs).shape[0]
    ours = global_aux_loss(torch.cat(probs), count_per_expert(torch.cat(indices), 8), rows)
    assert abs(ours.item() - expected.item()) < 1e-6
    ours.backward()  # the gradient reaches every layer's router through the probabilities
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in layers)


# ---------------------------------------------------------------------------------------------- aux losses


def test_global_aux_loss_by_hand():
    # T=2, E=2, K=1: both tokens to expert 0. f = [1, 0], P = [0.7, 0.3] -> 2 * 0.7 = 1.4.
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    assert math.isclose(global_aux_loss(probs, torch.tensor([2, 0]), 2).item(), 1.4, rel_tol=1e-6)
    # Counted over a larger set (4 tokens, loads [1, 3]): f = [0.25, 0.75] -> 2 * (0.175 + 0.225) = 0.8.
    assert math.isclose(global_aux_loss(probs, torch.tensor([1, 3]), 4).item(), 0.8, rel_tol=1e-6)


def test_seq_aux_loss_by_hand():
    # One sequence, T=2, E=2, K=1. Scores [0.6, 0.2] and [0.5, 0.5]; both tokens pick expert 0.
    # f = E/(K T) * counts = [2, 0]; P = mean of normalised scores = [(0.75 + 0.5)/2, .] = [0.625, .]; loss 1.25.
    # Second sequence balanced: picks 0 then 1: f = [1, 1]; scores [0.2, 0.2], [0.9, 0.1] -> P = [0.7, 0.3]; 1.0.
    scores = torch.tensor([[[0.6, 0.2], [0.5, 0.5]], [[0.2, 0.2], [0.9, 0.1]]])
    indices = torch.tensor([[[0], [0]], [[0], [1]]])
    assert math.isclose(seq_aux_loss(scores, indices, top_k=1).item(), (1.25 + 1.0) / 2, rel_tol=1e-6)
    # Perfect balance gives exactly 1 whatever E and K.
    uniform = torch.full((1, 4, 4), 0.3)
    assert math.isclose(seq_aux_loss(uniform, torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]]), top_k=2).item(), 1.0)


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert math.isclose(z_loss(logits).item(), expected, rel_tol=1e-6)


def test_layer_aux_loss_is_seq_aux_plus_z_loss():
    moe = moe_config(
        num_experts=8,
        top_k=2,
        router={
            "score_function": "sigmoid",
            "load_balancing": "seq_aux_loss",
            "aux_loss_coeff": 0.1,
            "z_loss_coeff": 0.01,
        },
    )
    layer = make_layer(32, moe)
    x = torch.randn(3, 5, 32)
    layer(x)
    routing = routed(layer, x)
    expected = 0.1 * seq_aux_loss(
        routing.scores.view(3, 5, 8), routing.topk_indices.view(3, 5, 2), top_k=2
    ) + 0.01 * z_loss(routing.logits)
    assert layer.aux_loss_value.item() > 0
    assert math.isclose(layer.aux_loss_value.item(), expected.item(), rel_tol=1e-6)


# ------------------------------------------------------------------------------------------------ gradients


def test_gradients_reach_router_through_weights_and_aux_loss_never_the_bias():
    moe = moe_config(
        num_experts=8,
        top_k=2,
        router={
            "score_function": "sigmoid",
            "expert_bias": True,
            "load_balancing": "seq_aux_loss",
            "aux_loss_coeff": 1.0,
        },
    )
    layer = make_layer(32, moe)
    x = torch.randn(2, 6, 32)
    out = layer(x)
    (grad_out,) = torch.autograd.grad(out.sum(), [layer.router.weight], retain_graph=True)
    assert grad_out.abs().sum() > 0
    (grad_aux,) = torch.autograd.grad((out * 0).sum(), [layer.router.weight])  # the attached loss alone
    assert grad_aux.abs().sum() > 0
    assert not layer.router.expert_bias.requires_grad
    layer(x).sum().backward()
    assert layer.router.expert_bias.grad is None
    assert "router.expert_bias" in layer.state_dict()


# ------------------------------------------------------------------------------------------ grouped experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_loop(dtype: torch.dtype):
    assert grouped_mm_supported(dtype, torch.device("cpu"), hidden_size=64, ffn_hidden_size=32)
    experts = GroupedExperts(num_experts=4, hidden_size=64, ffn_hidden_size=32).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    counts = torch.tensor([5, 0, 17, 3])  # an empty expert included
    rows = torch.randn(25, 64, dtype=dtype)
    probs = torch.rand(25)  # fp32, as the router makes them
    results = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        experts.zero_grad()
        x = rows.clone().requires_grad_()
        out = experts(x, counts, probs=probs)
        out.sum().backward()  # a stride-0 incoming gradient must not reach _grouped_mm's backward
        results.append((out.float(), x.grad.float(), *(p.grad.float() for p in experts.parameters())))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=tol, atol=tol * a.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_without_rows_give_zero_gradients(dtype: torch.dtype):
    """An expert-parallel rank that receives no tokens still gets a (zero) gradient for every expert weight."""
    experts = GroupedExperts(num_experts=2, hidden_size=64, ffn_hidden_size=32).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    x = torch.zeros(0, 64, dtype=dtype, requires_grad=True)
    out = experts(x, torch.zeros(2, dtype=torch.int64), probs=torch.zeros(0))
    out.sum().backward()
    assert out.shape == (0, 64)
    assert all(p.grad is not None and not p.grad.any() for p in experts.parameters())


def test_padded_batched_gemm_equals_the_loop():
    """The fallback below Hopper, run on the CPU: each expert's rows padded to the capacity, three batched GEMMs;
    ragged and empty counts give the loop's outputs and gradients (fp64), with no device read; an expert with more
    rows than the capacity raises instead of writing into the next expert's block."""
    experts = GroupedExperts(num_experts=4, hidden_size=24, ffn_hidden_size=12).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * 0.3)
    for counts in ([5, 0, 7, 3], [0, 0, 0, 0], [0, 9, 0, 0], [9, 9, 9, 9]):
        counts = torch.tensor(counts)
        rows = torch.randn(int(counts.sum()), 24, dtype=torch.float64)
        cotangent = torch.randn_like(rows)
        probs = torch.rand(int(counts.sum()), 1, dtype=torch.float64)
        results = []
        for path in ("padded", "loop"):
            experts.zero_grad()
            x = rows.clone().requires_grad_()
            reads = HostReads()
            with reads.counting():
                out = experts._padded(x, counts, probs, 9) if path == "padded" else experts._loop(x, counts, probs)
            if path == "padded":
                assert reads.total() == 0, dict(reads.by_line)
            (out * cotangent).sum().backward()
            results.append((out, x.grad, *(p.grad for p in experts.parameters())))
        for a, b in zip(*results, strict=True):
            assert torch.allclose(a, b, atol=1e-12), counts
    with pytest.raises((IndexError, RuntimeError)):
        experts._padded(torch.randn(10, 24, dtype=torch.float64), torch.tensor([10, 0, 0, 0]),
                        torch.ones(10, 1, dtype=torch.float64), 9)


def test_expert_kernel_per_device_names_why_it_falls_back(monkeypatch: pytest.MonkeyPatch):
    """torch._grouped_mm on Hopper in bf16 with 16-byte strides; below, or in another dtype, or misaligned, the
    cuda row's padded batched GEMM, with the reason; the CPU's fallback is the loop."""
    cuda = torch.device("cuda")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    aligned = {"hidden_size": 2048, "ffn_hidden_size": 768}
    hopper = ("grouped_mm", "torch._grouped_mm (compute capability 9.0)")
    assert expert_kernel(torch.bfloat16, cuda, **aligned) == hopper
    kernel, why = expert_kernel(torch.float32, cuda, **aligned)
    assert kernel == "padded_bmm" and why == "torch._grouped_mm on CUDA takes bfloat16, not torch.float32"
    kernel, why = expert_kernel(torch.bfloat16, cuda, hidden_size=2044, ffn_hidden_size=768)
    assert kernel == "padded_bmm" and "hidden_size 2044 x 2 bytes" in why and "16 bytes" in why
    capability[0] = (8, 0)
    kernel, why = expert_kernel(torch.bfloat16, cuda, **aligned)
    assert kernel == "padded_bmm" and why.startswith("compute capability 8.0 is below 9.0")
    kernel, why = expert_kernel(torch.float64, torch.device("cpu"), **aligned)
    assert kernel == "loop" and "not torch.float64" in why


def test_capacity_layer_runs_the_padded_gemm_without_the_loops_read(monkeypatch: pytest.MonkeyPatch):
    """A layer with a capacity and the padded fallback (the cpu row switched to it; fp64, which the grouped GEMM
    does not take): the loop's outputs and gradients, and one device read fewer per forward (only the
    dispatch's kept count stays)."""
    monkeypatch.setitem(KERNELS, "cpu", dataclasses.replace(KERNELS["cpu"], experts_fallback="padded_bmm"))
    layer = make_layer(32, moe_config(num_experts=4, top_k=2, capacity_factor=1.0), std=0.3).double()
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    results, read_counts = [], []
    for grouped in (True, False):  # use_grouped_mm False forces the loop
        layer.experts.use_grouped_mm = grouped
        layer.zero_grad()
        inputs = x.clone().requires_grad_()
        reads = HostReads()
        with reads.counting():
            out = layer(inputs)
        read_counts.append(reads.total(under="models/"))
        out.square().sum().backward()
        results.append((out, inputs.grad, *(p.grad for p in layer.parameters() if p.grad is not None)))
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    assert read_counts == [1, 2]


def _shared_layer_outputs(layer: MoELayer, x: torch.Tensor, *, today: bool) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient of one forward and backward; `today`: the shared
    experts added after the routed ones, computed after the combine (the order before the overlap)."""
    layer.zero_grad()
    inputs = x.clone().requires_grad_()
    if today:
        shared, layer.shared_experts = layer.shared_experts, None
        try:
            out = layer(inputs)
        finally:
            layer.shared_experts = shared
        out = out + shared(inputs.reshape(-1, inputs.shape[-1])).view_as(out)
    else:
        out = layer(inputs)
    out.square().sum().backward()
    return [out, inputs.grad, *(p.grad for p in layer.parameters())]


def test_shared_experts_start_before_the_dispatch_and_change_no_number():
    """The shared experts run before the routed experts' dispatch (on CUDA on a side stream, overlapping its
    all-to-all; on the CPU in the same order, on the one stream): the output and every parameter gradient equal,
    bit for bit, to adding them after the combine; the input's gradient sums the same three terms (shared
    experts, dispatch, router) in another order, so it equals to rounding."""
    layer = make_layer(32, moe_config(num_experts=4, top_k=2, shared_expert_ffn_hidden_size=16), std=0.3)
    x = torch.randn(2, 8, 32)
    order = []
    layer.shared_experts.register_forward_hook(lambda *_: order.append("shared"))
    dispatch = layer.dispatcher.dispatch
    layer.dispatcher.dispatch = lambda *a, **k: (order.append("dispatch"), dispatch(*a, **k))[1]
    overlapped = _shared_layer_outputs(layer, x, today=False)
    assert order == ["shared", "dispatch"]
    (out, grad_input, *grads), (out_today, grad_input_today, *grads_today) = (
        overlapped, _shared_layer_outputs(layer, x, today=True))
    assert torch.equal(out, out_today)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_today, strict=True))
    assert torch.allclose(grad_input, grad_input_today, rtol=1e-6, atol=1e-6 * grad_input.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the shared experts' side stream")
def test_shared_experts_on_the_side_stream_equal_the_one_stream(monkeypatch: pytest.MonkeyPatch):
    layer = make_layer(256, moe_config(num_experts=8, top_k=2, ffn_hidden_size=128,
                                       shared_expert_ffn_hidden_size=512), std=0.05).cuda()
    x = torch.randn(4, 512, 256, device="cuda")
    one_stream = _shared_layer_outputs(layer, x, today=False)
    monkeypatch.setattr(MoELayer, "_overlaps_shared_experts", lambda self, x: True)
    side = _shared_layer_outputs(layer, x, today=False)
    torch.cuda.synchronize()
    for a, b in zip(one_stream, side, strict=True):
        assert torch.equal(a, b)


def test_grouped_mm_refuses_unaligned_shapes():
    assert not grouped_mm_supported(torch.bfloat16, torch.device("cpu"), hidden_size=60, ffn_hidden_size=32)
    assert not grouped_mm_supported(torch.float32, torch.device("cpu"), hidden_size=64, ffn_hidden_size=30)
    assert not grouped_mm_supported(torch.float64, torch.device("cpu"), hidden_size=64, ffn_hidden_size=32)
    # Unaligned experts still run (through the loop) and agree with a per-token reference.
    moe = moe_config(num_experts=4, top_k=2, ffn_hidden_size=30)
    layer = make_layer(60, moe, std=0.2)
    x = torch.randn(1, 7, 60)
    assert torch.allclose(layer(x), reference_moe(layer, x), atol=1e-5)


def reference_moe(layer: MoELayer, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: sum over kept assignments of weight * SwiGLU_e(x)."""
    stats = routed(layer, x)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    experts = layer.experts
    for t in range(flat.shape[0]):
        for slot in range(stats.topk_indices.shape[1]):
            if keep is not None and not keep[t, slot]:
                continue
            e = stats.topk_indices[t, slot]
            gate, up = experts.gate_proj[e] @ flat[t], experts.up_proj[e] @ flat[t]
            out[t] += stats.topk_weights[t, slot] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out.view_as(x)


# ------------------------------------------------------------------------------------------------- capacity


def test_expert_capacity():
    assert expert_capacity(num_tokens=10, top_k=2, num_experts=4, capacity_factor=1.0) == 5
    assert expert_capacity(num_tokens=10, top_k=2, num_experts=4, capacity_factor=1.1) == 6
    assert expert_capacity(num_tokens=3, top_k=1, num_experts=4, capacity_factor=1.0) == 1


def test_drop_policies_by_hand():
    # 4 tokens, 3 experts, K=1, capacity 2. Expert 0 is wanted by tokens 0, 1, 3 with weights 0.5, 0.9, 0.7.
    indices = torch.tensor([[0], [0], [1], [0]])
    weights = torch.tensor([[0.5], [0.9], [1.0], [0.7]])
    probs = capacity_keep_mask(indices, weights, num_experts=3, capacity=2, policy="probs")
    assert probs.view(-1).tolist() == [False, True, True, True]
    position = capacity_keep_mask(indices, weights, num_experts=3, capacity=2, policy="position")
    assert position.view(-1).tolist() == [True, True, True, False]
    # K=2: a token's two assignments compete in different experts independently.
    indices = torch.tensor([[0, 1], [1, 0], [1, 2]])
    weights = torch.tensor([[0.6, 0.4], [0.8, 0.2], [0.5, 0.5]])
    probs = capacity_keep_mask(indices, weights, num_experts=3, capacity=1, policy="probs")
    assert probs.tolist() == [[True, False], [True, False], [False, True]]
    position = capacity_keep_mask(indices, weights, num_experts=3, capacity=1, policy="position")
    assert position.tolist() == [[True, True], [False, False], [False, True]]


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_layer_drops_and_reports(policy: str, pad: bool):
    moe = moe_config(num_experts=4, top_k=2, capacity_factor=0.5, drop_policy=policy, pad_to_capacity=pad)
    layer = make_layer(32, moe, std=0.3)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(7))
    out = layer(x)
    stats = routed(layer, x)
    assert expert_capacity(num_tokens=16, top_k=2, num_experts=4, capacity_factor=0.5) == 4
    keep = capacity_keep_mask(stats.topk_indices, stats.topk_weights, num_experts=4, capacity=4, policy=policy)
    kept_per_expert = torch.bincount(stats.topk_indices[keep], minlength=4)
    assert kept_per_expert.max() <= 4
    assert math.isclose(dropped_fraction(layer), 1 - keep.sum().item() / 32)
    assert dropped_fraction(layer) >= 0.5  # at most 16 of the 32 assignments fit
    assert torch.allclose(out, reference_moe(layer, x, keep), atol=1e-5)
    assert layer.tokens_per_expert.sum().item() == 32  # loads are counted before drops


def test_dropless_by_default():
    layer = make_layer(32, moe_config(num_experts=4, top_k=2), std=0.3)
    x = torch.randn(2, 8, 32)
    out = layer(x)
    assert dropped_fraction(layer) == 0.0
    assert torch.allclose(out, reference_moe(layer, x), atol=1e-5)


# ----------------------------------------------------------------------------------------------- bias update


def test_update_expert_bias_by_hand():
    bias = torch.tensor([0.0, 0.5, -0.2, 0.1])
    loads = torch.tensor([10, 2, 4, 4])  # mean 5: expert 0 overloaded, the others underloaded
    update_expert_bias(bias, loads, rate=0.01)
    assert torch.allclose(bias, torch.tensor([-0.01, 0.51, -0.19, 0.11]))
    update_expert_bias(bias, torch.tensor([3, 3, 3, 3]), rate=0.01)  # balanced: unchanged
    assert torch.allclose(bias, torch.tensor([-0.01, 0.51, -0.19, 0.11]))


def test_bias_update_moves_selection_towards_balance():
    moe = moe_config(num_experts=8, top_k=2, router={"score_function": "sigmoid", "expert_bias": True})
    layer = make_layer(32, moe, std=0.3)
    x = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(8))
    first = count_per_expert(routed(layer, x).topk_indices, 8).float()
    for _ in range(200):
        update_expert_bias(layer.router.expert_bias, count_per_expert(routed(layer, x).topk_indices, 8), rate=0.01)
    last = count_per_expert(routed(layer, x).topk_indices, 8).float()
    assert last.max() / last.mean() < first.max() / first.mean()


# ----------------------------------------------------------------------------------------------- meta device


def test_meta_construction_and_checkpoint_names():
    moe = moe_config(
        num_experts=16,
        top_k=4,
        ffn_hidden_size=48,
        shared_expert_ffn_hidden_size=96,
        router={"score_function": "sigmoid", "expert_bias": True},
    )
    with torch.device("meta"):
        layer = MoELayer(hidden_size=128, cfg=moe)
    assert all(t.is_meta for t in layer.state_dict().values())
    shapes = {name: tuple(t.shape) for name, t in layer.state_dict().items()}
    assert shapes == {
        "router.weight": (16, 128),
        "router.expert_bias": (16,),
        "experts.gate_proj": (16, 48, 128),
        "experts.up_proj": (16, 48, 128),
        "experts.down_proj": (16, 128, 48),
        "shared_experts.gate_proj.weight": (96, 128),
        "shared_experts.up_proj.weight": (96, 128),
        "shared_experts.down_proj.weight": (128, 96),
    }
    assert layer.router.expert_bias.dtype == torch.float32
    layer.to_empty(device="cpu")
    assert not any(t.is_meta for t in layer.state_dict().values())
    plain = MoELayer(hidden_size=128, cfg=moe_config())
    assert set(plain.state_dict()) == {
        "router.weight", "experts.gate_proj", "experts.up_proj", "experts.down_proj"
    }


def test_bf16_layer_grouped_equals_loop_and_tracks_fp32():
    moe = moe_config(num_experts=8, top_k=2, ffn_hidden_size=32, shared_expert_ffn_hidden_size=32)
    reference = make_layer(64, moe, std=0.2)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(9))
    expected = reference(x)
    layer = make_layer(64, moe, std=0.2).to(torch.bfloat16)
    outputs = {}
    for grouped in (True, False):
        layer.experts.use_grouped_mm = grouped
        outputs[grouped] = layer(x.to(torch.bfloat16))
        assert outputs[grouped].dtype == torch.bfloat16
        assert routed(layer, x.to(torch.bfloat16)).scores.dtype == torch.float32  # router math stays fp32
    assert torch.allclose(outputs[True].float(), outputs[False].float(), atol=2e-2 * expected.abs().max().item())
    assert (outputs[True].float() - expected).abs().max() < 3e-2 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "probs_shape"), [((64, 48), (64, 1)), ((4, 16, 48), (4, 16, 1))])
def test_weighted_swiglu_equals_the_composite_and_keeps_only_its_inputs(dtype, shape, probs_shape):
    """The experts' activation (rows, and the padded GEMM's [experts, capacity] blocks): its output and the three
    gradients bit for bit those of autograd's silu(gate) * up * probs, and for backward it keeps gate, up and
    probs, where the composite keeps two [rows, ffn] tensors more (silu(gate) and the unweighted product)."""
    import torch.nn.functional as F

    from moe_train.models.moe.weighted_swiglu import weighted_swiglu

    generator = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(shape, generator=generator).to(dtype) for _ in range(3))
    probs = torch.rand(probs_shape, generator=generator).to(dtype)

    def run(activation):
        leaves = [t.clone().requires_grad_() for t in (gate, up, probs)]
        saved: dict[int, int] = {}

        def pack(tensor):
            saved[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = activation(*leaves)
        out.backward(grad)
        return out, [t.grad for t in leaves], sum(saved.values())

    got, got_grads, got_saved = run(weighted_swiglu)
    want, want_grads, want_saved = run(lambda g, u, p: F.silu(g) * u * p)
    assert torch.equal(got, want)
    for name, a, b in zip(("gate", "up", "probs"), got_grads, want_grads, strict=True):
        assert torch.equal(a, b), name
    element = torch.empty(0, dtype=dtype).element_size()
    assert got_saved == element * (2 * gate.numel() + probs.numel())
    assert want_saved - got_saved == 2 * element * gate.numel()
