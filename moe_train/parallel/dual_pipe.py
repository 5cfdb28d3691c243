"""The `dualpipev` pipeline schedule: torch's ScheduleDualPipeV with full backwards, and its overlapped
forward+backward actions run as pairs of `parallel.ep_overlap` (parallel/overlap.py `run_pair`).

DualPipeV (DeepSeek's DualPipe folded into a V: rank r holds stages r and 2 pp - 1 - r) fills its steady state
with OVERLAP_F_B actions, each the forward of one micro-batch on one of the rank's two stages and the full
backward of another micro-batch on the other stage. The two halves share no parameters and no data (torch
only pairs actions that do not depend on each other), so they can run interleaved. The plain schedule runs the
two sub-actions one after the other; under ep_overlap the function registered for OVERLAP_F_B runs them as one
overlapped pair, taking turns at every expert-parallel collective.

Full backwards: torch's DualPipeV splits some backwards into an input pass and a later weight pass (zero bubble
in its ramp-up and cool-down). Under FSDP2 (every world size here) the weight pass differentiates the sharded
parameters, not the gathered ones the forward used, so their gradients stay empty (config/support.py refuses
zero_bubble for the same reason). `DualPipeVFullBackward` keeps torch's order and runs each input pass as a full
backward where it stands, dropping the weight passes: a valid order (a weight pass only ever follows its input
pass), the same pairs, a slightly larger bubble in the ramps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FULL_BACKWARD,
    OVERLAP_F_B,
    ScheduleDualPipeV,
    _Action,
    _PipelineContext,
)

from moe_train.parallel.overlap import run_pair


class DualPipeVFullBackward(ScheduleDualPipeV):
    """torch's DualPipeV order with every backward a full one (see the module's docstring)."""

    def _calculate_single_rank_operations(self, rank: int) -> list[_Action | None]:
        def full(action: _Action | None) -> _Action | None:
            if action is not None and action.computation_type == BACKWARD_INPUT:
                return _Action(action.stage_index, FULL_BACKWARD, action.microbatch_index)
            return action

        return [full(action) for action in super()._calculate_single_rank_operations(rank)
                if action is None or action.computation_type != BACKWARD_WEIGHT]


def overlapped_pairs(schedule: ScheduleDualPipeV, rank: int) -> list[tuple[_Action, _Action]]:
    """The (forward, backward) sub-actions of each OVERLAP_F_B action pipeline rank `rank` runs, in order."""
    return [tuple(action.sub_actions) for action in schedule.pipeline_order[rank]
            if action is not None and action.computation_type == OVERLAP_F_B]


def label(action: _Action) -> str:
    """How the recorded order names a stage's micro-batch pass: torch's notation, e.g. `0F3`, `3B1`."""
    return repr(action)


def overlapped_forward_backward(schedule: ScheduleDualPipeV) -> Callable[[_Action, _PipelineContext], None]:
    """The function to register for OVERLAP_F_B: the runtime's forward and full-backward steps of the two
    sub-actions (torch's `_perform_action`, which a custom function cannot call), with the computes run as one
    overlapped pair. The inputs are awaited and the local V hand-offs made outside the pair, on this thread."""

    def run(action: _Action, ctx: _PipelineContext) -> None:
        forward, backward = action.sub_actions
        stages = {stage.stage_index: stage for stage in schedule._stages}
        f_stage, b_stage = stages[forward.stage_index], stages[backward.stage_index]
        f_mb, b_mb = forward.microbatch_index, backward.microbatch_index
        schedule._assert_unsharded(f_stage)
        schedule._assert_unsharded(b_stage)
        # the received activations and gradients (none where the neighbouring stage is on this rank: the V's tip)
        if not f_stage.is_first and forward.stage_index - 1 not in stages:
            for work in schedule.fwd_recv_ops.pop((forward.stage_index, f_mb)):
                work.wait()
        if not b_stage.is_last and backward.stage_index + 1 not in stages:
            for work in schedule.bwd_recv_ops.pop((backward.stage_index, b_mb)):
                work.wait()
        loss = schedule._maybe_get_loss(b_stage, b_mb)
        schedule.backward_counter[backward.stage_index] += 1
        last = schedule.backward_counter[backward.stage_index] == schedule._n_microbatches

        def run_backward() -> None:
            b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)

        def run_forward() -> torch.Tensor:
            output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb],
                                               save_forward_output=False)
            schedule._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
            return output

        if b_stage.has_backward:
            output = run_pair(run_backward, run_forward, backward_micro_batch=label(backward),
                              forward_micro_batch=label(forward))
        else:  # evaluation (the schedule's eval: forwards only, the backward a no-op), on this thread's grad mode
            output = run_forward()
        if forward.stage_index + 1 in stages:
            stages[forward.stage_index + 1].set_local_fwd_input(output, f_mb)
        if backward.stage_index - 1 in stages and b_stage.has_backward:
            stages[backward.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb), b_mb)

    return run


def skipped_backward(schedule: ScheduleDualPipeV) -> Callable[[_Action, _PipelineContext], None]:
    """The function for FULL_BACKWARD while the schedule evaluates (forwards only): torch's own step would hand
    the V's tip a backward output that was never made (`get_local_bwd_output` asserts). It only drops the
    (empty) receive the lowering placed before it, as the plain step's wait would."""

    def run(action: _Action, ctx: _PipelineContext) -> None:
        schedule.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)

    return run


@contextlib.contextmanager
def evaluating(schedule: ScheduleDualPipeV) -> Iterator[None]:
    """Run the schedule's `eval` inside: its backwards skipped, its overlapped actions forwards only."""
    functions = schedule._comp_type_to_function_map
    saved = dict(functions)
    functions[FULL_BACKWARD] = skipped_backward(schedule)
    functions[OVERLAP_F_B] = overlapped_forward_backward(schedule)
    try:
        yield
    finally:
        functions.clear()
        functions.update(saved)
