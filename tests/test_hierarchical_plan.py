"""The hierarchical dispatcher's traffic, planned and measured: on 4 gloo ranks as 2 emulated nodes x 2, under
forced even routing, measure counts bytes under the split ep group's names (`epnode` across nodes, `eplocal`
inside one), exactly what plan predicts; the bytes crossing nodes are fewer than the all-to-all dispatcher's
(which sends every (token, expert) pair), and plan puts epnode on the network and eplocal on NVLink."""

from __future__ import annotations

from pathlib import Path

import pytest
from multirank import run_ranks

from moe_train.config import load_recipe
from moe_train.config.hardware import HARDWARE
from moe_train.plan.comm_bytes import even_node_tokens
from moe_train.plan.estimate import estimate, plan_json

SHAPE = ["model.num_layers=2", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=1",
         "train.precision=fp32", "parallel.ep=4", "launch.nodes=2"]


def test_even_node_tokens_counts_the_nodes_each_token_needs() -> None:
    # 8 experts on 2 nodes, top-2: token t's experts 2t, 2t+1 (mod 8) share a node; top-3 spills over
    assert even_node_tokens(8, 2, 8, 2) == [4, 4]
    by_hand = [0, 0]
    for t in range(10):
        for node in {((3 * t + j) % 8) // 4 for j in range(3)}:
            by_hand[node] += 1
    assert even_node_tokens(10, 3, 8, 2) == by_hand


def test_measure_counts_what_plan_says_across_and_inside_nodes(tmp_path: Path) -> None:
    hierarchical = [*SHAPE, "model.moe.dispatcher=hierarchical"]
    cases = [{"id": "hierarchical", "recipe": "qwen3-moe-tiny", "overrides": hierarchical},
             {"id": "alltoall", "recipe": "qwen3-moe-tiny", "overrides": SHAPE}]
    result = run_ranks("measure_layouts", 4, {"cases": cases}, tmp_path, timeout=300)
    measured = {case["id"]: result[case["id"]]["report"]["comm_bytes"] for case in cases}
    for case in cases:
        recipe = load_recipe(case["recipe"], [*case["overrides"], "launch.gpus_per_node=2"], check_files=False)
        plan = plan_json(estimate(recipe, HARDWARE["h100"]))
        keys = [key for key in measured[case["id"]] if key.split("/")[0] in ("ep", "epnode", "eplocal")]
        assert keys, case["id"]
        assert {key: plan["comm_bytes"][key] for key in keys} == {key: measured[case["id"]][key] for key in keys}
    hier, flat = measured["hierarchical"], measured["alltoall"]
    assert hier["epnode/all_to_all"] > 0 and hier["eplocal/all_to_all"] > 0 and "ep/all_to_all" not in hier
    # at even routing the all-to-all dispatcher spreads its bytes evenly over its 3 peers, 2 of them on the other
    # node; qwen3-moe-tiny's top-2 experts of a token share a node, so each token crosses once, not twice
    assert hier["epnode/all_to_all"] < flat["ep/all_to_all"] * 2 / 3


def test_plan_puts_epnode_on_the_network_and_eplocal_on_nvlink() -> None:
    """qwen3-30b-a3b at EP16 over 2 H100 nodes: the ep group splits 2 x 8 at the NVLink domain; the network
    carries each token once per other node it needs, fewer bytes than the all-to-all dispatcher's pairs."""
    sets = ["launch.nodes=2", "train.global_batch_size=128", "parallel.ep=16"]
    hier = plan_json(estimate(load_recipe("qwen3-30b-a3b", [*sets, "model.moe.dispatcher=hierarchical"]),
                              HARDWARE["h100"]))
    flat = plan_json(estimate(load_recipe("qwen3-30b-a3b", sets), HARDWARE["h100"]))
    assert hier["comm_links"]["epnode/all_to_all"] == "network"
    assert hier["comm_links"]["eplocal/all_to_all"] == "nvlink"
    assert hier["comm_bytes"]["epnode/all_to_all"] < flat["comm_bytes"]["ep/all_to_all"] / 2


def test_emulated_nodes_and_refusals() -> None:
    """All of a 2-node CPU recipe's ranks on this machine are accepted as emulated nodes (a GPU recipe's are
    not); toggling the dispatcher continues the same run; --fake (the lines `measure` prints with exit 2) and
    pad_to_capacity refuse hierarchical."""
    from moe_train.config.loader import RecipeError
    from moe_train.launch.rundir import recipe_differences
    from moe_train.measure.targets import fake_problems
    from moe_train.parallel.bootstrap import LauncherEnv, launcher_problems

    shape = ["launch.nodes=2", "launch.gpus_per_node=2", "parallel.ep=4", "train.micro_batch_size=1"]
    two_nodes = load_recipe("qwen3-moe-tiny", shape)
    one_machine = LauncherEnv({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "0"})
    assert not [p for p in launcher_problems(two_nodes, one_machine) if "rank(s) on this node" in p]
    gpu = two_nodes.model_copy(update={"launch": two_nodes.launch.model_copy(update={"device": "cuda"})})
    assert [p for p in launcher_problems(gpu, one_machine) if "rank(s) on this node" in p]
    hier = load_recipe("qwen3-moe-tiny", [*shape,
                                          "model.moe.dispatcher=hierarchical"])
    assert recipe_differences(two_nodes, hier) == []
    assert two_nodes.model.moe.dispatcher == "alltoall"  # the comparison copies, it does not strip the recipe
    assert [line.split(":")[0] for line in fake_problems(hier)] == ["model.moe.dispatcher"]
    with pytest.raises(RecipeError, match="model.moe.pad_to_capacity"):
        load_recipe("qwen3-moe-tiny", ["model.moe.dispatcher=hierarchical", "model.moe.capacity_factor=1.0",
                                       "model.moe.pad_to_capacity=true"])
