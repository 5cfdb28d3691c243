"""plan's price of `parallel.split_wgrad` (plan/overlap.py) held to measure's exposed fraction of the EP
all-to-all on 2 real gloo ranks (EP2, qwen3-moe-tiny fp32, 4 micro-batches a rank: bench/bench_overlap_plan.py's
layout), the plain step and split_wgrad in one job.

What split_wgrad can hide without ep_overlap: each backward's dispatch collective waits after the experts'
delayed weight gradients, so it hides min(that collective's wait, the weight gradients' seconds). On this
machine the plain step's waits are mostly the peer rank arriving late (2 ranks and gloo's threads on 2 shared
cores), not the link, and the weight gradients cover any of that wait alike, so the plan is priced on a row of
this machine whose link is the plain step's own: its bus bytes over its waited seconds (the bench's
calibration (b); with the link alone, (a), the plan would price a link-bound exchange that this machine does not
have). The GEMM rate is this machine's, timed here at the experts' shapes on one thread (every efficiency 1).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from multirank import run_ranks

from moe_train.config import load_recipe
from moe_train.config.hardware import Hardware
from moe_train.plan.assumptions import Assumptions
from moe_train.plan.estimate import estimate

RECIPE = "qwen3-moe-tiny"
LAYOUT = ["train.global_batch_size=16", "train.micro_batch_size=2", "parallel.param_gather=per_step",
          "parallel.ep=2", "train.precision=fp32"]
SPLIT = "parallel.split_wgrad=true"
KEY = "ep/all_to_all"
# measure's exposed fraction of this layout's plain step over seven rounds of bench_overlap_plan.py at load 8-15
# read 0.70-0.76 (docs/plan.md), and split_wgrad's 0.66-0.69 in the rounds since: each within ~0.04 of its centre,
# so their ratio within ~0.08 of its own; 0.1 holds that and still fails a plan that hides the dispatch half
# whole (0.75 of the plain step here) or nothing where the weight gradients cover a wait
TOLERANCE = 0.1


def _gemm_flops_per_s(recipe) -> float:
    """This machine's fp32 GEMM rate at the routed experts' shapes, one thread (the ranks run one each)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = recipe.model
        rows = recipe.train.micro_batch_size * recipe.train.seq_length * m.moe.top_k // m.moe.num_experts
        a, b = torch.randn(rows, m.hidden_size), torch.randn(m.hidden_size, m.moe.ffn_hidden_size)
        a @ b
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2 * rows * m.hidden_size * m.moe.ffn_hidden_size / best
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_split_wgrad_exposes_what_plan_says_of_the_plain_steps_waits(tmp_path: Path) -> None:
    cases = [{"id": "plain", "recipe": RECIPE, "overrides": LAYOUT},
             {"id": "split", "recipe": RECIPE, "overrides": [*LAYOUT, SPLIT]}]
    out = run_ranks("measure_layouts", 2, {"cases": cases}, tmp_path, timeout=300)
    plain, split = (out[name]["report"]["exposed_comm"][KEY] for name in ("plain", "split"))
    measured = split["exposed_fraction"] / plain["exposed_fraction"]

    sets = ["launch.nodes=1", "launch.gpus_per_node=2"]
    recipe = load_recipe(RECIPE, [*LAYOUT, *sets], check_files=False)
    split_recipe = load_recipe(RECIPE, [*LAYOUT, SPLIT, *sets], check_files=False)
    ones = Assumptions(gemm_efficiency=1.0, grouped_gemm_efficiency=1.0, attention_efficiency=1.0,
                       nvlink_efficiency=1.0, network_efficiency=1.0)
    gemm = _gemm_flops_per_s(recipe)
    row = Hardware("this-cpu", "this machine", 1 << 40, gemm, 0.0, 1e10, 1.0, 1.0, 2, 2)
    link = estimate(recipe, row, ones).worst.comm.bus[KEY] / plain["waited_s"]  # bytes/s: the plain step's waits
    row = replace(row, nvlink_bytes_per_s=link)
    assert estimate(recipe, row, ones).exposed_comm[KEY].exposed_fraction == 1.0
    planned = estimate(split_recipe, row, ones)
    predicted = planned.exposed_comm[KEY].exposed_fraction
    assert 0 < planned.ep_phases.delayed_wgrad_s and predicted < 1.0
    assert predicted == pytest.approx(measured, abs=TOLERANCE), (predicted, measured, plain, split)
