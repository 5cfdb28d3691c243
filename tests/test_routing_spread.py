"""The routing spread the planner prices and `measure` forces (config/routing_shapes.py): the expected distinct
nodes (ranks) a token needs under uniform and group-limited top-k, checked against brute-force enumeration and
DeepSeek-V3's published figures; the forced pattern's counts (every expert its even share, the realised spread
the expectation's integer version); and plan = `measure --fake` on a hierarchical layout whose tokens now span
several nodes."""

from __future__ import annotations

import itertools
import math

import pytest

from moe_train.config import load_recipe
from moe_train.config.hardware import HARDWARE
from moe_train.config.routing_shapes import ForcedRouting, destination_histogram, expected_destinations
from moe_train.plan.estimate import estimate, plan_json


def brute_force(num_experts: int, top_k: int, domains: int, groups: int, keep: int) -> list[float]:
    """Every g-subset of groups, every K-subset of their experts with at least one expert in each chosen group,
    equally likely: the distinct domains' histogram by enumeration."""
    size, per = num_experts // groups, num_experts // domains
    ways = [0] * (min(top_k, domains) + 1)
    for chosen in itertools.combinations(range(groups), keep):
        pool = [g * size + i for g in chosen for i in range(size)]
        for experts in itertools.combinations(pool, top_k):
            if keep < groups and len({e // size for e in experts}) < keep:
                continue
            ways[len({e // per for e in experts})] += 1
    return [w / sum(ways) for w in ways]


@pytest.mark.parametrize("case", [(8, 3, 2, 1, 1), (12, 4, 3, 1, 1), (16, 3, 2, 4, 2), (16, 4, 8, 4, 2),
                                  (16, 4, 4, 4, 2), (16, 3, 4, 2, 1)])
def test_histogram_is_the_enumeration(case):
    experts, k, domains, groups, keep = case
    got = destination_histogram(num_experts=experts, top_k=k, domains=domains, num_groups=groups,
                                group_top_k=keep)
    assert got == pytest.approx(brute_force(experts, k, domains, groups, keep), abs=1e-12)


def test_deepseek_v3_at_ep32_over_4_nodes():
    """The issue's figures: 3.6 distinct nodes uniform, 2.9-3.1 group-limited (8 groups, 4 kept: two groups
    a node, so 6/70 of the tokens need 2 nodes, 48/70 three, 16/70 four: 22/7)."""
    shape = dict(num_experts=256, top_k=8, domains=4)
    uniform = expected_destinations(**shape)
    assert uniform == pytest.approx(4 * (1 - math.comb(192, 8) / math.comb(256, 8)))
    assert round(uniform, 1) == 3.6
    limited = expected_destinations(**shape, num_groups=8, group_top_k=4)
    assert limited == pytest.approx(22 / 7) and 2.9 <= limited <= 3.15
    # node-limited: 8 groups on 8 nodes, 4 kept: exactly 4 nodes
    assert expected_destinations(num_experts=256, top_k=8, domains=8, num_groups=8, group_top_k=4) == 4.0


@pytest.mark.parametrize("tokens", [4096, 4095, 7])
def test_forced_pattern_realises_the_expectation_with_even_loads(tokens):
    forced = ForcedRouting(top_k=8, num_experts=256, domains=4, num_groups=8, group_top_k=4)
    indices = forced.indices(tokens)
    assert len(indices) == tokens and all(len(set(row)) == 8 for row in indices)
    counts = [0] * 256
    for row in indices:
        for expert in row:
            counts[expert] += 1
    assert counts == forced.counts(tokens)
    needs = [0] * 4
    for row in indices:
        for node in {expert // 64 for expert in row}:
            needs[node] += 1
    assert needs == forced.domain_tokens(tokens)
    groups = tokens // 4
    spans = forced.spans(groups)  # the integer version: round(groups x P(d)), summing to the groups
    assert sum(spans) == groups
    assert all(abs(n - groups * p) < 1 for n, p in zip(spans, forced.histogram(), strict=True))
    if tokens % 4 == 0:
        assert set(counts) == {tokens * 8 // 256} and len(set(needs)) == 1
        assert forced.mean_spread(tokens) == pytest.approx(sum(d * n for d, n in enumerate(spans)) / groups)
    # one domain: the round-robin spread as before
    assert ForcedRouting(top_k=8, num_experts=256).indices(3)[1] == tuple(range(8, 16))


@pytest.mark.slow
@pytest.mark.usefixtures("no_process_group")
def test_spread_bytes_plan_exactly_what_measure_fake_counts():
    """deepseek-v3-tiny (16 experts in 4 groups, 2 kept, top-4) at EP8 over 4 emulated nodes, hierarchical:
    one group a node, so the group limit is a node limit and every token needs exactly 2 nodes (the round-robin
    pattern's 4 consecutive experts needed one); measure --fake counts exactly the bytes plan says."""
    from moe_train.measure.driver import Target, measure

    recipe = load_recipe("deepseek-v3-tiny", [
        "model.num_layers=2", "model.mtp_layers=0", "train.seq_length=64", "train.global_batch_size=8",
        "train.micro_batch_size=1", "train.precision=fp32", "parallel.ep=8", "launch.nodes=4",
        "launch.gpus_per_node=2", "model.moe.dispatcher=hierarchical"], check_files=False)
    report = measure(recipe, Target(fake=True))
    plan = plan_json(estimate(recipe, HARDWARE["h100"]))
    keys = sorted(key for key in report["comm_bytes"] if key.split("/")[0] in ("epnode", "eplocal"))
    assert keys == ["eplocal/all_to_all", "epnode/all_to_all"]
    assert {key: plan["comm_bytes"][key] for key in keys} == {key: report["comm_bytes"][key] for key in keys}
    forced = ForcedRouting.of(recipe.model.moe, 4)
    assert forced.mean_spread(64) == plan["routing"]["expected_nodes"] == plan["routing"]["forced_nodes"] == 2.0
    # each of a rank's 64 tokens once to each of its 2 nodes, half of them to node 0 (this rank's own)
    assert sum(forced.domain_tokens(64)) == 128 and forced.domain_tokens(64)[0] == 32
