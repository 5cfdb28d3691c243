"""FSDP2 data parallelism against the single-process run of the same recipe, parameter by parameter.

Each layout trains on real gloo ranks (tests/workers/train_layouts.py, several cases per job); the reference
trains the same recipe in this process at world size 1. Compared: the loss of every step (relative 1e-5), every
gradient of step 1 and every parameter and buffer (the expert bias included) after the last step (rtol 1e-4,
atol 1e-6), the expert balance figures of every step, and the initial weights bit for bit (sharded
initialisation draws each rank's shard, and each expert, by name).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    BF16,
    BF16_TOLERANCE,
    FP32,
    GPT_OSS_LAYOUT,
    SHRINK_LAYOUT,
    assert_same_run,
    case,
    read_metrics,
    reference,
)
from multirank import run_ranks

from moe_train.config import load_recipe
from moe_train.models import build_model

# The router's entropy is a float of bf16 logits, as the loss is, so it gets the loss's tolerance: on a CPU with
# native bf16 kernels (avx512_bf16) DP2 and one process differ by 2.5e-6 relative. The load figures are ratios of
# counts: one of a layer's 512 assignments sent elsewhere moves two experts' shares by 1/512, 1.6% of a mean share,
# so a changed routing still fails.
BF16_DP_TOLERANCE = {**BF16_TOLERANCE, "balance_rel": 1e-3}


@pytest.mark.slow
def test_fsdp2_dp2_equals_single_process(tmp_path: Path) -> None:
    cases = [case(f"fp32-{name}", name, overrides) for name, overrides in FP32.items()]
    cases.append(case("bf16-qwen3-moe-tiny", "qwen3-moe-tiny", BF16))
    cases.append(case("resume-qwen3-moe-tiny", "qwen3-moe-tiny", FP32["qwen3-moe-tiny"], steps=4, stop_at=2))
    cases.append(case("straight-qwen3-moe-tiny", "qwen3-moe-tiny", FP32["qwen3-moe-tiny"], steps=4))
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "dp2")}, tmp_path,
                      timeout=300)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    for name, overrides in FP32.items():
        want = reference(tmp_path, name, overrides)
        assert_same_run(records[f"fp32-{name}"], want)
        # Sharded initialisation equals the eager, unsharded build, bit for bit (one rank and two).
        plain = build_model(load_recipe(name, [*SHRINK_LAYOUT, *overrides]).model, seed=1234).state_dict()
        for label, source in (("one rank", want), ("two ranks", records[f"fp32-{name}"])):
            for key, value in plain.items():
                assert torch.equal(source["initial"][key], value), f"{name} at {label}: {key}"
    want = reference(tmp_path / "bf16", "qwen3-moe-tiny", BF16)
    assert_same_run(records["bf16-qwen3-moe-tiny"], want, **BF16_DP_TOLERANCE)

    # Stop at step 2 and resume under FSDP2 at DP=2: bitwise the uninterrupted run, losses and state.
    resumed, straight = records["resume-qwen3-moe-tiny"], records["straight-qwen3-moe-tiny"]
    assert resumed["started"] == 2
    for key, value in straight["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    resumed_losses = [r["loss"] for r in read_metrics(tmp_path / "dp2" / "resume-qwen3-moe-tiny", "train")]
    assert resumed_losses == straight["losses"]


@pytest.mark.slow
def test_fsdp2_dp4_equals_single_process(tmp_path: Path) -> None:
    names = ("qwen3-tiny", "qwen3-moe-tiny")
    cases = [case(f"fp32-{name}", name, FP32[name]) for name in names]
    saved = run_ranks("train_layouts", 4, {"cases": cases, "run_root": str(tmp_path / "dp4")}, tmp_path,
                      timeout=300)
    for name in names:
        assert_same_run(torch.load(saved[f"fp32-{name}"], weights_only=True), reference(tmp_path, name, FP32[name]))


@pytest.mark.slow
def test_global_aux_loss_counts_loads_over_the_data_parallel_group(tmp_path: Path) -> None:
    """global_aux_loss on 2 ranks x 2 micro-batches: each rank's loss at micro-batch m uses the loads of every
    rank's micro-batches 0..m (Megatron-Core's definition), recomputed here in fp64 from the gathered routing and
    router inputs; the recorded values and the attached router gradients (last MoE layer: nothing downstream
    adds to it) match it, and differ from a count over this rank's tokens alone."""
    result = run_ranks("global_aux", 2, {"micro_batches": 2}, tmp_path, timeout=120)
    ranks = result["ranks"]
    coeff, experts = 0.1, 8

    def counts(r: int, micro: int, layer: int) -> torch.Tensor:
        indices = torch.tensor(ranks[r]["indices"][layer][micro])
        return torch.bincount(indices.flatten(), minlength=experts).double()

    for rank, record in enumerate(ranks):
        for m in range(2):
            for layer in range(2):
                union = sum(counts(r, k, layer) for r in range(2) for k in range(m + 1))
                rows = sum(len(ranks[r]["indices"][layer][k]) for r in range(2) for k in range(m + 1))
                weight = torch.tensor(record["weights"][layer], dtype=torch.float64, requires_grad=True)
                inputs = torch.tensor(record["inputs"][layer][m], dtype=torch.float64)
                scores = (inputs @ weight.T).softmax(-1)
                loss = coeff * experts * (union / rows * scores.mean(0)).sum()
                assert record["values"][m][layer] == pytest.approx(loss.item(), rel=1e-5)
                local = coeff * experts * (counts(rank, m, layer) / scores.shape[0] * scores.mean(0)).sum()
                assert abs(local.item() - loss.item()) > 1e-6  # the group's loads, not this rank's alone
                got = torch.tensor(record["grads"][m][layer], dtype=torch.float64)
                if layer == 1:
                    (want,) = torch.autograd.grad(loss, weight)
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())  # fp32
                else:
                    assert got.abs().sum() > 0


# ------------------------------------------------------------------------------------------ expert parallelism

EP_MOE = ["train.micro_batch_size=1", "train.precision=fp32"]  # micro-batch accumulation on every rank


@pytest.mark.slow
def test_expert_parallel_layouts_equal_single_process(tmp_path: Path) -> None:
    """EP=2 on 2 ranks (edp 1), both dispatchers, qwen3-moe-tiny and deepseek-v3-tiny (expert bias, shared
    expert, MTP's MoE block): the single process's losses, gradients (expert stacks gathered whole), parameters
    and expert bias after three steps."""
    cases = [
        case("ep2-alltoall-qwen3-moe-tiny", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=2"]),
        case("ep2-allgather-qwen3-moe-tiny", "qwen3-moe-tiny",
             [*EP_MOE, "parallel.ep=2", "model.moe.dispatcher=allgather"]),
        case("ep2-alltoall-deepseek-v3-tiny", "deepseek-v3-tiny", ["train.micro_batch_size=2", "train.precision=fp32",
                                                                    "parallel.ep=2"]),
    ]
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "ep2")}, tmp_path, timeout=300)
    qwen = reference(tmp_path, "qwen3-moe-tiny", EP_MOE)
    assert_same_run(torch.load(saved["ep2-alltoall-qwen3-moe-tiny"], weights_only=True), qwen)
    assert_same_run(torch.load(saved["ep2-allgather-qwen3-moe-tiny"], weights_only=True), qwen)
    deepseek = reference(tmp_path, "deepseek-v3-tiny", ["train.micro_batch_size=2", "train.precision=fp32"])
    assert_same_run(torch.load(saved["ep2-alltoall-deepseek-v3-tiny"], weights_only=True), deepseek)


@pytest.mark.slow
def test_expert_parallel_on_four_ranks_equals_single_process(tmp_path: Path) -> None:
    """EP equal to the world size (edp 1: the reported FSDP2 divide-factor trap), dense DP4 with experts
    EP2 x EDP2 (FSDP2 over edp on top of the expert shards), and expert tensor parallelism: EP2 x ETP2 and
    ETP2 x EDP2 (each expert's FFN split over two ranks, partial outputs summed by the allgather dispatcher),
    EP2 x ETP2 of gpt-oss-tiny too (its gate/up biases split with their columns, its down bias added by etp rank 0
    only, the clamped SwiGLU per column), and parallel folding: dense TP2 x DP2 with experts EP4 over the same
    ranks."""
    allgather = "model.moe.dispatcher=allgather"
    cases = [
        case("ep4-qwen3-moe-tiny", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=4"]),
        case("ep2-edp2-qwen3-moe-tiny", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=2", allgather]),
        case("ep2-etp2-qwen3-moe-tiny", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=2", "parallel.etp=2", allgather]),
        case("etp2-edp2-qwen3-moe-tiny", "qwen3-moe-tiny", [*EP_MOE, "parallel.etp=2", allgather]),
        # Parallel folding: attention TP2 x DP2 while the experts span all four ranks (EP4), tp != ep.
        case("tp2-dp2-ep4-qwen3-moe-tiny", "qwen3-moe-tiny", [*EP_MOE, "parallel.tp=2", "parallel.ep=4"]),
        case("ep2-etp2-gpt-oss-tiny", "gpt-oss-tiny", [*GPT_OSS_LAYOUT, "parallel.ep=2", "parallel.etp=2", allgather]),
    ]
    saved = run_ranks("train_layouts", 4, {"cases": cases, "run_root": str(tmp_path / "ep4")}, tmp_path, timeout=300)
    qwen = reference(tmp_path, "qwen3-moe-tiny", EP_MOE)
    gpt_oss = reference(tmp_path, "gpt-oss-tiny", GPT_OSS_LAYOUT)
    for key in saved:
        assert_same_run(torch.load(saved[key], weights_only=True), gpt_oss if "gpt-oss" in key else qwen)


@pytest.mark.slow
def test_hierarchical_dispatch_on_two_emulated_nodes_equals_single_process(tmp_path: Path) -> None:
    """4 gloo ranks as 2 nodes x 2 (launch.nodes 2, node = rank // 2): the ep group spans both nodes, EP4 alone
    and EP4 under parallel folding with dense TP2 x DP2; the hierarchical dispatcher (each token once per node
    across nodes, then inside the node) trains the single process's run, and so does the all-to-all dispatcher
    in the same job. Padded to capacity (static splits across nodes and inside one; a capacity per rank's tokens,
    so not the single process's) the hierarchical dispatcher trains what the all-to-all dispatcher padded does."""
    nodes = ["launch.nodes=2", "model.moe.dispatcher=hierarchical"]
    padded = ["model.moe.capacity_factor=1.0", "model.moe.pad_to_capacity=true"]
    cases = [
        case("ep4-hierarchical", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=4", *nodes]),
        case("tp2-dp2-ep4-hierarchical", "qwen3-moe-tiny", [*EP_MOE, "parallel.tp=2", "parallel.ep=4", *nodes]),
        case("ep4-alltoall-two-nodes", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=4", "launch.nodes=2"]),
        # one step: the two differ by fp32 rounding alone (tests/workers/dispatch_hierarchical.py holds them to
        # 1e-12 in fp64), and over more steps a rounding-level change in the router's outputs can drop another of
        # two near-tied assignments (capacity 1.0 drops), after which their experts' weights part by more
        case("ep4-hierarchical-padded", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=4", *nodes, *padded], steps=1),
        case("ep4-alltoall-padded", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=4", "launch.nodes=2", *padded],
             steps=1),
    ]
    saved = run_ranks("train_layouts", 4, {"cases": cases, "run_root": str(tmp_path / "nodes")}, tmp_path,
                      timeout=300)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    qwen = reference(tmp_path, "qwen3-moe-tiny", EP_MOE)
    for key, record in records.items():
        if not key.endswith("-padded"):
            assert_same_run(record, qwen)
    assert_same_run(records["ep4-hierarchical-padded"], records["ep4-alltoall-padded"])
    assert records["ep4-alltoall-padded"]["losses"][0] != records["ep4-alltoall-two-nodes"]["losses"][0]  # it drops
    assert records["ep4-hierarchical"]["meshes"] == records["ep4-alltoall-two-nodes"]["meshes"]
