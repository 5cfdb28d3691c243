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

Measured overlap: every dispatch collective books, per kind, the time the compute thread waited on it
(`waited_s`) and its own time, issue to completion (`comm_s`); `comm_wait_times` reads the ledger (`moe-train
measure` reports it, docs/measure.md). exposed = waited / comm: 1 for a blocking collective, below 1 where the
paired micro-batch's compute ran while it was in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as dist

_local = threading.local()  # per half: the pair it belongs to, its side, its micro-batch; a deferred batch
_lock = threading.Lock()
_ledger: dict[str, list[float]] = {}  # kind -> [waited_s, comm_s, count]
_events: list[tuple] | None = None  # the recorded order (tests): (event, kind, micro_batch, partner)


class _Baton:
    """Two halves take turns: `turn` says which may run; a finished half never takes it back."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.finished = [False, False]

    def wait_turn(self, side: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == side)

    def hand_over(self, side: int) -> None:
        """Let the other half run until it hands back (or ends); a no-op once the other has ended."""
        with self.cond:
            if self.finished[1 - side]:
                return
            self.turn = 1 - side
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == side)

    def finish(self, side: int) -> None:
        with self.cond:
            self.finished[side] = True
            self.turn = 1 - side
            self.cond.notify_all()


@dataclass
class _Issued:
    kind: str
    work: dist.Work
    issued: float
    done: list[float]  # filled by the work's completion callback (gloo's thread), when it has one


def micro_batch() -> int | None:
    """The micro-batch this thread is running inside an overlapped pair (None outside one)."""
    return getattr(_local, "micro_batch", None)


def record(event: str, kind: str) -> None:
    """Append (event, kind, micro-batch, the paired micro-batch or None) to the recorded order while `recording`
    is on (tests; nothing is kept off)."""
    if _events is not None:
        with _lock:
            _events.append((event, kind, micro_batch(), getattr(_local, "partner", None)))


@contextlib.contextmanager
def recording() -> Iterator[list[tuple]]:
    """Record the order of collectives issued, completed, and compute phases marked, inside the block."""
    global _events
    _events = []
    try:
        yield _events
    finally:
        _events = None


def run_collective(kind: str, issue: Callable[[], dist.Work]) -> None:
    """Issue an asynchronous collective (`issue` calls it with async_op=True) and wait on it, after handing the
    baton to the paired micro-batch when there is one. Inside `issued_together` the wait is deferred to the
    block's end."""
    issued = _issue(kind, issue)
    batch = getattr(_local, "batch", None)
    if batch is not None:
        batch.append(issued)
    else:
        _settle([issued])


@contextlib.contextmanager
def issued_together() -> Iterator[None]:
    """Collectives issued inside are waited on together at the end: one hand-over for a dispatch's rows and
    their routing weights (which no compute separates)."""
    outer = getattr(_local, "batch", None)
    _local.batch = []
    try:
        yield
        batch = _local.batch
    finally:
        _local.batch = outer
    _settle(batch)


def _issue(kind: str, issue: Callable[[], dist.Work]) -> _Issued:
    issued = _Issued(kind, None, time.perf_counter(), [])
    issued.work = issue()
    future = getattr(issued.work, "get_future", None)
    if future is not None and _local_pair() is not None:
        with contextlib.suppress(RuntimeError):  # a backend without futures: completion is the wait's end
            future().add_done_callback(lambda _: issued.done.append(time.perf_counter()))
    record("issue", kind)
    return issued


def _settle(batch: list[_Issued]) -> None:
    if not batch:
        return
    pair = _local_pair()
    if pair is not None:
        record("hand_over", batch[0].kind)
        pair[0].hand_over(pair[1])
    for issued in batch:
        start = time.perf_counter()
        issued.work.wait()
        end = time.perf_counter()
        done = min(issued.done[0], end) if issued.done else end
        with _lock:
            entry = _ledger.setdefault(issued.kind, [0.0, 0.0, 0])
            entry[0] += end - start
            entry[1] += max(done - issued.issued, end - start)
            entry[2] += 1
        record("done", issued.kind)


def _local_pair() -> tuple[_Baton, int] | None:
    return getattr(_local, "pair", None)


def comm_wait_times() -> dict[str, dict[str, float]]:
    """Per collective kind since the last reset: seconds the compute thread waited (`waited_s`), the
    collectives' own seconds, issue to completion (`comm_s`), their count, and exposed = waited / comm."""
    with _lock:
        return {
            kind: {
                "waited_s": waited,
                "comm_s": comm,
                "count": int(count),
                "exposed": waited / comm if comm > 0 else 1.0,
            }
            for kind, (waited, comm, count) in sorted(_ledger.items())
        }


def reset_comm_wait_times() -> None:
    with _lock:
        _ledger.clear()


def run_pair(
    backward: Callable[[], None], forward: Callable[[], object], *, backward_micro_batch: int, forward_micro_batch: int
) -> object:
    """Run `backward` (this thread, first) and `forward` (a helper thread) as one overlapped pair; returns what
    `forward` returns. An exception in either half is raised here once both have ended."""
    baton = _Baton()
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def half(side: int, body: Callable[[], object], micro: int, partner: int) -> None:
        _local.pair, _local.micro_batch, _local.partner = (baton, side), micro, partner
        try:
            baton.wait_turn(side)
            results[side] = body()
        except BaseException as error:  # noqa: BLE001 -- re-raised on the calling thread below
            errors.append(error)
        finally:
            _local.pair = _local.micro_batch = _local.partner = None
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
    _local.micro_batch = 0
    try:
        pending = forward(0)
    finally:
        _local.micro_batch = None
    for index in range(count - 1):
        done = pending
        pending = run_pair(
            lambda index=index, done=done: backward(index, done),
            lambda index=index: forward(index + 1),
            backward_micro_batch=index,
            forward_micro_batch=index + 1,
        )
    _local.micro_batch = count - 1
    try:
        backward(count - 1, pending)
    finally:
        _local.micro_batch = None
