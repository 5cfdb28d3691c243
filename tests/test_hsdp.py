"""HSDP (`parallel.dp_replicate`) and FSDP2's explicit prefetch against the single-process run of the same recipe,
parameter by parameter, in one 4-rank job (tests/workers/train_layouts.py): dp 4 as 2 replicas x 2 shards for a
dense and a MoE model, experts apart on their own (dpr, edps) mesh under EP2, and a checkpoint saved under HSDP
resumed as plain FSDP over dp 4 (DCP reshards the replicated shards). Explicit prefetch is on wherever the dense
FSDP2 mesh has more than one rank, so these cases and every other layout test with dp > 1 run with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import FP32, assert_same_run, case, read_metrics, reference
from multirank import run_ranks

from moe_train.config import load_recipe
from moe_train.config.loader import RecipeError

HSDP = "parallel.dp_replicate=2"


@pytest.mark.slow
def test_hsdp_2x2_equals_single_process_and_resumes_as_dp4(tmp_path: Path) -> None:
    moe = FP32["qwen3-moe-tiny"]
    cases = [
        case("hsdp-qwen3-tiny", "qwen3-tiny", [*FP32["qwen3-tiny"], HSDP]),
        case("hsdp-qwen3-moe-tiny", "qwen3-moe-tiny", [*moe, HSDP]),
        # EP2 puts experts apart: edp 2 = dpr 2 x edps 1, replicated over the same dpr as the dense parameters.
        case("hsdp-ep2-qwen3-moe-tiny", "qwen3-moe-tiny", [*moe, HSDP, "parallel.ep=2"]),
        case("hsdp-to-dp4-qwen3-moe-tiny", "qwen3-moe-tiny", [*moe, HSDP], steps=4, stop_at=2,
             resume_overrides=["parallel.dp_replicate=1"]),
        case("straight-dp4-qwen3-moe-tiny", "qwen3-moe-tiny", moe, steps=4),
    ]
    saved = run_ranks("train_layouts", 4, {"cases": cases, "run_root": str(tmp_path / "hsdp")}, tmp_path,
                      timeout=420)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    for key in ("hsdp-qwen3-tiny", "hsdp-qwen3-moe-tiny", "hsdp-ep2-qwen3-moe-tiny"):  # HSDP's 2-D meshes
        for name, dims in records[key]["meshes"].items():
            experts = key.startswith("hsdp-ep2") and ".experts." in name  # on the expert mesh, apart
            assert dims == (["dpr", "edps", "ep", "etp"] if experts else ["dpr", "dps"]), (key, name)
    assert_same_run(records["hsdp-qwen3-tiny"], reference(tmp_path, "qwen3-tiny", FP32["qwen3-tiny"]))
    want = reference(tmp_path, "qwen3-moe-tiny", moe)
    assert_same_run(records["hsdp-qwen3-moe-tiny"], want)
    assert_same_run(records["hsdp-ep2-qwen3-moe-tiny"], want)

    # Two steps under HSDP, two more under FSDP over dp 4 from its checkpoint: the uninterrupted dp-4 run, within
    # every layout test's tolerance (HSDP reduces in two stages, dps then dpr, in another order than dp 4's one
    # reduce-scatter, and four AdamW steps carry that rounding: 5.7e-7 in one embedding weight of ~0.02).
    resumed, straight = records["hsdp-to-dp4-qwen3-moe-tiny"], records["straight-dp4-qwen3-moe-tiny"]
    assert resumed["started"] == 2
    for key, value in straight["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")
    logged = read_metrics(tmp_path / "hsdp" / "hsdp-to-dp4-qwen3-moe-tiny", "train")
    assert [r["loss"] for r in logged] == pytest.approx(straight["losses"], rel=1e-6)


def test_dp_replicate_must_divide_dp_and_edp() -> None:
    with pytest.raises(RecipeError, match="parallel.dp_replicate: 3 must divide dp = 4"):
        load_recipe("qwen3-moe-tiny", ["launch.gpus_per_node=4", "parallel.dp_replicate=3"])
    # dp 2 x tp 1 with ep 2: edp = 1, which 2 replicas cannot split.
    with pytest.raises(RecipeError, match="parallel.dp_replicate: 2 must divide the experts' edp = 1"):
        load_recipe("qwen3-moe-tiny", ["launch.gpus_per_node=2", "parallel.dp_replicate=2", "parallel.ep=2"])


@pytest.mark.slow
def test_prefetch_each_block_gathers_the_next_one_before_its_forward(tmp_path: Path) -> None:
    """Explicit forward prefetch, observed: in a bf16 step on 2 ranks, each decoder block's all-gather after the
    first is issued while the block before it is the one being entered, not when its own forward starts
    (FSDP2's implicit order, which a host sync in the previous block would delay)."""
    result = run_ranks("prefetch_order", 2, {"run_dir": str(tmp_path / "run")}, tmp_path, timeout=180)
    order, first = result["order"], result["first"]
    assert [(block, first[block]) for block in order[1:]] == [(order[i + 1], order[i]) for i in range(len(order) - 1)]


def test_plan_of_hsdp_is_fsdp_over_one_replica_plus_the_replica_all_reduce() -> None:
    """qwen3-30b-a3b on 32 GPUs as 2 replicas x 16 shards: each rank holds and gathers what plain FSDP over 16
    ranks does (same micro-batches per rank), and the replicas all-reduce each reduced fp32 shard once per step."""
    from moe_train.config.hardware import HARDWARE
    from moe_train.plan.estimate import estimate, plan_json

    hsdp = plan_json(estimate(load_recipe("qwen3-30b-a3b", [HSDP]), HARDWARE["h100"]))
    one = plan_json(estimate(load_recipe("qwen3-30b-a3b", ["launch.nodes=2", "train.global_batch_size=128"]),
                             HARDWARE["h100"]))
    assert (hsdp["layout"]["dp"], hsdp["layout"]["dp_replicate"], one["layout"]["dp"]) == (32, 2, 16)
    assert hsdp["params"] == one["params"]
    for memory in ("weights", "grads", "optimizer"):
        assert hsdp["memory_bytes"][memory] == one["memory_bytes"][memory]
    bytes_h, bytes_1 = hsdp["comm_bytes"], one["comm_bytes"]
    for op in ("all_gather", "reduce_scatter"):
        assert bytes_h[f"dps/{op}"] == bytes_1[f"dp/{op}"]
        assert bytes_h[f"edps/{op}"] == bytes_1[f"edp/{op}"]
    # a reduce-scatter's payload is all shards (16 dense, edps = 2 expert), the all-reduce one shard
    assert bytes_h["dpr/all_reduce"] == bytes_1["dp/reduce_scatter"] / 16 + bytes_1["edp/reduce_scatter"] / 2
    assert not [key for key in bytes_h if key.split("/")[0] in ("dp", "edp")]
