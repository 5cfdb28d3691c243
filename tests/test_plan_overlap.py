"""plan's price of `parallel.ep_overlap` (plan/overlap.py): what the overlapped pairs of micro-batches hide of
the expert-parallel communication, from the schedule's structure (F0 and B_M-1 alone, each other phase's
dispatch/combine behind the paired micro-batch's compute of a MoE layer), in the plan's figures, its JSON, its
--routing and its --search; and the pruned --search held to the exhaustive one. No torch ranks."""

from __future__ import annotations

import itertools
import json

import pytest
from cli_helpers import assert_bad_input, run_cli

from moe_train.config import load_recipe
from moe_train.config.hardware import HARDWARE
from moe_train.config.rules import check_recipe
from moe_train.plan.assumptions import Assumptions
from moe_train.plan.comm_bytes import comm_time
from moe_train.plan.estimate import estimate, plan_json
from moe_train.plan.overlap import ExposedComm, PairedPhases, exposed_comm
from moe_train.plan.routing import ExpertLoads, all_to_all_seconds, routing_plan
from moe_train.plan.search import search

OVERLAP = "parallel.ep_overlap=true"
# qwen3-30b-a3b's own layout: TP1 PP1 EP8 on 4 H100 nodes, 8 micro-batches a rank
QWEN = "qwen3-30b-a3b"
PP1 = ["parallel.pp=1", "parallel.vpp=1", "parallel.pp_schedule=1f1b", "parallel.pp_layout=null"]


def _plan(name: str, *sets: str, gpu: str | None = None):
    recipe = load_recipe(name, list(sets), check_files=False)
    return estimate(recipe, HARDWARE[gpu or recipe.launch.gpu])


# ------------------------------------------------------------------------------------- the schedule's model


def test_one_micro_batch_hides_nothing() -> None:
    """M = 1: F0 and B0 both run alone (warm-up and cool-down), so no phase has a partner."""
    phases = PairedPhases(micro_batches=1, overlapped=True, forward_compute_s=10.0, backward_compute_s=20.0)
    assert phases.pairs == 0 and phases.hidden_s(1.0, 2.0) == 0.0
    got = exposed_comm({"ep/all_to_all": 3.0}, {"ep/all_to_all": 1.0}, phases, layers=4)
    assert got == {"ep/all_to_all": ExposedComm(3.0, 0.0)} and got["ep/all_to_all"].exposed_fraction == 1.0


@pytest.mark.parametrize("micro_batches", [2, 3, 4, 8, 16])
def test_at_most_m_minus_one_of_m_hides(micro_batches: int) -> None:
    """Behind ample compute every paired phase hides all its communication: exactly (M - 1) / M of the step's,
    the exposed fraction 1 / M; behind less compute less, never more than the bound."""
    own, forward = {"ep/all_to_all": 6.0, "ep/all_gather": 2.0}, {"ep/all_to_all": 2.5, "ep/all_gather": 0.5}
    ample = PairedPhases(micro_batches=micro_batches, overlapped=True, forward_compute_s=1e3, backward_compute_s=1e3)
    got = exposed_comm(own, forward, ample, layers=3)
    for key, comm in got.items():
        assert comm.own_s == own[key]
        assert comm.hidden_s == pytest.approx(own[key] * (micro_batches - 1) / micro_batches, rel=1e-12)
        assert comm.exposed_fraction == pytest.approx(1 / micro_batches, rel=1e-12)
    for compute in (0.0, 0.01, 0.1, 0.5, 2.0):
        scarce = PairedPhases(micro_batches=micro_batches, overlapped=True, forward_compute_s=compute,
                              backward_compute_s=2 * compute)
        for comm in exposed_comm(own, forward, scarce, layers=3).values():
            assert 0.0 <= comm.hidden_s <= comm.own_s * (micro_batches - 1) / micro_batches + 1e-12
            assert comm.exposed_fraction >= 1 / micro_batches - 1e-12


def test_hidden_never_exceeds_the_partners_compute() -> None:
    """A forward's communication hides behind the partner's backward compute and a backward's behind the
    partner's forward compute, each at most that compute, in the M - 1 pairs only; a phase with more
    communication than its partner computes leaves the rest exposed."""
    values = (0.0, 0.05, 0.3, 1.0, 4.0)
    for m, forward, backward, f_compute, b_compute in itertools.product((1, 2, 5), values, values, values, values):
        phases = PairedPhases(micro_batches=m, overlapped=True, forward_compute_s=f_compute,
                              backward_compute_s=b_compute)
        share_f, share_b = phases.hidden_shares(forward, backward)
        assert share_f * forward <= (m - 1) * b_compute + 1e-12  # the forwards' hidden, behind backwards
        assert share_b * backward <= (m - 1) * f_compute + 1e-12  # the backwards', behind forwards
        assert phases.hidden_s(forward, backward) <= (m - 1) * (f_compute + b_compute) + 1e-12
        assert phases.hidden_s(forward, backward) == pytest.approx(
            (m - 1) * (min(forward / m, b_compute) + min(backward / m, f_compute)))
    plain = PairedPhases(micro_batches=8, overlapped=False, forward_compute_s=1.0, backward_compute_s=2.0)
    assert plain.hidden_s(1.0, 1.0) == 0.0


# ------------------------------------------------------------------------------------------------ the plan


def test_ep_overlap_off_keeps_the_plain_figures() -> None:
    """Without ep_overlap nothing of the EP communication hides (exposed fraction 1 on every dispatcher key),
    the exposed communication is the plain formula (every second less what the assumed fractions hide, at
    most the compute), and the dispatcher keys' own seconds are the comm model's; the what-if assumption is
    gone (`--assume ep_overlap=...` is refused by name)."""
    plan = _plan(QWEN)
    rank = next(r for r in plan.ranks if r.rank == plan.time_rank)
    seconds = comm_time(rank.comm, plan.layout, plan.hardware, plan.assumptions)
    t = plan.time
    assert t["ep_comm_hidden"] == 0.0
    assert t["comm_exposed"] == pytest.approx(
        t["comm_total"] - min(sum(seconds["hideable"].values()), t["compute"] + t["elementwise"]), rel=1e-12)
    assert set(plan.exposed_comm) == {"ep/all_to_all"}
    assert all(c.hidden_s == 0.0 and c.exposed_fraction == 1.0 for c in plan.exposed_comm.values())
    assert plan.exposed_comm["ep/all_to_all"].own_s == seconds["total"]["ep/all_to_all"]
    assert not any("ep" in group.split("_") for key, hidden in seconds["hideable"].items() if hidden
                   for group in [key.split("/")[0]])
    assert "ep_overlap" not in Assumptions().to_dict()
    assert_bad_input(run_cli("plan", QWEN, "--assume", "ep_overlap=0.8"), "--assume ep_overlap=0.8")


def test_ep_overlap_changes_only_the_hidden_time() -> None:
    """Overlapping moves no byte and no FLOP: memory, FLOPs and bytes are the plain step's; the exposed
    communication falls by exactly what the pairs hide, (M - 1) / M of the all-to-all here (8 micro-batches,
    the all-to-all on NVLink, well below a MoE layer's compute)."""
    plain, overlapped = plan_json(_plan(QWEN)), plan_json(_plan(QWEN, OVERLAP))
    for key in ("memory_bytes", "flops", "comm_bytes", "comm_bus_bytes", "activation_bytes_per_layer", "params"):
        assert overlapped[key] == plain[key], key
    hidden = overlapped["time_s"]["ep_comm_hidden"]
    assert hidden == pytest.approx(sum(c["hidden_s"] for c in overlapped["exposed_comm"].values()))
    assert plain["time_s"]["comm_exposed"] - overlapped["time_s"]["comm_exposed"] == pytest.approx(hidden)
    assert plain["step_time_s"] - overlapped["step_time_s"] == pytest.approx(hidden)
    m = overlapped["layout"]["micro_batches"]
    assert m == 8
    own = plain["exposed_comm"]["ep/all_to_all"]["own_s"]
    assert overlapped["exposed_comm"]["ep/all_to_all"]["own_s"] == own
    assert overlapped["exposed_comm"]["ep/all_to_all"]["exposed_fraction"] == pytest.approx(1 / m)


SPLIT = "parallel.split_wgrad=true"


def test_delayed_weight_gradients_hide_each_backwards_dispatch_half() -> None:
    """split_wgrad: every backward (paired or not) hides min(its dispatch half, its delayed weight gradients'
    seconds) of its EP communication; the forwards' hide only behind a partner, as before; in a pair at most the
    whole phase. Without pairs (M = 1, or ep_overlap off) that is all that hides."""
    forward, backward, m = 2.0, 4.0, 4  # one layer's EP seconds per step in the forwards and the backwards
    half = backward / m / 2
    for overlapped, wgrad in itertools.product((False, True), (0.0, half / 4, half, 10.0)):
        phases = PairedPhases(micro_batches=m, overlapped=overlapped, forward_compute_s=0.1,
                              backward_compute_s=0.1, delayed_wgrad_s=wgrad)
        plain = PairedPhases(micro_batches=m, overlapped=overlapped, forward_compute_s=0.1, backward_compute_s=0.1)
        (f, b), (f0, b0) = phases.hidden_shares(forward, backward), plain.hidden_shares(forward, backward)
        fill = min(half, wgrad)
        pairs = m - 1 if overlapped else 0
        assert f == f0
        assert b * backward == pytest.approx(pairs * min(backward / m, 0.1 + fill) + (m - pairs) * fill, rel=1e-12)
        assert b0 <= b <= 1.0
    lone = PairedPhases(micro_batches=1, overlapped=True, forward_compute_s=9.0, backward_compute_s=9.0,
                        delayed_wgrad_s=9.0)
    assert lone.hidden_shares(forward, backward) == (0.0, 0.5)  # B0 alone: its dispatch half behind its dW


def test_split_wgrad_prices_the_experts_weight_gradients() -> None:
    """In the plan: the delayed weight gradients are the routed experts' forward grouped-GEMM seconds of one
    MoE layer; split_wgrad moves no byte and no FLOP, and hides more with ep_overlap than without, and some
    without it (the cool-down's and the plain step's backwards too)."""
    plain, split = _plan(QWEN), _plan(QWEN, SPLIT)
    both, overlapped = _plan(QWEN, OVERLAP, SPLIT), _plan(QWEN, OVERLAP)
    assert plain.ep_phases.delayed_wgrad_s == 0.0
    assert split.ep_phases.delayed_wgrad_s > 0.0 and not check_recipe(split.recipe, check_files=False)
    plain_json, split_json = plan_json(plain), plan_json(split)
    for key in ("memory_bytes", "flops", "comm_bytes", "activation_bytes_per_layer"):
        assert split_json[key] == plain_json[key], key
    assert plain.time["ep_comm_hidden"] == 0.0 < split.time["ep_comm_hidden"]
    assert overlapped.time["ep_comm_hidden"] < both.time["ep_comm_hidden"]
    assert both.time["step"] < overlapped.time["step"]


def test_communication_beyond_the_partners_compute_stays_exposed() -> None:
    """EP32 across 4 H100 nodes with the all-to-all dispatcher: a MoE layer's exchange outlasts the partner's
    compute, so each pair hides exactly the partner's compute (the plan's PairedPhases) and the exposed
    fraction stays above 1 / M."""
    plan = _plan(QWEN, OVERLAP, "parallel.ep=32")
    phases, m = plan.ep_phases, plan.layout.micro_batches
    rank = next(r for r in plan.ranks if r.rank == plan.time_rank)
    layers = rank.moe_layer.count
    hidden = plan.time["ep_comm_hidden"]
    assert hidden == pytest.approx(sum(c.hidden_s for c in plan.exposed_comm.values()))
    assert hidden <= (m - 1) * layers * (phases.forward_compute_s + phases.backward_compute_s) * (1 + 1e-12)
    own = sum(c.own_s for c in plan.exposed_comm.values())
    assert own / (layers * m) > phases.backward_compute_s  # a forward's exchange outlasts a backward's compute
    assert hidden < own * (m - 1) / m
    assert all(c.exposed_fraction > 1 / m for c in plan.exposed_comm.values())


@pytest.mark.parametrize(("dispatcher", "keys"), [
    ("hierarchical", {"epnode/all_to_all", "eplocal/all_to_all"}),
    ("allgather", {"ep/all_gather", "ep/reduce_scatter"}),
])
def test_exposed_comm_names_each_dispatchers_collectives(dispatcher: str, keys: set[str]) -> None:
    """The keys are the dispatchers' collectives as measure's exposed_comm names them (and plan's comm_bytes)."""
    plan = plan_json(_plan("deepseek-v3", *PP1, f"model.moe.dispatcher={dispatcher}", OVERLAP))
    assert set(plan["exposed_comm"]) == keys and keys <= set(plan["comm_bytes"])
    for comm in plan["exposed_comm"].values():
        assert set(comm) == {"own_s", "hidden_s", "exposed_fraction"}
        assert 0 < comm["hidden_s"] < comm["own_s"]


def test_plan_json_keys_and_the_engines_refusals() -> None:
    """`plan --json` holds exposed_comm (own_s, hidden_s, exposed_fraction per <group>/<op>) and
    time_s.ep_comm_hidden; where validate refuses ep_overlap (pp > 1 with a schedule but dualpipev, no EP
    communication) plan refuses it too (exit 2, the field named)."""
    result = run_cli("plan", QWEN, "--set", OVERLAP, "--json")
    assert result.code == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data["exposed_comm"]) == {"ep/all_to_all"}
    assert set(data["exposed_comm"]["ep/all_to_all"]) == {"own_s", "hidden_s", "exposed_fraction"}
    assert data["time_s"]["ep_comm_hidden"] == pytest.approx(data["exposed_comm"]["ep/all_to_all"]["hidden_s"])
    assert_bad_input(run_cli("plan", "deepseek-v3", "--set", OVERLAP), "parallel.ep_overlap",
                     "dualpipev only, not interleaved_1f1b")
    assert_bad_input(run_cli("plan", QWEN, "--set", OVERLAP, "--set", "parallel.ep=1"), "parallel.ep_overlap")


def test_routing_hides_the_traced_exchanges_as_the_plan_does() -> None:
    """plan --routing: a trace that sends every token to one rank's experts doubles that rank's exchanges; under
    ep_overlap the pairs hide part of the extra too (behind the same compute as the plan's), so the routed step
    adds less, and an even trace adds nothing either way."""
    sets = ["model.num_layers=2", "train.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=1",
            "train.precision=fp32", "parallel.ep=2", "launch.device=cuda", "launch.gpu=h100",
            "launch.gpus_per_node=2"]
    recipe = load_recipe("qwen3-moe-tiny", [*sets, OVERLAP], check_files=False)
    plan = estimate(recipe, HARDWARE["h100"])
    assert plan.ep_phases.overlapped and plan.ep_phases.pairs == 3
    skewed = routing_plan(recipe, ExpertLoads(steps=1, tokens={0: [256, 256, 0, 0, 0, 0, 0, 0]} | {
        1: [256, 256, 0, 0, 0, 0, 0, 0]}, recorded_ep=1))
    even = routing_plan(recipe, ExpertLoads(steps=1, tokens={0: [64] * 8, 1: [64] * 8}, recorded_ep=1))
    plain_extra = all_to_all_seconds(skewed, recipe, HARDWARE["h100"], plan.assumptions)
    overlapped_extra = all_to_all_seconds(skewed, recipe, HARDWARE["h100"], plan.assumptions, plan.ep_phases)
    assert 0 <= overlapped_extra < plain_extra
    assert all_to_all_seconds(even, recipe, HARDWARE["h100"], plan.assumptions, plan.ep_phases) == pytest.approx(
        0, abs=1e-15)


# ---------------------------------------------------------------------------------------------- the search


@pytest.mark.slow
def test_search_keeps_ep_overlap_where_the_engine_builds_it() -> None:
    """With the recipe's ep_overlap the search weighs the same layouts as without (pipelined ones too: at vpp 2
    with 2 pp micro-batches as dualpipev, overlapped; plain elsewhere, where the engine refuses them overlapped),
    each one validate accepts: overlapped at pp 1 or under dualpipev with EP communication, plain elsewhere;
    overlapped, a layout is never slower than plain."""
    plain = load_recipe(QWEN, ["launch.nodes=2"], check_files=False)
    recipe = load_recipe(QWEN, ["launch.nodes=2", OVERLAP], check_files=False)
    every, valid, fits = search(recipe, HARDWARE["h100"], top=1 << 30)
    assert (valid, fits) == search(plain, HARDWARE["h100"], top=1)[1:]
    assert {c.overrides["parallel.ep_overlap"] for c in every} == {True, False}
    assert any(c.plan.recipe.parallel.pp > 1 and c.plan.recipe.parallel.ep_overlap for c in every)
    for c in every[:: max(len(every) // 25, 1)]:
        p = c.plan.recipe.parallel
        assert p.ep_overlap == ((p.pp == 1 or p.pp_schedule == "dualpipev") and p.ep * p.etp > 1)
        assert check_recipe(c.plan.recipe, check_files=False) == []
        if p.ep_overlap:
            alone = estimate(c.plan.recipe.model_copy(update={"parallel": p.model_copy(
                update={"ep_overlap": False})}), HARDWARE["h100"], every_rank=False)
            assert c.plan.step_time < alone.step_time


@pytest.mark.parametrize(("name", "sets"), [
    (QWEN, ["launch.nodes=1", "train.global_batch_size=64"]),
    (QWEN, ["launch.nodes=1", "train.global_batch_size=64", OVERLAP]),
    ("qwen3-30b-a3b-32k", ["launch.nodes=1", "train.global_batch_size=16", OVERLAP]),  # cp layouts too
    # pipelines with generated layouts, MTP, a dense first layer, the hierarchical dispatcher over 3 nodes
    ("deepseek-v3-tiny", ["launch.device=cuda", "launch.gpu=h100", "launch.nodes=3", "launch.gpus_per_node=4",
                          "train.global_batch_size=48", "train.precision=bf16", "model.moe.dispatcher=hierarchical"]),
], ids=["qwen3-30b-a3b", "qwen3-30b-a3b-ep_overlap", "qwen3-30b-a3b-32k-ep_overlap", "deepseek-v3-tiny-pipelines"])
def test_pruned_search_ranks_as_the_exhaustive_one(name: str, sets: list[str]) -> None:
    """The pruned search (a layout planned whole only while its communication-free bound can still enter the
    best five, and dropped once one of its ranks alone is slower than the best five; selective policies
    counted, not planned, once no recompute fits; the memo shared by the candidates) returns the exhaustive
    search's best five, which plans every fitting layout and policy whole from nothing, once the exhaustive
    list drops the selective policies of layouts whose no-recompute plan fits (never faster: the premise of
    the pruning, checked here); both count the same fitting layouts."""
    recipe = load_recipe(name, sets, check_files=False)
    pruned, valid, fits = search(recipe, HARDWARE["h100"], top=5)
    every, valid_all, fits_all = search(recipe, HARDWARE["h100"], top=1 << 30, prune=False, memo=False)
    assert (valid, fits) == (valid_all, fits_all) and len(every) == fits_all

    def base(c) -> str:
        return json.dumps({k: v for k, v in c.overrides.items() if k != "parallel.recompute"}, sort_keys=True)

    plain = {base(c): c.plan.step_time for c in every if c.overrides["parallel.recompute"]["granularity"] == "none"}
    kept = []
    for c in every:
        if c.overrides["parallel.recompute"]["granularity"] == "selective" and base(c) in plain:
            assert c.plan.step_time >= plain[base(c)] * (1 - 1e-12)
            continue
        kept.append(c)
    want = kept[:5]
    assert [c.plan.step_time for c in pruned] == pytest.approx([c.plan.step_time for c in want], rel=1e-12)
    key = lambda c: (round(c.plan.step_time, 9), json.dumps(c.overrides, sort_keys=True))  # noqa: E731
    assert sorted(map(key, pruned)) == sorted(map(key, want))
