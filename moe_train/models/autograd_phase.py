"""Which pass is running: the one place that answers "is this a backward?" and "is this a recomputation?".

A MoE layer must not count its telemetry or run its balancing-loss collectives twice when activation
checkpointing runs it again in backward; `moe-train measure` books each op to forward, backward or recompute.
Both ask here. `in_recomputation` is true exactly while a checkpointed region runs again: parallel/recompute.py
enters `recomputation()` through checkpoint's recompute context, the only path by which a forward reruns.
`in_backward` is true for every op the autograd engine runs on this thread, recomputation included.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_state = threading.local()


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (recomputation included)."""
    return torch._C._current_graph_task_id() != -1


def in_recomputation() -> bool:
    """Whether a checkpointed region is running again (in backward) on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """Mark the code inside as a recomputation (checkpoint's recompute context; nests)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
