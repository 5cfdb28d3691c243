"""moe-train plan: the activation formulas held to autograd's saved tensors, the JSON contract, the memory
verdict shared by validate/submit/sweep, the hardware file, the layout search, and the torch-free boundary."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from cli_helpers import assert_bad_input, run_cli

from moe_train.config import load_recipe
from moe_train.config.hardware import HARDWARE
from moe_train.models import build_model
from moe_train.plan.activation_memory import (
    head_activation_bytes,
    layer_activation_bytes,
    mtp_activation_bytes,
    other_activation_bytes,
)
from moe_train.plan.estimate import estimate, plan_json
from moe_train.plan.rank_layout import PlanLayout, in_flight
from moe_train.plan.recompute_policy import RecomputePolicy
from moe_train.plan.saved_tensors import ActivationLayout, layer_items

BATCH, SEQ = 2, 128


def _saved_bytes(run, params: set[int], shared: set[int]) -> tuple[int, int]:
    """(bytes of the distinct storages autograd saves while `run()` executes, parameters excluded, of which
    the `shared` storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values()), sum(v for k, v in seen.items() if k in shared)


LAYERS = [("qwen3-tiny", 0), ("qwen3-moe-tiny", 0), ("deepseek-v3-tiny", 0), ("deepseek-v3-tiny", 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "index"), LAYERS, ids=[f"{n}-layer{i}" for n, i in LAYERS])
def test_layer_activation_formula_matches_saved_tensors(name: str, index: int, dtype: torch.dtype) -> None:
    recipe = load_recipe(name)
    torch.manual_seed(0)
    model = build_model(recipe.model).to(dtype)
    layer = model.layers[str(index)]
    x = torch.randn(BATCH, SEQ, recipe.model.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = model.rope(torch.arange(SEQ).unsqueeze(0))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shared = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    measured, measured_shared = _saved_bytes(lambda: layer(x, cos, sin, None), params, shared)
    lay = ActivationLayout(micro_batch=BATCH, seq_length=SEQ, act_bytes=dtype.itemsize)
    predicted = layer_activation_bytes(recipe.model, lay, layer_index=index)
    assert predicted == pytest.approx(measured - measured_shared, rel=0.03)
    # the rotary tables every layer shares: saved by reference in fp32, cast per layer in bf16 (this bare model
    # casts them for q and k apart; the engine's FSDP2 casts them once per layer, as the formula counts)
    expected_shared = other_activation_bytes(recipe.model, lay) if dtype == torch.float32 else 0
    assert measured_shared == expected_shared


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_whole_model_activation_formula_matches_saved_tensors(name: str) -> None:
    """Every layer, the head's loss, the MTP module and the shared tables, in one forward with the loss."""
    recipe = load_recipe(name)
    cfg = recipe.model
    torch.manual_seed(0)
    model = build_model(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step() -> None:
        model(ids, labels=ids)  # the loss terms: cross-entropy over the padded head, MTP, attached aux losses

    measured, _ = _saved_bytes(step, params, set())
    lay = ActivationLayout(micro_batch=BATCH, seq_length=SEQ, act_bytes=2)
    predicted = (sum(layer_activation_bytes(cfg, lay, layer_index=i) for i in range(cfg.num_layers))
                 + head_activation_bytes(cfg, lay, vocab_parallel=False)
                 + cfg.mtp_layers * mtp_activation_bytes(cfg, lay, RecomputePolicy())
                 + other_activation_bytes(cfg, lay))
    assert predicted == pytest.approx(measured, rel=0.03)


def test_sequence_parallel_shards_every_token_tensor_of_a_dense_layer() -> None:
    """Korthikanti et al.: with SP a GQA layer keeps 1/t of everything; without SP the norms and the GEMM
    inputs after them stay whole."""
    cfg = load_recipe("qwen3-8b").model
    base = ActivationLayout(micro_batch=1, seq_length=4096, act_bytes=2)
    whole = layer_activation_bytes(cfg, base, layer_index=0)
    for tp in (2, 8):
        sp = ActivationLayout(micro_batch=1, seq_length=4096, act_bytes=2, tp=tp, sequence_parallel=True)
        no_sp = ActivationLayout(micro_batch=1, seq_length=4096, act_bytes=2, tp=tp)
        rope = sum(i.bytes for i in layer_items(cfg, base, layer_index=0) if i.name.startswith("rope"))
        assert layer_activation_bytes(cfg, sp, layer_index=0) - rope == pytest.approx((whole - rope) / tp)
        h, tokens = cfg.hidden_size, 4096
        norm = 2 * tokens * h + 4 * tokens  # its bf16 input, fp32 rstd (two norms)
        gemm_inputs = 2 * (2 * tokens * h)  # q/k/v input and MLP input: the norms' outputs
        unsharded = 2 * norm + gemm_inputs
        assert layer_activation_bytes(cfg, no_sp, layer_index=0) - rope == pytest.approx(
            (whole - rope - unsharded) / tp + unsharded)


def test_recompute_policies_keep_less() -> None:
    cfg = load_recipe("deepseek-v3").model
    lay = ActivationLayout(micro_batch=1, seq_length=4096, act_bytes=2)
    moe_layer = cfg.first_k_dense
    none = layer_activation_bytes(cfg, lay, layer_index=moe_layer)
    by_module = {}
    for module in ("core_attn", "layernorm", "mla_up_proj", "moe", "shared_experts"):
        kept = layer_activation_bytes(cfg, lay, layer_index=moe_layer, policy=RecomputePolicy("selective", (module,)))
        assert kept < none, module
        by_module[module] = kept
    # the weighted SwiGLU keeps only its inputs (models/moe/weighted_swiglu.py), which a checkpoint of it keeps too
    by_module["moe_act"] = layer_activation_bytes(cfg, lay, layer_index=moe_layer,
                                                  policy=RecomputePolicy("selective", ("moe_act",)))
    assert by_module["moe_act"] == none
    # mla_up_proj drops SDPA's q, k, v and output (each tokens x heads x max(qk, v) in bf16) and its fp32
    # logsumexp; the rope key it reads is a view of kv_a_proj's output, which the kv norm keeps already
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    sdpa = 4 * 2 * 4096 * cfg.num_attention_heads * max(qk, cfg.v_head_dim) + 4 * 4096 * cfg.num_attention_heads
    assert none - by_module["mla_up_proj"] == sdpa
    # recomputing the whole MoE block keeps its input only: less than recomputing its activation
    assert by_module["moe"] < by_module["moe_act"]
    # the dense MLP recompute does nothing to a MoE layer
    assert layer_activation_bytes(cfg, lay, layer_index=moe_layer, policy=RecomputePolicy("selective", ("mlp",))) \
        == none


def test_pipeline_in_flight_micro_batches() -> None:
    recipe = load_recipe("deepseek-v3")  # pp 8, vpp 2, interleaved, 64 micro-batches per step
    layout = PlanLayout.from_recipe(recipe)
    pp, vpp = layout.pp, layout.vpp
    # interleaved warm-up on the first rank: (pp - 1) * 2 + (vpp - 1) * pp chunk forwards, plus one
    assert sum(in_flight(layout, 0)) == 2 * (pp - 1) + (vpp - 1) * pp + 1
    assert sum(in_flight(layout, pp - 1)) == (vpp - 1) * pp + 1
    plain = PlanLayout.from_recipe(load_recipe("deepseek-v3", ["parallel.vpp=1", "parallel.pp_schedule=1f1b",
                                                               "parallel.pp_layout=null", "model.num_layers=64"]))
    assert [in_flight(plain, r) for r in (0, 7)] == [[8], [1]]


def test_plan_json_contract_and_consistency() -> None:
    result = run_cli("plan", "qwen3-30b-a3b", "--json")
    assert result.code == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("gpu", "world_size", "memory_bytes", "device_memory_bytes", "fits", "flops_per_step", "comm_bytes",
                "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "assumptions", "comm_links",
                "model_flops_per_step", "executed_flops_per_step"):
        assert key in data, key
    memory = data["memory_bytes"]
    parts = ("weights", "grads", "optimizer", "activations", "buffers")
    assert sum(memory[k] for k in parts) == pytest.approx(memory["total"], abs=len(parts))
    assert data["fits"] == (memory["total"] <= data["device_memory_bytes"])
    assert set(data["comm_links"]) == set(data["comm_bytes"])
    assert data["gpu"] == "h100" and data["world_size"] == 32
    # TP1 EP8 on 8-GPU nodes: the all-to-all stays inside a node, FSDP over 32 ranks crosses nodes
    assert data["comm_links"]["ep/all_to_all"] == "nvlink"
    assert data["comm_links"]["dp/reduce_scatter"] == "network"
    tokens = 256 * 4096
    assert data["tokens_per_s"] == pytest.approx(tokens / data["step_time_s"])
    assert data["mfu"] == pytest.approx(data["tflops_per_gpu"] * 1e12 / HARDWARE["h100"].bf16_flops)


def test_all_to_all_payload_is_the_bytes_sent_to_other_ranks() -> None:
    # ep 8, 48 MoE layers, 8 micro-batches of 1 x 4096, bf16; no recompute of the MoE block (its all-to-alls
    # would run again)
    recipe = load_recipe("qwen3-30b-a3b", ["parallel.recompute.modules=[moe_act,layernorm]"])
    plan = plan_json(estimate(recipe, HARDWARE["h100"]))
    m = recipe.model
    rows = 4096 * m.moe.top_k * 7 / 8  # rows leaving this rank (and, at an even split, arriving)
    per_pass = 2 * rows * m.hidden_size  # bf16 rows
    counts = 7 * m.moe.num_experts // 8 * 8  # the int64 row counts each dispatch exchanges first
    probs = 2 * 4 * rows  # each sent row's fp32 routing weight, and each received row's weight gradient back
    # dispatch and combine, forward and backward, every layer, every micro-batch
    assert plan["comm_bytes"]["ep/all_to_all"] == pytest.approx((4 * per_pass + counts + probs) * 48 * 8, rel=1e-9)


def test_sequence_parallel_comm_gathers_the_saved_shard_again() -> None:
    base = ["launch.device=cuda", "launch.gpu=h100", "launch.gpus_per_node=8", "train.precision=bf16",
            "parallel.tp=8", "train.global_batch_size=8", "train.micro_batch_size=1"]
    sp = plan_json(estimate(load_recipe("qwen3-8b", [*base, "parallel.sequence_parallel=true"]), HARDWARE["h100"]))
    no_sp = plan_json(estimate(load_recipe("qwen3-8b", [*base, "parallel.sequence_parallel=false"]),
                               HARDWARE["h100"]))
    # the same volume in bus bytes, plus one all-gather in backward per column-parallel GEMM reading a gathered
    # input: q, k and v (GQA: three GEMMs) and the MLP's gate and up, 5 per layer, and the head's
    sp_bus = sum(v for k, v in sp["comm_bus_bytes"].items() if k.startswith("tp/"))
    no_sp_bus = sum(v for k, v in no_sp["comm_bus_bytes"].items() if k.startswith("tp/"))
    layer = 2 * 4096 * 4096  # a*T*h of one micro-batch; 4 micro-batches per step (dp 2, global batch 8)
    extra_gathers = 4 * (36 * 5 + 1) * layer / 8 * 7  # (tp - 1) shards each
    assert sp_bus - no_sp_bus == pytest.approx(extra_gathers, rel=0.02)


def test_validate_fails_when_the_recipe_cannot_fit(tmp_path) -> None:
    result = run_cli("validate", "qwen3-30b-a3b", "--set", "train.micro_batch_size=8")
    assert_bad_input(result, "memory: does not fit", "against 80 GB of a h100", "activations")


def test_validate_warns_within_the_margin_with_a_cluster_gpu(tmp_path, monkeypatch) -> None:
    plan = plan_json(estimate(load_recipe("qwen3-30b-a3b"), HARDWARE["h100"]))
    peak = plan["memory_bytes"]["total"]
    hardware = tmp_path / "hardware.yaml"
    hardware.write_text(f"h100-small: {{extends: h100, name: H100 with less memory, memory_bytes: "
                        f"{int(peak / 0.95)}}}\nh100-tiny: {{extends: h100, memory_bytes: {int(peak / 2)}}}\n")
    monkeypatch.setenv("MOE_TRAIN_HARDWARE", str(hardware))
    warned = run_cli("validate", "qwen3-30b-a3b", "--set", "launch.gpu=h100-small")
    assert warned.code == 0, warned.stderr
    assert "warning: memory: fits within the 10% margin only" in warned.stderr
    assert "H100 with less memory" in warned.stdout
    assert_bad_input(run_cli("validate", "qwen3-30b-a3b", "--set", "launch.gpu=h100-tiny"), "does not fit")
    assert run_cli("validate", "qwen3-30b-a3b").stderr == ""
    # the planner takes the cluster's GPU too
    small = json.loads(run_cli("plan", "qwen3-30b-a3b", "--gpu", "h100-small", "--nodes", "4", "--json").stdout)
    assert small["gpu"] == "h100-small" and small["within_margin"] and small["fits"]


def test_bad_hardware_file_is_one_line(tmp_path, monkeypatch) -> None:
    hardware = tmp_path / "hardware.yaml"
    hardware.write_text("x100: {extends: h100, memory_gigs: 80}\n")
    monkeypatch.setenv("MOE_TRAIN_HARDWARE", str(hardware))
    assert_bad_input(run_cli("plan", "qwen3-30b-a3b"), f"hardware file {hardware}: x100: unknown field(s) memory_gigs")
    hardware.write_text("x100: {name: X, memory_bytes: 1}\n")
    assert_bad_input(run_cli("validate", "qwen3-30b-a3b"), "missing bf16_flops")


def test_cpu_recipes_skip_the_memory_check() -> None:
    assert run_cli("validate", "qwen3-moe-tiny", "--set", "train.micro_batch_size=16").code == 0
    assert_bad_input(run_cli("plan", "qwen3-moe-tiny"), "plan needs a GPU target")
    tiny = json.loads(run_cli("plan", "qwen3-moe-tiny", "--gpu", "h100", "--nodes", "1", "--set", "parallel.ep=8",
                              "--set", "train.micro_batch_size=2", "--json").stdout)
    assert tiny["fits"] and tiny["world_size"] == 8


def test_submit_and_sweep_refuse_points_that_cannot_fit(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert_bad_input(run_cli("submit", "qwen3-30b-a3b", "--set", "train.micro_batch_size=8", "--dry-run"),
                     "memory: does not fit")
    swept = run_cli("sweep", "qwen3-30b-a3b", "--grid", "train.micro_batch_size=1,8", "--dry-run")
    assert swept.code == 0, swept.stderr
    lines = swept.stdout.splitlines()
    assert any("micro_batch_size=1" in line and " ok " in line for line in lines), swept.stdout
    assert any("micro_batch_size=8" in line and "invalid" in line for line in lines), swept.stdout
    assert "memory: does not fit" in swept.stdout


@pytest.mark.slow
def test_search_ranks_valid_fitting_layouts() -> None:
    result = run_cli("plan", "qwen3-30b-a3b", "--search", "--json", "--top", "4")
    assert result.code == 0, result.stderr
    data = json.loads(result.stdout)
    best = data["best"]
    assert len(best) == 4 and data["fitting"] <= data["valid"]
    speeds = [b["tokens_per_s"] for b in best]
    assert speeds == sorted(speeds, reverse=True)
    for entry in best:
        assert entry["fits"]
        sets = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in entry["overrides"].items()]
        recipe = load_recipe("qwen3-30b-a3b", sets)  # every layout listed is a valid recipe
        again = plan_json(estimate(recipe, HARDWARE["h100"]))
        assert again["tokens_per_s"] == pytest.approx(entry["tokens_per_s"])
        assert again["memory_bytes"]["total"] == pytest.approx(entry["memory_bytes"]["total"])


def test_plan_never_imports_torch() -> None:
    code = textwrap.dedent(
        """
        import sys, time
        from typer.testing import CliRunner
        from moe_train.cli.main import app
        start = time.perf_counter()
        result = CliRunner().invoke(app, ["plan", "deepseek-v3", "--json"])
        elapsed = time.perf_counter() - start
        assert result.exit_code == 0, result.output
        for args in (["plan", "qwen3-30b-a3b"], ["plan", "qwen3-30b-a3b", "--search"], ["validate", "qwen3-8b"]):
            assert CliRunner().invoke(app, args).exit_code == 0, args
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"), elapsed < 1.0)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] True"


def test_executed_flops_add_recompute_and_the_cpus_mla_padding_to_model_flops() -> None:
    h100 = HARDWARE["h100"]
    unchunked = "train.loss_chunk_tokens=0"  # the chunked loss's extra head GEMM: the test below
    qwen = plan_json(estimate(load_recipe("qwen3-30b-a3b", ["parallel.recompute.modules=[moe_act,layernorm]",
                                                           unchunked]), h100))
    # no padding, no matmul recomputed (moe_act and layernorm are elementwise): the ranks' sum is the formula
    # with attention as the causal kernel runs it, (s + 1) / 2 keys a query: Megatron-Core's s / 2 plus the
    # diagonal, one key a query (3 x 2 FLOPs per multiply-add x heads x (qk + v) per token and layer)
    q = load_recipe("qwen3-30b-a3b").model
    diagonal = 3 * q.num_attention_heads * 2 * q.attention_head_dim * q.num_layers * 256 * 4096
    assert qwen["executed_flops_per_step"] == pytest.approx(qwen["megatron_flops_per_step"] + diagonal, rel=1e-9)
    full = plan_json(estimate(load_recipe("qwen3-30b-a3b", ["parallel.recompute.granularity=full", unchunked]),
                              h100))
    assert 0.2 < full["flops"]["recompute"] / full["flops"]["forward"] < 1.0
    # bf16: the formula below is bf16's (the recipe itself runs MXFP8)
    recipe = load_recipe("deepseek-v3", ["parallel.recompute.modules=[mlp]", "train.precision=bf16", unchunked])
    ds = plan_json(estimate(recipe, HARDWARE["b200"]))
    m = recipe.model
    tokens = 2048 * 4096
    # recomputed: gate and up (the down projection runs after the MLP's last saved tensor, so not again)
    dense_mlp = 2 * 2 * m.hidden_size * m.ffn_hidden_size * m.first_k_dense * tokens
    padded_v = 2 * 4096 * m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim - m.v_head_dim)
    # forward and backward, over the (s + 1) / 2 keys a causal query is scored against
    padding = 3 * padded_v * (4096 + 1) / (2 * 4096) * (m.num_layers + m.mtp_layers) * tokens
    diagonal = 3 * m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * (
        m.num_layers + m.mtp_layers) * tokens
    # on cuda SDPA takes MLA's v at its own width (the kernel table's mla_value); the CPU's flash kernel pads it
    assert recipe.launch.device == "cuda"
    assert ds["executed_flops_per_step"] - ds["megatron_flops_per_step"] == pytest.approx(dense_mlp + diagonal,
                                                                                          rel=1e-6)
    cpu_recipe = load_recipe("deepseek-v3", ["parallel.recompute.modules=[mlp]", "train.precision=bf16",
                                             "launch.device=cpu", "launch.gpu=cpu", unchunked])
    on_cpu = plan_json(estimate(cpu_recipe, HARDWARE["b200"]))
    assert on_cpu["executed_flops_per_step"] - on_cpu["megatron_flops_per_step"] == \
        pytest.approx(dense_mlp + diagonal + padding, rel=1e-6)


def test_the_chunked_loss_recomputes_each_head_gemm_and_keeps_no_logits() -> None:
    """train.loss_chunk_tokens: one more head GEMM per head (the main one and each MTP module's), booked as
    recompute; the head keeps its input and one fp32 log-sum-exp per token instead of the fp32 logits. Its
    default (null) chunks Qwen3-30B-A3B (2.5 GB of logits per 4,096-token micro-batch) but not the tiny recipes."""
    h100 = HARDWARE["h100"]
    for name in ("qwen3-30b-a3b", "deepseek-v3"):
        plans = {chunk: plan_json(estimate(load_recipe(name, [f"train.loss_chunk_tokens={chunk}"]), h100))
                 for chunk in (0, 1024)}
        recipe = load_recipe(name)
        m, p = recipe.model, recipe.parallel
        tokens = recipe.train.global_batch_size * recipe.train.seq_length
        heads = 1 + m.mtp_layers
        head = 2 * m.hidden_size * m.padded_vocab_size() * tokens * heads
        executed = {chunk: plan["executed_flops_per_step"] for chunk, plan in plans.items()}
        assert executed[1024] - executed[0] == pytest.approx(head, rel=1e-9), name
        lay = ActivationLayout(micro_batch=1, seq_length=recipe.train.seq_length, act_bytes=2, tp=p.tp,
                               sequence_parallel=p.sequence_parallel)
        chunked = ActivationLayout(**{**vars(lay), "loss_chunk_tokens": 1024})
        logits = 4 * lay.tokens * m.padded_vocab_size() / p.tp
        saved = {layout: head_activation_bytes(m, layout, vocab_parallel=True) for layout in (lay, chunked)}
        gathered = (lay.tokens - lay.seq_tokens) * 2 * m.hidden_size  # SP: the chunked loss keeps every token
        assert saved[lay] - saved[chunked] == pytest.approx(logits - 4 * lay.tokens - gathered, rel=1e-9)
    assert PlanLayout.from_recipe(load_recipe("qwen3-30b-a3b")).loss_chunk_tokens == 1024
    assert PlanLayout.from_recipe(load_recipe("qwen3-moe-tiny")).loss_chunk_tokens == 0


def test_full_recompute_keeps_each_group_input_and_rebuilds_one_group_at_a_time() -> None:
    recipe = load_recipe("qwen3-30b-a3b", ["parallel.recompute.granularity=full",
                                           "parallel.recompute.num_layers=4"])
    plan = estimate(recipe, HARDWARE["h100"])
    lay = ActivationLayout(micro_batch=1, seq_length=4096, act_bytes=2, ep=recipe.parallel.ep,
                           loss_chunk_tokens=PlanLayout.from_recipe(recipe).loss_chunk_tokens)
    cfg = recipe.model
    layer_input = 2 * 4096 * cfg.hidden_size
    head = head_activation_bytes(cfg, lay, vocab_parallel=True)
    kept = plan.worst.memory["activations"] - head - other_activation_bytes(cfg, lay)
    assert kept == pytest.approx(48 / 4 * layer_input)  # pp 1: one micro-batch in flight
    one_group = 4 * layer_activation_bytes(cfg, lay, layer_index=0)
    block = estimate(load_recipe("qwen3-30b-a3b", ["parallel.recompute.granularity=full",
                                                  "parallel.recompute.method=block",
                                                  "parallel.recompute.num_layers=40"]), HARDWARE["h100"])
    kept_block = block.worst.memory["activations"] - head - other_activation_bytes(cfg, lay)
    assert kept_block == pytest.approx(40 * layer_input + one_group * 2)  # the last 8 layers keep everything


def test_offload_copies_are_priced_on_the_host_link_and_exposed_past_the_layers_compute() -> None:
    """Qwen3-235B-A22B on H100 under the published moe_act + layernorm with core_attn offloaded: each layer's copy
    is its moved bytes over PCIe Gen5's 64 GB/s and hides behind the layer's forward; on a link 100x slower every
    copy exceeds the compute it hides behind, and the step grows by what the plan says is exposed."""
    import dataclasses

    recipe = load_recipe("qwen3-235b-a22b", ["parallel.recompute.modules=[moe_act,layernorm]",
                                             "parallel.offload.modules=[core_attn]"], check_files=False)
    h100 = HARDWARE["h100"]
    fast = plan_json(estimate(recipe, h100))
    layers = fast["offload"]["per_layer"]
    assert layers and all(v["copy_s"] == v["bytes"] / 64e9 < v["forward_s"] for v in layers.values())
    assert fast["offload"]["exposed_s"] == 0.0 == fast["time_s"]["offload_exposed"]
    slow_link = dataclasses.replace(h100, host_link_bytes_per_s=0.64e9)
    slow_plan = estimate(recipe, slow_link)
    slow = plan_json(slow_plan, pipeline_rank=slow_plan.time_rank)
    per_micro_batch = sum(max(0.0, v["copy_s"] - v["forward_s"]) + max(0.0, v["copy_s"] - v["backward_s"])
                          for v in slow["offload"]["per_layer"].values())
    assert per_micro_batch > 0
    assert slow["offload"]["exposed_s"] == pytest.approx(per_micro_batch * slow["layout"]["micro_batches"])
    assert slow["time_s"]["offload_exposed"] == slow["offload"]["exposed_s"]
    assert slow["step_time_s"] > fast["step_time_s"] + slow["offload"]["exposed_s"]  # the bubble grows with it
    unpriced = plan_json(estimate(recipe, dataclasses.replace(h100, host_link_bytes_per_s=None)))
    assert unpriced["offload"]["exposed_s"] is None and unpriced["time_s"]["offload_exposed"] == 0.0
    assert unpriced["memory_bytes"] == fast["memory_bytes"]
