"""Overlapped micro-batches (`parallel.ep_overlap`): the forward of micro-batch i+1 and the backward of
micro-batch i run as a pair, taking turns at every expert-parallel collective, so each dispatch or combine of
one is issued before a compute phase of the other and waited on after it.

The schedule of a step with M micro-batches (pp = 1): F0 alone (warm-up), then for i = 0 .. M-2 the pair
(B_i, F_i+1), then B_M-1 alone (cool-down). Megatron-Core's combined 1F1B (`--overlap-moe-expert-parallel-comm`)
and DualPipe's overlapped F&B build the same pairing by cutting each layer into sub-module graphs and stepping
them by hand. Here the pair's two halves are the ordinary forward and the ordinary `loss.backward()`, each on
its own thread, and a baton lets exactly one of them run at a time: a half that issues a dispatch collective
(models/moe/dispatch_collectives.py: asynchronous, `async_op=True`) hands the baton to the other and waits on
its collective only when the baton comes back, i.e. after the other half has run the compute up to its own
next collective. So the phases of the MoE layer (attention and router / dispatch / experts / combine) are cut
at the collectives themselves, and the model, its autograd graph, FSDP2's hooks and activation recomputation
are the plain step's: the same ops on the same values, in the same order within each micro-batch, and each
parameter's gradient accumulates over the micro-batches in the plain order (B_i before B_i+1). The results are
the plain step's bit for bit (tests/test_ep_overlap.py).

Why threads and not generators or hand-cut graphs: a backward cannot be suspended half way except by blocking
the thread that runs it (the autograd engine runs a CPU backward on the calling thread), and cutting every
layer into per-phase graphs with detached boundaries would change how FSDP2 gathers and reduces and how
recomputation reruns. With the baton there is no parallel Python; the GIL and the baton together keep the
collectives' issue order identical on every rank, which gloo and NCCL need (collectives match by order).

On CPU (gloo) the collective runs on gloo's worker threads while the other half computes. On CUDA the
asynchronous NCCL collective runs on NCCL's own stream, `work.wait()` makes the compute stream wait for it, and
the two halves' kernels queue on the one compute stream in the baton's order (written against the CUDA facts
the project records in docs/gpu.md; not run on a GPU yet).

The turn-taking itself (the baton, the asynchronous issue, the ledger of wait times) is
models/moe/collective_turns.py, which the dispatchers call (a model never imports parallel/).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from moe_train.models.moe.collective_turns import Baton, turn_state


def run_pair(
    backward: Callable[[], None], forward: Callable[[], object], *, backward_micro_batch: int | str,
    forward_micro_batch: int | str,
) -> object:
    """Run `backward` (this thread, first) and `forward` (a helper thread) as one overlapped pair; returns what
    `forward` returns. An exception in either half is raised here once both have ended. The micro-batches label
    the halves in the recorded order: an index (pp = 1), or a stage's pass in torch's notation (`0F3`, dualpipev)."""
    baton = Baton()
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    # torch keeps dispatch modes and saved-tensor hooks per thread: the forward half runs under the caller's, so
    # what watches the step (measure's FLOP, traffic, live-bytes and saved-tensor counters) sees both halves
    modes = _get_current_dispatch_mode_stack()
    saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)

    def half(side: int, body: Callable[[], object], micro: int, partner: int) -> None:
        turn_state.pair, turn_state.micro_batch, turn_state.partner = (baton, side), micro, partner
        try:
            baton.wait_turn(side)
            with contextlib.ExitStack() as inherited:
                if side == 1:
                    for mode in modes:  # pushed, not entered again: a mode's __enter__ may patch globals once
                        _push_mode(mode)
                        inherited.callback(_pop_mode)
                    if saved_hooks is not None:
                        inherited.enter_context(torch.autograd.graph.saved_tensors_hooks(*saved_hooks))
                results[side] = body()
        except BaseException as error:  # noqa: BLE001 -- re-raised on the calling thread below
            errors.append(error)
        finally:
            turn_state.pair = turn_state.micro_batch = turn_state.partner = None
            baton.finish(side)

    helper = threading.Thread(
        target=half, args=(1, forward, forward_micro_batch, backward_micro_batch), name="ep-overlap-forward"
    )
    helper.start()
    half(0, backward, backward_micro_batch, forward_micro_batch)
    helper.join()
    if errors:
        raise errors[0]
    return results[1]


def overlapped_micro_batches(
    count: int,
    forward: Callable[[int], object],
    backward: Callable[[int, object], None],
) -> None:
    """The step's schedule: F0; (B_i, F_i+1) for i < count - 1; B_count-1. `forward(i)` returns what
    `backward(i, that)` differentiates."""
    turn_state.micro_batch = 0
    try:
        pending = forward(0)
    finally:
        turn_state.micro_batch = None
    for index in range(count - 1):
        done = pending
        pending = run_pair(
            lambda index=index, done=done: backward(index, done),
            lambda index=index: forward(index + 1),
            backward_micro_batch=index,
            forward_micro_batch=index + 1,
        )
    turn_state.micro_batch = count - 1
    try:
        backward(count - 1, pending)
    finally:
        turn_state.micro_batch = None
