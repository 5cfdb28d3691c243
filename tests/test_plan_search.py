"""`plan --search`'s shortcuts give the plans of the plain path: the memo shared by one search's candidates
(plan/estimate.py `PlanMemo`) against each layout planned from nothing, and a layout planned whole from its
communication-free bound (`with_communication`) against `estimate` of the recipe, figure for figure. No torch.
The pruned search against the exhaustive one: tests/test_plan_overlap.py."""

from __future__ import annotations

import json

import pytest

from moe_train.config import load_recipe
from moe_train.config.hardware import HARDWARE
from moe_train.plan.estimate import estimate, plan_json, with_communication
from moe_train.plan.search import search

# deepseek-v3's structure (a dense first layer, MoE after it, MTP, MLA) on 12 H100s of 4 to a node, so that the
# search weighs pipelines with generated layouts (8 layers over 3 or 6 stages), cp, etp, full and selective
# recompute, and the hierarchical dispatcher's expert rows over 3 nodes
TINY = ["launch.device=cuda", "launch.gpu=h100", "launch.nodes=3", "launch.gpus_per_node=4",
        "train.global_batch_size=48", "train.precision=bf16"]


def _ranks(plan) -> tuple:
    """What the planned ranks hold: memory, FLOPs, memory-bound traffic, communication, with the step's parts."""
    return plan.time, plan.time_rank, [(r.rank, r.memory, r.flops, r.flops_split, r.elementwise_bytes,
                                        r.local_params, r.comm.bus, r.moe_sync) for r in plan.ranks]


def _figures(plan) -> str:
    """Everything a plan reports (its JSON), every planned rank's figures too."""
    return json.dumps({"json": plan_json(plan), "ranks": _ranks(plan)}, sort_keys=True, default=str)


@pytest.mark.parametrize("dispatcher", ["alltoall", "hierarchical"])
def test_memoised_search_plans_every_layout_as_the_memo_free_one(dispatcher: str) -> None:
    """Every fitting layout and policy planned whole (prune False), with the memo and without: the same
    layouts, each with the same figures to the last bit (the memo reuses the very values; nothing is summed in
    another order)."""
    recipe = load_recipe("deepseek-v3-tiny", [*TINY, f"model.moe.dispatcher={dispatcher}"], check_files=False)
    memoised, valid, fits = search(recipe, HARDWARE["h100"], top=1 << 30, prune=False, memo=True)
    plain, valid_plain, fits_plain = search(recipe, HARDWARE["h100"], top=1 << 30, prune=False, memo=False)
    assert (valid, fits) == (valid_plain, fits_plain) and len(memoised) == fits > 100
    assert {c.overrides["model.moe.dispatcher"] for c in memoised} == {dispatcher}
    assert {c.overrides["parallel.recompute"]["granularity"] for c in memoised} == {"full", "none", "selective"}
    assert {c.overrides["parallel.pp_layout"] is not None for c in memoised} == {True, False}
    by_layout = {json.dumps(c.overrides, sort_keys=True): _ranks(c.plan) for c in plain}
    assert {json.dumps(c.overrides, sort_keys=True): _ranks(c.plan) for c in memoised} == by_layout


@pytest.mark.parametrize("sets", [
    ["parallel.pp=3", "parallel.pp_layout=Et*3|t*3|t*2mL", "parallel.ep=4", "model.moe.dispatcher=hierarchical",
     "parallel.recompute.granularity=full"],
    ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_layout=null",
     "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"],
], ids=["pp3-hierarchical-full", "pp2-vpp2-tp2"])
def test_a_layout_planned_from_its_bound_is_the_whole_plan(sets: list[str]) -> None:
    """with_communication(the bound) = estimate(every_rank False), to the bit; with `slower_than` it gives up
    exactly when the step reaches it (the slowest rank alone does)."""
    recipe = load_recipe("deepseek-v3-tiny", [*TINY, *sets], check_files=False)
    hw = HARDWARE["h100"]
    bound = estimate(recipe, hw, every_rank=False, comm=False)
    whole = estimate(recipe, hw, every_rank=False)
    assert len(whole.ranks) > 1 and bound.step_time < whole.step_time
    assert _figures(with_communication(bound)) == _figures(whole)
    assert with_communication(bound, slower_than=whole.step_time) is None
    assert _figures(with_communication(bound, slower_than=whole.step_time * (1 + 1e-9))) == _figures(whole)
