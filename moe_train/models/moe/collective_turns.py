"""Turn-taking at the expert-parallel collectives, for `parallel.ep_overlap` (parallel/overlap.py pairs the
micro-batches; this is the half the dispatchers call). Every dispatch collective is issued asynchronously through
`run_collective`; outside a pair it is waited on at once (the plain step), inside one the half that issued it
hands the baton to the other half and waits on its collective only when the baton comes back. It lives beside
the dispatchers because a model may not import parallel/: the dispatchers call it, the schedule drives it.

Measured overlap: every collective books, per process group and op, the time the compute thread spent on it
(`waited_s`: in the issuing call and in the wait) and its own time, issue to completion (`own_s`: gloo's
completion callback, or the wait's end); `comm_wait_times` reads the ledger by `<group>/<op>` (plan's and
measure's names). exposed_fraction = waited / own: about 1 for a blocking collective, below 1 where the paired
micro-batch's compute ran while it was in flight (`moe-train measure` reports it as `exposed_comm`,
docs/measure.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as dist

turn_state = threading.local()  # per half: the pair it belongs to, its side, its micro-batch; a deferred batch
_lock = threading.Lock()
_ledger: dict[tuple[dist.ProcessGroup, str], list[float]] = {}  # (group, op) -> [waited_s, own_s, count]
_events: list[tuple] | None = None  # the recorded order (tests): (event, kind, micro_batch, partner)


class Baton:
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
    group: dist.ProcessGroup
    work: dist.Work
    issued: float
    issue_s: float  # the compute thread's time in the issuing call itself (gloo and the dispatch modes' work)
    done: list[float]  # filled by the work's completion callback (gloo's thread), when it has one


def micro_batch() -> int | str | None:
    """The micro-batch this thread is running inside an overlapped pair (None outside one): its index, or under
    a pipeline the stage's pass (`0F3`: stage 0's forward of micro-batch 3)."""
    return getattr(turn_state, "micro_batch", None)


def record(event: str, kind: str) -> None:
    """Append (event, kind, micro-batch, the paired micro-batch or None) to the recorded order while `recording`
    is on (tests; nothing is kept off)."""
    if _events is not None:
        with _lock:
            _events.append((event, kind, micro_batch(), getattr(turn_state, "partner", None)))


@contextlib.contextmanager
def recording() -> Iterator[list[tuple]]:
    """Record the order of collectives issued, completed, and compute phases marked, inside the block."""
    global _events
    _events = []
    try:
        yield _events
    finally:
        _events = None


def run_collective(kind: str, issue: Callable[[], dist.Work], *, group: dist.ProcessGroup) -> None:
    """Issue an asynchronous collective (`issue` calls it with async_op=True) and wait on it, after handing the
    baton to the paired micro-batch when there is one. Inside `issued_together` the wait is deferred to the
    block's end. `kind` is the op (all_to_all, all_gather, reduce_scatter), `group` the one it runs over."""
    issued = _issue(kind, issue, group)
    batch = getattr(turn_state, "batch", None)
    if batch is not None:
        batch.append(issued)
    else:
        _settle([issued])


@contextlib.contextmanager
def issued_together(*, beside: Callable[[], None] | None = None) -> Iterator[None]:
    """Collectives issued inside are waited on together at the end: one hand-over for a dispatch's rows and
    their routing weights (which no compute separates). `beside`: compute that runs once they are issued, before
    the hand-over and the wait (the experts' delayed weight gradients, `parallel.split_wgrad`)."""
    outer, outer_beside = getattr(turn_state, "batch", None), getattr(turn_state, "beside", False)
    turn_state.batch, turn_state.beside = [], beside is not None
    try:
        yield
        batch = turn_state.batch
    finally:
        turn_state.batch, turn_state.beside = outer, outer_beside
    if beside is not None:
        beside()
    _settle(batch)


def _issue(kind: str, issue: Callable[[], dist.Work], group: dist.ProcessGroup) -> _Issued:
    issued = _Issued(kind, group, None, time.perf_counter(), 0.0, [])
    issued.work = issue()
    issued.issue_s = time.perf_counter() - issued.issued
    future = getattr(issued.work, "get_future", None)
    # the completion time where compute runs between the issue and the wait: the paired half's, or `beside`'s
    if future is not None and (turn_state_pair() is not None or getattr(turn_state, "beside", False)):
        with contextlib.suppress(RuntimeError):  # a backend without futures: completion is the wait's end
            future().add_done_callback(lambda _: issued.done.append(time.perf_counter()))
    record("issue", kind)
    return issued


def _settle(batch: list[_Issued]) -> None:
    if not batch:
        return
    pair = turn_state_pair()
    if pair is not None:
        record("hand_over", batch[0].kind)
        pair[0].hand_over(pair[1])
    for issued in batch:
        record("wait", issued.kind)  # the first moment this thread may block on it: after the pair's compute
        start = time.perf_counter()
        issued.work.wait()
        end = time.perf_counter()
        done = min(issued.done[0], end) if issued.done else end
        with _lock:
            entry = _ledger.setdefault((issued.group, issued.kind), [0.0, 0.0, 0])
            entry[0] += issued.issue_s + end - start  # the compute thread's time in the issue and the wait
            entry[1] += max(done - issued.issued, issued.issue_s + end - start)
            entry[2] += 1
        record("done", issued.kind)


def turn_state_pair() -> tuple[Baton, int] | None:
    return getattr(turn_state, "pair", None)


def comm_wait_times(name_group: Callable[[dist.ProcessGroup], str]) -> dict[str, dict[str, float]]:
    """Per `<group>/<op>` since the last reset (groups named by `name_group`, e.g. ParallelContext.group_name):
    seconds the compute thread spent issuing and waiting (`waited_s`), the collectives' own seconds, issue to
    completion (`own_s`), their count, and exposed_fraction = waited / own, in [0, 1] (waited is part of own by
    construction)."""
    totals: dict[str, list[float]] = {}
    with _lock:
        for (group, op), (waited, own, count) in _ledger.items():
            entry = totals.setdefault(f"{name_group(group)}/{op}", [0.0, 0.0, 0])
            entry[0], entry[1], entry[2] = entry[0] + waited, entry[1] + own, entry[2] + count
    return {
        kind: {"own_s": own, "waited_s": waited, "count": int(count), "exposed_fraction": waited / own if own else 1.0}
        for kind, (waited, own, count) in sorted(totals.items())
    }


def reset_comm_wait_times() -> None:
    with _lock:
        _ledger.clear()
