"""Turn-taking at the expert-parallel collectives, for `parallel.ep_overlap` (parallel/overlap.py pairs the
micro-batches; this is the half the dispatchers call). Every dispatch collective is issued asynchronously through
`run_collective`; outside a pair it is waited on at once (the plain step), inside one the half that issued it
hands the baton to the other half and waits on its collective only when the baton comes back. It lives beside
the dispatchers because a model may not import parallel/: the dispatchers call it, the schedule drives it.

Measured overlap: every collective books, per kind, the time the compute thread waited on it (`waited_s`) and
its own time, issue to completion (`comm_s`); `comm_wait_times` reads the ledger. exposed = waited / comm: 1 for
a blocking collective, below 1 where the paired micro-batch's compute ran while it was in flight.
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
_ledger: dict[str, list[float]] = {}  # kind -> [waited_s, comm_s, count]
_events: list[tuple] | None = None  # the recorded order (tests): (event, kind, micro_batch)


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
    work: dist.Work
    issued: float
    done: list[float]  # filled by the work's completion callback (gloo's thread), when it has one


def micro_batch() -> int | None:
    """The micro-batch this thread is running inside an overlapped pair (None outside one)."""
    return getattr(turn_state, "micro_batch", None)


def record(event: str, kind: str) -> None:
    """Append (event, kind, micro-batch) to the recorded order while `recording` is on (tests, no cost off)."""
    if _events is not None:
        with _lock:
            _events.append((event, kind, micro_batch()))


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
    batch = getattr(turn_state, "batch", None)
    if batch is not None:
        batch.append(issued)
    else:
        _settle([issued])


@contextlib.contextmanager
def issued_together() -> Iterator[None]:
    """Collectives issued inside are waited on together at the end: one hand-over for a dispatch's rows and
    their routing weights (which no compute separates)."""
    outer = getattr(turn_state, "batch", None)
    turn_state.batch = []
    try:
        yield
        batch = turn_state.batch
    finally:
        turn_state.batch = outer
    _settle(batch)


def _issue(kind: str, issue: Callable[[], dist.Work]) -> _Issued:
    issued = _Issued(kind, None, time.perf_counter(), [])
    issued.work = issue()
    future = getattr(issued.work, "get_future", None)
    if future is not None and turn_state_pair() is not None:
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


def turn_state_pair() -> tuple[Baton, int] | None:
    return getattr(turn_state, "pair", None)


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


