"""FSDP2's cadences over a step's micro-batches (`parallel.param_gather`, `parallel.grad_reduce`): parameters
gathered once per step give bit for bit the results of gathering them for every micro-batch (the same values,
the same gradient sums), on real gloo ranks; gradients reduce-scattered after every micro-batch equal the
single reduction within fp32 rounding (another summation order). measure counts one all-gather per unit per
step (and one reduce-scatter per unit per micro-batch), exactly what plan says, and plan's memory for keeping a
step's parameters gathered is the stage's parameters in the compute dtype.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_cli
from helpers import BF16, FP32, GPU, assert_same_run, case, plan_against_measure
from multirank import run_ranks

from moe_train.config import load_recipe
from moe_train.measure.driver import Target, measure
from moe_train.plan.estimate import estimate, plan_json

PER_STEP = "parallel.param_gather=per_step"
REDUCE_EACH = "parallel.grad_reduce=per_microbatch"
MOE = FP32["qwen3-moe-tiny"]  # 4 micro-batches per rank at DP2


@pytest.mark.slow
def test_per_step_gathers_equal_per_microbatch_bit_for_bit_on_two_ranks(tmp_path: Path) -> None:
    cases = [
        case("fp32", "qwen3-moe-tiny", MOE),
        case("fp32-gather-per-step", "qwen3-moe-tiny", [*MOE, PER_STEP]),
        case("fp32-reduce-each", "qwen3-moe-tiny", [*MOE, REDUCE_EACH]),
        case("fp32-gather-per-step-reduce-each", "qwen3-moe-tiny", [*MOE, PER_STEP, REDUCE_EACH]),
        case("bf16", "qwen3-moe-tiny", [*BF16, "train.micro_batch_size=1"]),
        case("bf16-gather-per-step", "qwen3-moe-tiny", [*BF16, "train.micro_batch_size=1", PER_STEP]),
    ]
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "dp2")}, tmp_path,
                      timeout=420)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    for base, other in (("fp32", "fp32-gather-per-step"), ("bf16", "bf16-gather-per-step"),
                        ("fp32-reduce-each", "fp32-gather-per-step-reduce-each")):
        want, got = records[base], records[other]
        assert got["losses"] == want["losses"], other
        for section in ("grads", "state"):
            assert got[section].keys() == want[section].keys()
            for name, value in want[section].items():
                assert torch.equal(got[section][name], value), (other, section, name)
    # reduce-scattered after each micro-batch: the sum of per-micro-batch shards, not the shard of one sum
    assert_same_run(records["fp32-reduce-each"], records["fp32"])
    assert any(not torch.equal(records["fp32-reduce-each"]["grads"][name], value)
               for name, value in records["fp32"]["grads"].items()), "grad_reduce changed nothing"


def _dp2(*extra: str):
    return load_recipe("qwen3-moe-tiny", ["model.num_layers=2", "train.seq_length=32", "train.global_batch_size=8",
                                          "train.micro_batch_size=1", "train.precision=bf16",
                                          "launch.gpus_per_node=2", *extra], check_files=False)


@pytest.mark.slow
def test_measure_counts_the_cadences_plan_predicts(no_process_group) -> None:
    """DP2 bf16, 4 micro-batches per rank, 4 FSDP2 units (two blocks, their experts with them, the root):
    per micro-batch each unit is gathered for forward and again for backward (8 gathers a unit), per step once;
    gradients reduced once per step, or after each of the 4 backwards. Every key exact against plan."""
    units = 3
    calls, memory = {}, {}
    for label, extra in (("default", ()), ("per_step", (PER_STEP,)), ("reduce_each", (REDUCE_EACH,))):
        recipe = _dp2(*extra)
        report = measure(recipe, Target(fake=True))
        assert plan_against_measure(recipe, report, tolerance=0.0) == [], label
        calls[label] = (report["comm_calls"]["dp/all_gather"], report["comm_calls"]["dp/reduce_scatter"])
        memory[label] = plan_json(estimate(recipe, GPU))["memory_bytes"]["buffers"]
    assert calls == {"default": (units * 8, units), "per_step": (units, units), "reduce_each": (units * 8, units * 4)}
    # per_step holds the whole stage gathered in bf16 instead of two units (the prefetch working set) and the
    # unit being reduced; both hold the stage's unsharded fp32 gradients over the step, beyond the shards they
    # become at its end
    params = estimate(_dp2(PER_STEP), GPU).ranks[0].params
    stage = params.dense + params.experts
    assert memory["per_step"] - memory["default"] == pytest.approx(2 * stage - (2 * 2 + 4) * params.largest_unit)
    # reducing after every micro-batch holds the shards over the step, not the unsharded gradients
    assert memory["default"] - memory["reduce_each"] == pytest.approx(4 * (stage - params.local))


def test_cadences_that_cannot_run_are_refused(tmp_path: Path) -> None:
    assert_bad_input(run_cli("validate", "qwen3-moe-tiny", "--set", PER_STEP, "--set",
                             "parallel.reshard_after_forward=true"), "parallel.param_gather")
    # under pipelining the stages reduce in every backward (tests/test_pipeline.py): accepted
    assert run_cli("validate", "qwen3-moe-tiny", "--set", REDUCE_EACH, "--set", "parallel.pp=2",
                   "--set", "launch.gpus_per_node=2").code == 0
    # null reshard_after_forward follows the gather cadence
    assert not _dp2(PER_STEP).parallel.reshards_after_forward and _dp2().parallel.reshards_after_forward


@pytest.mark.slow
def test_pipelined_stages_reduce_every_backward_and_their_peak_falls_as_planned(no_process_group) -> None:
    """PP2 x FSDP2 dp2 (1F1B, bf16, 4 blocks a stage and its root unit, 4 micro-batches), both stages: under
    grad_reduce per_microbatch every stage backward reduce-scatters (4 per unit, plan's bytes exactly), and the
    step's peak falls by what plan says the buffers fall: the unsharded fp32 gradients held beyond the shards
    (4 (stage - local)) less one unit's as it reduces. Within 15%: measured, that unit is a block (its bf16
    gradient and fp32 reduce-scatter input), planned, the largest unit (here the vocabulary matrix)."""
    recipe = {cadence: _dp2("model.num_layers=8", "parallel.pp=2", "launch.gpus_per_node=4",
                            f"parallel.grad_reduce={cadence}") for cadence in ("per_step", "per_microbatch")}
    plan = {cadence: estimate(r, GPU) for cadence, r in recipe.items()}
    for rank, stage in ((0, 0), (2, 1)):
        peaks, totals = {}, {}
        for cadence in recipe:
            report = measure(recipe[cadence], Target(fake=True, rank=rank))
            planned = plan_json(plan[cadence], pipeline_rank=stage)
            assert plan_against_measure(recipe[cadence], report, tolerance=0.0, plan=planned) == [], (cadence, rank)
            reduces = {"per_step": 1, "per_microbatch": 4}[cadence]
            assert report["comm_calls"]["dp/reduce_scatter"] == 5 * reduces, (cadence, rank)
            peaks[cadence], totals[cadence] = report["peak_memory_bytes"], planned["memory_bytes"]["total"]
        params = plan["per_step"].ranks[stage].params
        planned_fall = totals["per_step"] - totals["per_microbatch"]
        assert planned_fall == pytest.approx(4 * (params.dense + params.experts - params.local)
                                             - 4 * params.largest_unit)
        assert peaks["per_step"] - peaks["per_microbatch"] == pytest.approx(planned_fall, rel=0.15), rank
