"""Counting DTensor ops on this rank's shards.

A TorchDispatchMode sees an op on DTensors once, with global shapes, and not the local ops and collectives
DTensor then runs out of its sight. Each counter of `measure` therefore passes DTensor ops on (returns
NotImplemented): DTensor runs them with the modes still active, so the counters see what this rank executes,
local shards and implicit redistributions included. DTensor's sharding propagation also runs ops, on fake
tensors of the global shapes, to derive output metadata; those compute nothing and `sharding_propagation()`
flags them so the counters skip them (the flag is set by a wrapper installed by `local_dtensor_ops()` around
the measured step, and removed after it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

_state = threading.local()


def on_dtensors(types: tuple[type, ...]) -> bool:
    """Whether a dispatched op has DTensor arguments (the counters then return NotImplemented)."""
    return any(issubclass(t, DTensor) for t in types)


def sharding_propagation() -> bool:
    """Whether the running op is DTensor's metadata propagation (global shapes, nothing executed)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def local_dtensor_ops() -> Iterator[None]:
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def flagged(self, *args, **kwargs):
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = flagged
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
