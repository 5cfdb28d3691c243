"""`moe-train measure`: FLOPs, activation bytes, collective bytes and memory of one training step, held to
independent counts; `--fake` at full size; the JSON contract; bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_cli
from helpers import assert_same_step
from multirank import run_ranks
from processes import run_bounded

from moe_train.config import load_recipe
from moe_train.models.moe.router import Router, count_per_expert, even_topk_indices
from moe_train.plan.flop_count import forward_flops_per_token
from moe_train.plan.params import attention_matrices, count_parameters, ffn_matrices

REPO = Path(__file__).resolve().parents[1]
# The contract's keys (docs/interfaces.md), then the documented extras (docs/measure.md).
CONTRACT_KEYS = {
    "world_size", "rank", "layers", "activation_bytes_per_layer", "activation_bytes_total", "param_bytes",
    "grad_bytes", "optimizer_bytes", "flops", "comm_bytes", "peak_memory_bytes",
}
EXTRA_KEYS = {"fake", "micro_batches", "tokens", "comm_calls", "activation_bytes_peak", "fp8_gemms",
              "fp8_gemm_flops", "gathered_param_bytes", "exposed_comm", "offloaded_bytes_per_layer"}
SMALL = ("--set", "model.num_layers=2", "--set", "train.global_batch_size=4",
         "--set", "train.micro_batch_size=2")  # 2 micro-batches of 2
# deepseek-v3 at full size, in a layout the engine trains today (no pipeline, EP or recompute yet).
DEEPSEEK_TODAY = (
    "parallel.pp=1", "parallel.vpp=1", "parallel.pp_schedule=1f1b", "parallel.pp_layout=null", "parallel.ep=1",
    "parallel.recompute.granularity=none",
)


pytestmark = pytest.mark.usefixtures("no_process_group")  # tests/conftest.py


def measure_json(*args: str) -> dict:
    result = run_cli("measure", *args, "--json")
    assert result.code == 0, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    assert set(report) == CONTRACT_KEYS | EXTRA_KEYS
    assert set(report["flops"]) == {"forward", "backward", "recompute", "total", "optimizer"}
    assert report["flops"]["total"] == sum(report["flops"][k] for k in ("forward", "backward", "recompute"))
    assert report["flops"]["optimizer"] == 0  # AdamW runs no matmul (Muon's: tests/test_muon.py)
    assert report["activation_bytes_total"] == sum(report["activation_bytes_per_layer"].values())
    assert set(report["activation_bytes_per_layer"]) == {*map(str, report["layers"]), "other"}
    return report


def executed_forward_flops_per_token(cfg, seq_length: int) -> float:
    """The FLOPs formula (model FLOPs) plus what runs beyond them:
    - the output head computes logits over the padded vocabulary (the loss masks the padding), for the main
      head and each MTP depth;
    - MLA zero-pads V to the q/k head size for SDPA, so PV runs over qk_dim columns (in every MLA layer, the
      MTP block's included);
    - and less than them: the causal kernel scores (s + 1) / 2 keys a query, where model FLOPs count s (and
      Megatron-Core's convention s / 2), so the executed quadratic term is the model's less (s - 1) / s of
      the convention's half."""
    heads = 1 + cfg.mtp_layers
    keys_scored = (seq_length + 1) / 2
    extra = 2.0 * cfg.hidden_size * (cfg.padded_vocab_size() - cfg.vocab_size) * heads
    if cfg.family == "deepseek_v3":
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        padded_v = max(qk_dim - cfg.v_head_dim, 0)
        extra += 2.0 * keys_scored * cfg.num_attention_heads * padded_v * (cfg.num_layers + cfg.mtp_layers)
    model = forward_flops_per_token(cfg, seq_length=seq_length)
    half_of_the_scores = model - forward_flops_per_token(cfg, seq_length=seq_length, causal=True)
    return model - half_of_the_scores * (seq_length - 1) / seq_length + extra


# deepseek-v3-tiny cut to a dense layer, an MoE layer and its MTP module (index num_layers), one micro-batch.
DEEPSEEK_TINY_CUT = ("--set", "train.global_batch_size=2", "--layers", "0,1,8")


@pytest.fixture(scope="module")
def deepseek_tiny_real() -> dict:
    return measure_json("deepseek-v3-tiny", *DEEPSEEK_TINY_CUT)


def assert_flops_match(report: dict, cfg, seq_length: int) -> None:
    forward = report["tokens"] * executed_forward_flops_per_token(cfg, seq_length)
    flops = report["flops"]
    assert flops["forward"] == pytest.approx(forward, rel=0.01)
    assert flops["backward"] == pytest.approx(2 * forward, rel=0.01)  # data and weight gradients
    assert flops["recompute"] == 0  # no recomputation configured


def test_flops_of_a_step_equal_the_executed_formula(deepseek_tiny_real):
    report = measure_json("qwen3-moe-tiny", *SMALL)
    assert report["tokens"] == 4 * 128 and report["micro_batches"] == 2
    assert_flops_match(report, load_recipe("qwen3-moe-tiny", ["model.num_layers=2"]).model, 128)
    # Layers 0 (dense) and 1 (MoE) and the MTP module run the matmuls of a 2-layer model with its MTP module.
    cfg = load_recipe("deepseek-v3-tiny").model.model_copy(update={"num_layers": 2})
    assert deepseek_tiny_real["tokens"] == 2 * 128
    assert_flops_match(deepseek_tiny_real, cfg, 128)


def test_activation_bytes_of_a_dense_layer_equal_a_hand_count():
    """One qwen3 layer, fp32, one sequence of T = 128 tokens: h 128, H 8 query heads, K 4 kv heads, d 16,
    f 384. What autograd keeps (parameters and tensors an op needs no gradient from aside):
    - input_layernorm: its input x, rsqrt r [T,1] (x*r is formed again in backward); q/k/v projections: the
      norm's output [T,h];
    - q_norm: q [T,H*d], its rsqrt [T,H]; k_norm: the same over K heads; (the norms' outputs are not kept:
      the rotary muls need only cos/sin, shared under `other`); rotated q and k (SDPA's inputs), v [T,K*d];
    - SDPA (flash, CPU): its output [T,H*d] and logsumexp [T,H]; o_proj: the output made contiguous [T,H*d];
    - post_attention_layernorm: the residual sum, rsqrt; gate/up: the norm's output;
    - SwiGLU: gate output g (silu's input), silu(g), up output u, and silu(g)*u (down's input), each [T,f].
    """
    T, h, H, K, d, f = 128, 128, 8, 4, 16, 384
    kept = (
        4 * T * h  # x, norm out; residual sum, norm out
        + 2 * T  # two rsqrt
        + 4 * T * H * d  # q, rotated q, SDPA out, contiguous out
        + 2 * T * H  # q_norm rsqrt, logsumexp
        + 3 * T * K * d  # k, rotated k, v
        + T * K  # k_norm rsqrt
        + 4 * T * f  # g, silu(g), u, silu(g)*u
    )
    report = measure_json("qwen3-tiny", "--set", "model.num_layers=1", "--set", "train.global_batch_size=1",
                          "--set", "train.micro_batch_size=1")
    assert report["activation_bytes_per_layer"]["0"] == 4 * kept


@pytest.mark.slow
def test_fake_measures_what_the_real_step_does(deepseek_tiny_real):
    """Shapes decide FLOPs, saved bytes and memory (dropless routing: T*K expert rows whatever the routing)."""
    real = deepseek_tiny_real
    fake = measure_json("deepseek-v3-tiny", *DEEPSEEK_TINY_CUT, "--fake")
    assert fake["fake"] and not real["fake"] and real["layers"] == [0, 1, 8]
    assert_same_step(fake, real)
    # the MoE layer keeps its routed copies: top_k rows a token into the experts (fp32), at least
    cfg = load_recipe("deepseek-v3-tiny", check_files=False).model
    routed = cfg.moe.top_k * real["tokens"] // real["micro_batches"] * cfg.hidden_size * 4
    assert real["activation_bytes_per_layer"]["1"] > routed > 0


def fsdp_shard_elements(model: torch.nn.Module, dp: int) -> int:
    """Elements of rank 0's FSDP2 shards: each parameter is chunked along dim 0 into dp pieces of
    ceil(dim0 / dp) rows (the last ones padded), rank 0 holding a full chunk."""
    return sum(math.ceil(p.shape[0] / dp) * (p.numel() // p.shape[0]) for p in model.parameters())


@pytest.mark.slow
def test_fake_full_size_deepseek_v3_layers():
    from moe_train.models.model import Transformer
    from moe_train.parallel.pipeline import keep_layers

    start = time.monotonic()
    args = [arg for item in DEEPSEEK_TODAY for arg in ("--set", item)]
    report = measure_json("deepseek-v3", "--fake", *args)
    elapsed = time.monotonic() - start
    assert elapsed < 180, elapsed  # ~25 s alone on this machine
    recipe = load_recipe("deepseek-v3", DEEPSEEK_TODAY, check_files=False)
    cfg, dp, micro_batches = recipe.model, recipe.dp, 8
    assert report["layers"] == [0, 3]  # one dense layer, one MoE layer
    assert report["world_size"] == 256 == dp and report["rank"] == 0 and report["micro_batches"] == micro_batches
    # Parameters: embedding and head (padded vocabulary), final norm, layer 0 (dense) and layer 3 (MoE).
    norms = 2 * cfg.hidden_size + cfg.q_lora_rank + cfg.kv_lora_rank
    layers = 2 * (attention_matrices(cfg) + norms) + ffn_matrices(cfg, moe_layer=False, active=False)
    layers += ffn_matrices(cfg, moe_layer=True, active=False)
    with torch.device("meta"):
        model = Transformer(cfg)
    keep_layers(model, layers=(0, 3), mtp=())
    assert sum(p.numel() for p in model.parameters()) == 2 * cfg.padded_vocab_size() * cfg.hidden_size + (
        cfg.hidden_size + layers)
    # FSDP2 over dp = 256: fp32 shards; gradients the same; AdamW's two moments plus a step scalar per tensor.
    shard = fsdp_shard_elements(model, dp)
    tensors = len(list(model.parameters()))
    assert report["param_bytes"] == report["grad_bytes"] == 4 * shard
    assert report["optimizer_bytes"] == 2 * 4 * shard + 4 * tensors
    # Every FSDP unit is gathered (bf16) in each micro-batch's forward and again in its backward; gradients
    # are reduce-scattered once (fp32 input: the padded full gradient, dp shards). At ep = 1 the expert mesh's
    # edp is the same 256 ranks as dp: the routed experts are gathered and reduced with their block, over dp.
    comm = report["comm_bytes"]
    assert comm["dp/all_gather"] == micro_batches * 2 * 2 * shard
    assert comm["dp/reduce_scatter"] == 4 * dp * shard
    assert not any(key.startswith("edp/") for key in comm), comm
    # FLOPs: a 2-layer model with one dense-first layer has the same matmuls as layers 0 and 3.
    two = cfg.model_copy(update={"num_layers": 2, "first_k_dense": 1, "mtp_layers": 0})
    forward = report["tokens"] * executed_forward_flops_per_token(two, recipe.train.seq_length)
    assert report["flops"]["forward"] == pytest.approx(forward, rel=0.01)
    # Activations of one micro-batch (1 x 4096 tokens, bf16 compute, fp32 residual stream and norms): bytes per
    # token and hidden unit between Korthikanti's bf16 GPT layer (34, SDPA storing no s x s scores) and 10x it.
    per_element = {k: v / (recipe.train.seq_length * cfg.hidden_size) for k, v in
                   report["activation_bytes_per_layer"].items()}
    assert 34 <= per_element["0"] <= 340, per_element
    assert per_element["0"] < per_element["3"] <= 340, per_element  # routed rows: top-8 copies of each token
    assert report["peak_memory_bytes"] >= report["param_bytes"] + report["grad_bytes"] + report["optimizer_bytes"]


DERIVED = {  # recipe, overrides, rank, micro-batches per step (more than the three samples together)
    "no pipeline: dense, MoE and MTP layers": ("deepseek-v3-tiny", (), 0, 10),
    "1f1b first stage": ("qwen3-moe-tiny", ("parallel.pp=2",), 0, 16),
    "1f1b last stage": ("qwen3-moe-tiny", ("parallel.pp=2",), 1, 16),
    "interleaved 1f1b": ("qwen3-moe-tiny", ("parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b",
                                            "model.num_layers=4"), 0, 28),
}


def test_derive_takes_affine_figures_on_and_refuses_the_rest():
    from moe_train.measure.derive import NotAffine, derive, sample_counts

    reports = [{"flops": {"total": 10 + 2 * m}, "peak": 7, "layers": [0, 3], "micro_batches": m} for m in (2, 3, 4)]
    assert derive(reports, (2, 3, 4), 10) == {"flops": {"total": 30}, "peak": 7, "layers": [0, 3], "micro_batches": 10}
    for bad in ({"peak": 9}, {"layers": [0]}, {"flops": {"total": 18, "recompute": 1}}):
        with pytest.raises(NotAffine):
            derive([*reports[:2], {**reports[2], **bad}], (2, 3, 4), 10)
    assert sample_counts(load_recipe("qwen3-tiny"), 2048) == (2, 3, 4)
    assert sample_counts(load_recipe("qwen3-tiny"), 9) is None  # walking all nine costs no more
    gpipe = load_recipe("qwen3-tiny", ["parallel.pp=2", "parallel.pp_schedule=gpipe", "launch.gpus_per_node=2"])
    assert sample_counts(gpipe, 2048) is None  # its growing peak may overtake another past the samples
    interleaved = load_recipe("deepseek-v3", check_files=False)  # pp 8, vpp 2: steps of 24, 32 and 40
    assert sample_counts(interleaved, 64) is None and sample_counts(interleaved, 2048) == (24, 32, 40)


@pytest.mark.slow
@pytest.mark.parametrize("case", DERIVED)
def test_a_step_derived_from_a_few_micro_batches_equals_walking_them_all(case, capfd):
    """Under --fake the step is measured at three micro-batch counts and taken on to the recipe's: every key of
    the report equals the walk of every micro-batch, pipeline schedules (whose in-flight peak depends on the
    interleaving) included."""
    from moe_train.measure.driver import Target, measure

    name, extra, rank, micro_batches = DERIVED[case]
    world = 2 if extra else 1
    recipe = load_recipe(name, [f"train.global_batch_size={micro_batches}", "train.micro_batch_size=1",
                                "train.seq_length=32", f"launch.gpus_per_node={world}", *extra])
    derived = measure(recipe, Target(fake=True, rank=rank))
    said = capfd.readouterr().err
    assert f"{micro_batches} micro-batches per step; measuring steps of" in said and "do not fix" not in said, said
    walked = measure(recipe, Target(fake=True, rank=rank, every_micro_batch=True))
    assert derived["micro_batches"] == micro_batches
    assert derived == walked


@pytest.mark.slow
def test_measure_counts_what_the_trainer_runs_two_ranks(tmp_path):
    """On 2 gloo ranks: the comm counter on known collectives, exactly; then `measure_step` and the trainer's
    own `Trainer.train_step` under the same counters: the same FLOPs and FSDP2 traffic, the trainer adding
    only its telemetry all-reduces over dp, which measure leaves out (docs/measure.md)."""
    overrides = ["model.num_layers=2", "train.global_batch_size=8", "launch.gpus_per_node=2",
                 "train.micro_batch_size=2", f"run_dir={tmp_path / 'run'}"]
    out = run_ranks("measure", 2, {"recipe": "qwen3-moe-tiny", "overrides": overrides}, tmp_path, timeout=240)
    shared = {"ep/all_reduce": 40 + 12 + 12, "ep/all_gather": 24 + 8, "ep/reduce_scatter": 24, "ep/broadcast": 40}
    assert out["known"][0] == {**shared, "ep/all_to_all": 3 * 16, "ep/send": 28}
    assert out["known"][1] == {**shared, "ep/all_to_all": 2 * 16, "ep/recv": 28}

    report, trainer = out["measure"], out["trainer"]
    assert set(report) == CONTRACT_KEYS | EXTRA_KEYS
    assert report["flops"] == trainer["flops"]
    comm = report["comm_bytes"]
    for key in ("dp/all_gather", "dp/reduce_scatter"):
        assert comm[key] == trainer["comm_bytes"][key], key
    # The trainer's reduction of host figures (loss sums, MoE telemetry) over every rank (the default group:
    # `world`, since measure's dp has a group of its own), counted by the worker as it passes through
    # Trainer._all_reduce, is the only difference.
    assert trainer["telemetry_bytes"] > 0
    assert trainer["comm_bytes"]["dp/all_reduce"] == comm["dp/all_reduce"]
    assert trainer["comm_bytes"]["world/all_reduce"] == trainer["telemetry_bytes"]
    assert "world/all_reduce" not in comm
    # The analytic FSDP2 count at dp 2, fp32: each rank's shard gathered in every micro-batch's forward and
    # backward (2 micro-batches of 2), the full gradient reduce-scattered once; the routed experts with their
    # block (edp is dp at ep = 1): 3 units (2 blocks and the root), nothing on edp.
    cfg = load_recipe("qwen3-moe-tiny", ["model.num_layers=2"]).model
    full = count_parameters(cfg, padded=True).total
    assert report["param_bytes"] == 4 * full // 2  # every dim 0 of qwen3-moe-tiny is even: no padding
    assert comm["dp/all_gather"] == 2 * 2 * 4 * full // 2
    assert comm["dp/reduce_scatter"] == 4 * full
    assert not any(key.startswith("edp/") for key in comm), comm
    assert report["micro_batches"] == 2 and report["tokens"] == 2 * 2 * 128
    # --fake playing rank 0 of 2 in this process reports what the real rank 0 measured, collectives included.
    fake = measure_json("qwen3-moe-tiny", *(arg for o in overrides[:4] for arg in ("--set", o)), "--fake",
                        "--layers", "0,1")
    assert_same_step(fake, report)


@pytest.mark.slow
def test_nproc_runs_the_ranks_with_torchrun():
    """`--nproc 2` starts both ranks; rank 1 writes the report."""
    argv = [str(Path(sys.executable).parent / "moe-train"), "measure", "qwen3-tiny", "--nproc", "2", "--rank", "1",
            "--json", *SMALL]
    done = run_bounded(argv, timeout=180)  # a hang kills the CLI, torchrun and both ranks
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert set(report) == CONTRACT_KEYS | EXTRA_KEYS
    assert report["rank"] == 1 and report["world_size"] == 2 and report["micro_batches"] == 1
    assert set(report["comm_bytes"]) >= {"dp/all_gather", "dp/reduce_scatter"}


def test_even_routing_spreads_every_token_over_distinct_experts():
    indices = even_topk_indices(12, 4, 16, device=torch.device("cpu"))
    assert all(len(set(row.tolist())) == 4 for row in indices)
    assert count_per_expert(indices, 16).tolist() == [3] * 16
    recipe = load_recipe("deepseek-v3-tiny")
    router = Router(hidden_size=128, cfg=recipe.model.moe)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.zeros_(router.expert_bias)
    x = torch.randn(32, 128)
    assert not torch.equal(router(x).topk_indices, even_topk_indices(32, 4, 16, device=x.device))
    router.even_routing = True
    routing = router(x)
    assert torch.equal(routing.topk_indices, even_topk_indices(32, 4, 16, device=x.device))
    assert torch.equal(routing.topk_weights * 0 + 1, torch.ones(32, 4))
    assert routing.topk_weights.requires_grad  # the scores of the chosen experts still carry the gradient


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--layers", "0,x"), "--layers"),
        (("--layers", "8"), "out of range"),
        (("--rank", "2"), "--rank"),
        (("--fake", "--nproc", "2"), "exclude each other"),
        (("--set", "parallel.cp=2", "--set", "parallel.dp_replicate=2", "--set", "launch.gpus_per_node=8",
          "--fake"), "not supported yet"),
        (("--set", "parallel.pp=2", "--set", "launch.gpus_per_node=2", "--fake", "--rank", "1", "--layers", "0"),
         "not on rank 1's pipeline stage(s), which hold"),
        (("--set", "model.hidden_size=oops"), "model.hidden_size"),
    ],
)
def test_bad_input_exits_2(args, fragment):
    assert_bad_input(run_cli("measure", "qwen3-tiny", *args), fragment)


def test_command_module_does_not_import_torch():
    code = "import sys, moe_train.cli.measure; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_dtensor_ops_are_counted_on_this_ranks_shards():
    """A column-sharded matmul costs each of 2 ranks half; a partial norm's implicit all-reduce is seen."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from moe_train.measure.dtensor import local_dtensor_ops
    from moe_train.measure.fake import fake_process_group
    from moe_train.measure.flops import PhaseFlopCounter
    from moe_train.measure.layers import LayerTracker
    from moe_train.measure.traffic import CollectiveTraffic

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict()
    with fake_process_group(rank=1, world_size=2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        weight = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
        x = distribute_tensor(torch.randn(4, 16), mesh, [Replicate()])
        names = {mesh.get_group("tp").group_name: "tp"}  # groups named by their mesh dimension
        flops, comm = PhaseFlopCounter(LayerTracker([model])), CollectiveTraffic(lambda g: names[g.group_name])
        with local_dtensor_ops(), comm, flops:
            y = x @ weight.t()  # local [4, 16] x [16, 4]
            torch.linalg.vector_norm(weight).full_tensor()  # partial sums of squares, all-reduced
    assert y.to_local().shape == (4, 4)
    assert flops.totals()["forward"] == 2 * 4 * 16 * 4
    assert dict(comm.bytes) == {"tp/all_reduce": 4}
