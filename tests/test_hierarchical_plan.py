"""The hierarchical dispatcher and pad-to-capacity, planned and measured: on 4 gloo ranks as 2 emulated nodes x 2,
under forced even routing, measure counts bytes under the split ep group's names (`epnode` across nodes,
`eplocal` inside one), exactly what plan predicts, and every other figure (saved tensors, FLOPs) as plan and
`measure --fake` say; the bytes crossing nodes are fewer than the all-to-all dispatcher's (which sends every
(token, expert) pair), and plan puts epnode on the network and eplocal on NVLink. `--fake` takes both (their
split sizes follow from the shapes), so full-size layers are held to the plan exactly too."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import assert_same_step, full_size_recipe, plan_against_measure
from multirank import run_ranks

from moe_train.config import load_recipe
from moe_train.config.hardware import HARDWARE
from moe_train.plan.estimate import estimate, plan_json

SHAPE = ["model.num_layers=2", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=1",
         "train.precision=fp32", "parallel.ep=4", "launch.nodes=2"]
# capacity 6 rows per expert of a rank's 32 x 2 slots over 8 experts (8 each at even routing): 2 dropped, and
# every expert padded to 6 from each rank
PADDED = ["model.moe.capacity_factor=0.75", "model.moe.pad_to_capacity=true"]


@pytest.mark.slow
@pytest.mark.usefixtures("no_process_group")
def test_measure_counts_what_plan_says_across_and_inside_nodes(tmp_path: Path) -> None:
    """One 4-rank job: hierarchical and alltoall, each also padded to capacity (with drops). Each real rank 0
    measures what `--fake` measures in this process (every figure), and what plan says, exactly."""
    hierarchical = [*SHAPE, "model.moe.dispatcher=hierarchical"]
    cases = [{"id": "hierarchical", "recipe": "qwen3-moe-tiny", "overrides": hierarchical},
             {"id": "alltoall", "recipe": "qwen3-moe-tiny", "overrides": SHAPE},
             {"id": "alltoall-padded", "recipe": "qwen3-moe-tiny", "overrides": [*SHAPE, *PADDED]},
             {"id": "hierarchical-padded", "recipe": "qwen3-moe-tiny", "overrides": [*hierarchical, *PADDED]}]
    result = run_ranks("measure_layouts", 4, {"cases": cases}, tmp_path, timeout=300)
    from moe_train.measure.driver import Target, measure

    measured = {case["id"]: result[case["id"]]["report"]["comm_bytes"] for case in cases}
    for case in cases:
        recipe = load_recipe(case["recipe"], [*case["overrides"], "launch.gpus_per_node=2"], check_files=False)
        real = result[case["id"]]["report"]
        assert_same_step(measure(recipe, Target(fake=True)), real)
        assert plan_against_measure(recipe, real, tolerance=1e-9) == [], case["id"]
        plan = plan_json(estimate(recipe, HARDWARE["h100"]))
        keys = [key for key in measured[case["id"]] if key.split("/")[0] in ("ep", "epnode", "eplocal")]
        assert keys, case["id"]
        assert {key: plan["comm_bytes"][key] for key in keys} == {key: measured[case["id"]][key] for key in keys}
    hier, flat = measured["hierarchical"], measured["alltoall"]
    assert hier["epnode/all_to_all"] > 0 and hier["eplocal/all_to_all"] > 0 and "ep/all_to_all" not in hier
    # at even routing the all-to-all dispatcher spreads its bytes evenly over its 3 peers, 2 of them on the other
    # node; under the forced spread 25 of a rank's 32 tokens need the other node (top-2 of 8 experts over 2
    # nodes: 1.57 nodes a token), each crossing once, not once per expert there
    assert hier["epnode/all_to_all"] < flat["ep/all_to_all"] * 2 / 3
    # padded: 6 rows per expert instead of the even 8, whatever was dropped; across nodes the static bound,
    # min(T, E/N x 6) = 24 of a rank's 32 tokens to each node (16 need it), under all the padded pairs' bytes
    padded = measured["hierarchical-padded"]
    assert measured["alltoall-padded"]["ep/all_to_all"] < flat["ep/all_to_all"]
    assert 0 < padded["epnode/all_to_all"] < measured["alltoall-padded"]["ep/all_to_all"]


# Full-size single layers (test_plan_measure.py's shape: world max(2 tp, ep, 8), 8 GPUs a node): the
# hierarchical dispatcher with its ep group over 4 and 2 nodes, and pad-to-capacity with and without ep.
FULL_SIZE = [
    (("deepseek-v3", 1, 32, False, "none"), ["model.moe.dispatcher=hierarchical"]),
    (("qwen3-30b-a3b", 2, 16, True, "moe_act"), ["model.moe.dispatcher=hierarchical"]),
    (("qwen3-30b-a3b", 1, 8, False, "none"), ["model.moe.capacity_factor=1.25", "model.moe.pad_to_capacity=true"]),
    (("deepseek-v3", 1, 1, False, "moe_act+shared_experts"),
     ["model.moe.capacity_factor=0.5", "model.moe.pad_to_capacity=true"]),
]


@pytest.mark.slow
@pytest.mark.usefixtures("no_process_group")
def test_full_size_hierarchical_and_padded_layers_plan_exactly_what_measure_fake_counts() -> None:
    """measure --fake on full-size DeepSeek-V3 and Qwen3-30B-A3B layers: saved tensors (the hierarchical
    dispatcher's own, the padded buffers), FLOPs and every group's bytes (epnode, eplocal) exactly as planned."""
    from moe_train.measure.driver import Target, measure

    start = time.monotonic()
    failures = {}
    for case, extra in FULL_SIZE:
        recipe = full_size_recipe(*case, extra=tuple(extra))
        report = measure(recipe, Target(fake=True))
        problems = plan_against_measure(recipe, report, tolerance=1e-9)
        if problems:
            failures[case] = problems
        keys = set(report["comm_bytes"])
        if "hierarchical" in extra[0]:  # ep over more than one node of 8: split, with bytes on both
            assert {"epnode/all_to_all", "eplocal/all_to_all"} <= keys and "ep/all_to_all" not in keys, case
    assert failures == {}
    assert time.monotonic() - start < 60


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
    not); toggling the dispatcher continues the same run; --fake (the lines `measure` prints with exit 2) takes
    it and pad-to-capacity, not dropping without padding; hierarchical takes pad-to-capacity."""
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
    assert fake_problems(hier) == []  # the splits follow from the shapes under forced even routing
    dropping = load_recipe("qwen3-moe-tiny", ["model.moe.capacity_factor=1.0"])
    assert [line.split(":")[0] for line in fake_problems(dropping)] == ["model.moe.capacity_factor"]
    assert fake_problems(load_recipe("qwen3-moe-tiny", PADDED)) == []
    padded = load_recipe("qwen3-moe-tiny", ["model.moe.dispatcher=hierarchical", *PADDED])  # static sizes
    assert padded.model.moe.pad_to_capacity and fake_problems(padded) == []
    with pytest.raises(RecipeError, match="model.moe.pad_to_capacity"):
        load_recipe("qwen3-moe-tiny", ["model.moe.dispatcher=hierarchical", "model.moe.pad_to_capacity=true"])


@pytest.mark.slow
def test_search_weighs_both_dispatchers_where_ep_spans_nvlink_domains() -> None:
    """DeepSeek-V3 on 256 B200s (8 a NVLink domain): every layout whose ep group spans domains is planned with
    both dispatchers, and at EP32 (4 nodes) the hierarchical one is faster, layout for layout, and is the pick;
    where ep fits in one domain only the recipe's own (set to alltoall here; the built-in recipe's is hierarchical)
    is offered."""
    from moe_train.plan.search import dispatchers, search

    recipe = load_recipe("deepseek-v3", ["model.moe.dispatcher=alltoall"])
    assert dispatchers(recipe, ep=32, etp=1, nvlink_domain=8) == ["alltoall", "hierarchical"]
    assert dispatchers(recipe, ep=8, etp=1, nvlink_domain=8) == ["alltoall"]
    start = time.monotonic()
    ranked, valid, fits = search(recipe, HARDWARE["b200"], top=100_000)
    assert ranked and fits >= len(ranked)  # fits also counts the policies it knows fit without planning them
    by_layout: dict[tuple, dict[str, float]] = {}
    for candidate in ranked:
        layout = tuple(sorted((k, str(v)) for k, v in candidate.overrides.items() if k != "model.moe.dispatcher"))
        by_layout.setdefault(layout, {})[candidate.overrides["model.moe.dispatcher"]] = candidate.plan.tokens_per_s
    ep_of = {layout: int(dict(layout)["parallel.ep"]) for layout in by_layout}
    within = [speeds for layout, speeds in by_layout.items() if ep_of[layout] <= 8]
    assert within and all(set(speeds) == {"alltoall"} for speeds in within)
    ep32 = [speeds for layout, speeds in by_layout.items() if ep_of[layout] == 32 and len(speeds) == 2]
    assert ep32 and all(speeds["hierarchical"] > speeds["alltoall"] for speeds in ep32)
    best_ep32 = next(c for c in ranked if c.overrides["parallel.ep"] == 32)
    assert best_ep32.overrides["model.moe.dispatcher"] == "hierarchical"
    assert time.monotonic() - start < 30
