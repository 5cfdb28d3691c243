"""Overlapped micro-batches (`parallel.ep_overlap`, parallel/overlap.py) against the plain step of the same
layout: the same losses, every gradient of step 1 and every parameter after the last step, bit for bit.

The pairs run the plain step's ops on the same values in the same order within each micro-batch, and each
parameter's gradient accumulates over the micro-batches in the plain order, so nothing may part by a bit
(tolerance 0). One gloo job per world size runs every case, overlapped and plain; the schedule and the turn-
taking themselves are checked in one process with plain callables (the fast tier). `parallel.split_wgrad` (the
experts' weight gradients delayed into the dispatch's backward all-to-all) rides in the same jobs: its cases
against the same plain step, bit for bit, and the counted order of where its queue runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SHRINK_LAYOUT, assert_same_run, case
from multirank import run_ranks

from moe_train.models.moe.collective_turns import micro_batch, turn_state
from moe_train.parallel.overlap import overlapped_micro_batches

EXACT = {"loss": 0.0, "rtol": 0.0, "atol": 0.0}
FP32 = ["train.micro_batch_size=1", "train.precision=fp32"]  # 4 micro-batches a rank at DP2: 3 pairs a step
OVERLAP = "parallel.ep_overlap=true"
SPLIT = "parallel.split_wgrad=true"  # the experts' weight gradients delayed into the dispatch's backward collective
LAYOUTS_2 = {
    "ep2-alltoall": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2"]),
    "ep2-deepseek": ("deepseek-v3-tiny", [*FP32, "parallel.ep=2"]),  # shared expert, expert bias, MTP's MoE block
    "ep2-allgather": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2", "model.moe.dispatcher=allgather"]),
    "ep2-recompute": (
        "qwen3-moe-tiny",
        [*FP32, "parallel.ep=2", "parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe]"],
    ),
    "ep2-full-recompute": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2", "parallel.recompute.granularity=full"]),
    "ep2-fp8-rowwise": (
        "qwen3-moe-tiny",
        ["train.micro_batch_size=1", "train.precision=fp8", "train.fp8.recipe=rowwise", "parallel.ep=2"],
    ),
}
LAYOUTS_4 = {
    "ep2-tp2-sp": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ep4-hierarchical": (
        "qwen3-moe-tiny",
        [*FP32, "parallel.ep=4", "launch.nodes=2", "model.moe.dispatcher=hierarchical"],
    ),
    "ep2-edp2": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2"]),  # FSDP2 over the experts' edp too
    "ep2-edp2-selective": (  # FSDP2 (dp 4, the experts' edp 2) + EP2 + selective recompute of the MoE layers
        "qwen3-moe-tiny",
        [*FP32, "parallel.ep=2", "parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe]"],
    ),
}


# parallel.split_wgrad's cases: the layouts it runs on, overlapped and (ep2-alltoall) in the plain step too
SPLIT_2 = {"ep2-alltoall": ("overlap-split", "split"), "ep2-deepseek": ("overlap-split",),
           "ep2-allgather": ("overlap-split",), "ep2-recompute": ("overlap-split",),
           "ep2-full-recompute": ("overlap-split",), "ep2-fp8-rowwise": ("overlap-split",)}
SPLIT_4 = {"ep4-hierarchical": ("overlap-split",), "ep2-edp2-selective": ("overlap-split",)}
VARIANTS = {"overlap": [OVERLAP], "overlap-split": [OVERLAP, SPLIT], "split": [SPLIT]}


def _run_layouts(tmp_path: Path, world: int, layouts: dict, split: dict) -> None:
    """Every layout plain and overlapped, and the split_wgrad variants `split` names, each against the plain."""
    cases, compared = [], []
    for name, (recipe, overrides) in layouts.items():
        cases.append(case(f"{name}-plain", recipe, overrides))
        for variant in ("overlap", *split.get(name, ())):
            cases.append(case(f"{name}-{variant}", recipe, [*overrides, *VARIANTS[variant]]))
            compared.append((name, variant))
    saved = run_ranks(
        "train_layouts", world, {"cases": cases, "run_root": str(tmp_path / f"w{world}")}, tmp_path, timeout=400
    )
    for name, variant in compared:
        plain = torch.load(saved[f"{name}-plain"], weights_only=True)
        assert_same_run(torch.load(saved[f"{name}-{variant}"], weights_only=True), plain, **EXACT)


def test_the_schedule_pairs_each_backward_with_the_next_forward_taking_turns() -> None:
    """The schedule in one process, with plain callables for the halves: F0; (B_i, F_i+1); B_M-1, each backward
    given what its forward returned; inside a pair the backward runs first and a hand-over of the baton (what a
    dispatch collective does) runs the forward half until it ends, then the backward goes on."""
    order = []

    def forward(index: int) -> str:
        order.append(("F", index, micro_batch(), getattr(turn_state, "partner", None)))
        return f"out{index}"

    def backward(index: int, output: str) -> None:
        order.append(("B", index, output))
        if getattr(turn_state, "pair", None) is not None:
            baton, side = turn_state.pair
            baton.hand_over(side)
            order.append(("B-after-hand-over", index))

    overlapped_micro_batches(3, forward, backward)
    assert order == [
        ("F", 0, 0, None),
        ("B", 0, "out0"), ("F", 1, 1, 0), ("B-after-hand-over", 0),
        ("B", 1, "out1"), ("F", 2, 2, 1), ("B-after-hand-over", 1),
        ("B", 2, "out2"),
    ]
    assert micro_batch() is None and turn_state.pair is None


@pytest.mark.parametrize(("sets", "refused"), [
    (["parallel.ep=2", OVERLAP], None),
    (["parallel.ep=2"], None),  # without ep_overlap: the plain step's dispatch backward is asynchronous too
    (["parallel.ep=2", OVERLAP, "model.moe.dispatcher=hierarchical", "launch.nodes=2"], None),
    ([OVERLAP], "needs expert-parallel communication"),
    (["parallel.ep=2", "model.moe.dispatcher=allgather"], None),
    (["parallel.ep=2", "parallel.pp=2"], "pipeline parallelism"),
    (["parallel.ep=2", "train.precision=fp8", "train.fp8.recipe=rowwise"], None),
])
def test_validate_refuses_split_wgrad_where_it_is_not_built_by_name(sets: list[str], refused: str | None) -> None:
    """Accepted where built (with or without ep_overlap); refused with a line naming the field and the reason."""
    from moe_train.config import load_recipe
    from moe_train.config.loader import RecipeError

    overrides = [*FP32, *sets, SPLIT, "launch.gpus_per_node=2"]
    if refused is None:
        assert load_recipe("qwen3-moe-tiny", overrides, check_files=False).parallel.split_wgrad
        return
    with pytest.raises(RecipeError) as error:
        load_recipe("qwen3-moe-tiny", overrides, check_files=False)
    lines = [line for line in str(error.value).splitlines() if "parallel.split_wgrad: " in line]
    assert len(lines) == 1 and refused in lines[0], str(error.value)


def test_an_error_in_the_forward_half_is_raised_by_the_step() -> None:
    def forward(index: int) -> int:
        if index == 1:
            raise ValueError("forward of micro-batch 1")
        return index

    with pytest.raises(ValueError, match="forward of micro-batch 1"):
        overlapped_micro_batches(2, forward, lambda index, output: None)


@pytest.mark.slow
def test_overlapped_pairs_equal_the_plain_step_on_two_ranks(tmp_path: Path) -> None:
    _run_layouts(tmp_path, 2, LAYOUTS_2, SPLIT_2)


@pytest.mark.slow
def test_overlapped_pairs_equal_the_plain_step_on_four_ranks(tmp_path: Path) -> None:
    _run_layouts(tmp_path, 4, LAYOUTS_4, SPLIT_4)


def overlapped_comms(events: list[list]) -> tuple[int, int]:
    """(dispatch collectives issued inside a pair while the paired micro-batch still had compute to run, those
    of them that a compute phase of the paired micro-batch ran between the issue and the wait: the first moment
    the issuing thread may block on the collective, so the compute ran while it was in flight)."""
    checked = hidden = 0
    for index, (event, _kind, micro, partner) in enumerate(events):
        if event != "issue" or partner is None:
            continue
        nth = sum(1 for e in events[:index] if e[0] == "issue" and e[2] == micro)
        waited = [i for i, e in enumerate(events) if e[0] == "wait" and e[2] == micro][nth]
        later = [
            i for i, e in enumerate(events) if e[0] == "compute" and e[2] == partner and e[3] == micro and i > index
        ]
        if later:
            checked += 1
            hidden += later[0] < waited
    return checked, hidden


@pytest.mark.slow
def test_each_dispatch_and_combine_runs_beside_a_compute_phase_of_the_paired_micro_batch(tmp_path: Path) -> None:
    """A recorded order on 2 ranks (EP2, 2 layers, 4 micro-batches: 3 pairs): inside each pair every
    dispatch/combine collective of one micro-batch (forward and backward) is issued before and waited on after
    a compute phase (attention or experts, forward or backward) of the other, for as long as the other has one
    left. The plain step in the same job records no pair at all, and its collectives wait their whole time."""
    overrides = [*FP32, "parallel.ep=2"]
    cases = [case("overlap", "qwen3-moe-tiny", [*overrides, OVERLAP]), case("plain", "qwen3-moe-tiny", overrides),
             case("split", "qwen3-moe-tiny", [*overrides, OVERLAP, SPLIT])]
    result = run_ranks("overlap_order", 2, {"cases": cases, "run_root": str(tmp_path / "order")}, tmp_path, timeout=300)
    _check_delayed_weight_gradients(result["split"]["events"], micro_batches=4, moe_layers=2)
    assert not [e for e in events_of(result, "overlap") if e[0] == "wgrad"]  # split_wgrad off: no queue runs
    events = result["overlap"]["events"]
    checked, hidden = overlapped_comms(events)
    # per pair at least the forward half's 2 layers x (dispatch + combine), which the backward half outlasts
    assert checked >= 3 * 4, events
    assert hidden == checked, events
    assert {tuple(e[2:]) for e in events if e[0] == "compute"} >= {(1, 0), (0, 1), (2, 1), (1, 2), (3, 2), (2, 3)}
    plain = result["plain"]["events"]
    assert plain and all(e[3] is None for e in plain)
    assert overlapped_comms(plain) == (0, 0)
    for layout in ("plain", "overlap"):  # every dispatch collective booked, by <group>/<op>: waited within its own
        times = result[layout]["times"]  # time (the trainer's EP2 group is its DP2 one: named dp, the first)
        ((kind, ep),) = times.items()
        assert kind.endswith("/all_to_all"), times
        assert ep["count"] > 0 and 0 < ep["waited_s"] <= ep["own_s"]
        assert ep["exposed_fraction"] == pytest.approx(ep["waited_s"] / ep["own_s"])


def events_of(result: dict, layout: str) -> list[list]:
    return result[layout]["events"]


def delayed_weight_gradients(events: list[list]) -> list[tuple[int, bool]]:
    """Per run of a layer's delayed weight gradients (a `wgrad` event): (its micro-batch, whether it ran inside
    that layer's dispatch-backward collective: after the layer's experts' backward began, the micro-batch's
    events since are only collectives issued (none waited on), and its next event is the hand-over or the wait
    of those collectives)."""
    runs = []
    for index, (event, _kind, micro, _partner) in enumerate(events):
        if event != "wgrad":
            continue
        before = [e for e in events[:index] if e[2] == micro]
        experts = max(i for i, e in enumerate(before) if e[:2] == ["compute", "experts.bwd"])
        since = [e[0] for e in before[experts + 1:]]
        after = next((e[0] for e in events[index + 1:] if e[2] == micro), None)
        runs.append((micro, bool(since) and set(since) == {"issue"} and after in ("hand_over", "wait")))
    return runs


def test_the_order_check_fails_a_queue_run_outside_the_dispatch_collective() -> None:
    """The check above on recorded orders: the queue run between the dispatch-backward collective's issue and its
    hand-over passes; run in the experts' backward (nothing issued yet), after the wait, or at the end of the
    backward, it fails."""
    layer = [["compute", "experts.bwd", 0, 1], ["issue", "all_to_all", 0, 1], ["issue", "all_to_all", 0, 1]]
    settle = [["hand_over", "all_to_all", 0, 1], ["wait", "all_to_all", 0, 1], ["done", "all_to_all", 0, 1]]
    rest = [["compute", "self_attn.bwd", 0, 1], ["issue", "all_to_all", 0, 1], ["hand_over", "all_to_all", 0, 1]]
    wgrad = ["wgrad", "experts", 0, 1]
    assert delayed_weight_gradients([*layer, wgrad, *settle, *rest]) == [(0, True)]
    assert delayed_weight_gradients([layer[0], wgrad, *layer[1:], *settle, *rest]) == [(0, False)]
    assert delayed_weight_gradients([*layer, *settle, wgrad, *rest]) == [(0, False)]
    assert delayed_weight_gradients([*layer, *settle, *rest, wgrad, ["done", "all_to_all", 0, 1]]) == [(0, False)]


def _check_delayed_weight_gradients(events: list[list], *, micro_batches: int, moe_layers: int) -> None:
    """split_wgrad: each micro-batch's backward runs every MoE layer's queue once, each inside the layer's dispatch-
    backward collective (between its issue and its wait)."""
    runs = delayed_weight_gradients(events)
    assert sorted(micro for micro, _ in runs) == sorted(list(range(micro_batches)) * moe_layers), events
    assert all(inside for _, inside in runs), runs


@pytest.mark.slow
def test_measure_reports_the_exposed_comm_of_both_halves(tmp_path: Path) -> None:
    """`measure_step` on 2 real gloo ranks (EP2), plain and overlapped: `exposed_comm` holds the dispatchers'
    collectives by plan's `<group>/<op>`, each with its own and waited seconds and an exposed fraction in [0, 1];
    and the overlapped step's FLOPs and collective bytes are the plain step's (FSDP2's gathers aside), so measure's
    counters follow the forward half onto its thread. (That overlap exposes less is timing: the bench prints it,
    bench/bench_ep_overlap.py.)"""
    # FSDP2 gathers once a step under ep_overlap (validate): the plain step too, so their collectives compare
    overrides = [*SHRINK_LAYOUT, *FP32, "parallel.ep=2", "parallel.param_gather=per_step"]
    cases = [
        {"id": "plain", "recipe": "qwen3-moe-tiny", "overrides": overrides},
        {"id": "overlap", "recipe": "qwen3-moe-tiny", "overrides": [*overrides, OVERLAP]},
    ]
    out = run_ranks("measure_layouts", 2, {"cases": cases}, tmp_path, timeout=300)
    plain, overlapped = out["plain"]["report"], out["overlap"]["report"]
    for report in (plain, overlapped):
        exposed = report["exposed_comm"]
        assert set(exposed) == {"ep/all_to_all"}, exposed
        for times in exposed.values():
            assert set(times) == {"own_s", "waited_s", "exposed_fraction"}
            assert 0 < times["waited_s"] <= times["own_s"]
            assert 0 < times["exposed_fraction"] <= 1
            assert times["exposed_fraction"] == pytest.approx(times["waited_s"] / times["own_s"])
    assert overlapped["flops"] == plain["flops"]
    # every collective but FSDP2's parameter gathers: under ep_overlap each unit is gathered 3 times a step here
    # against once (9 calls against 3: docs/parallel.md, an open finding), the rest is the plain step's
    for counted in ("comm_bytes", "comm_calls"):
        gathers = "dp/all_gather"
        assert {k: v for k, v in overlapped[counted].items() if k != gathers} == {
            k: v for k, v in plain[counted].items() if k != gathers
        }
        assert overlapped[counted][gathers] >= plain[counted][gathers]
