"""Bytes held by the model and optimizer, and the step's peak memory.

On CUDA the peak is `torch.cuda.max_memory_allocated` over the step (the caching allocator's own count of
live tensor bytes). On CPU, and for fake tensors, which allocate nothing, `LiveBytes` counts the same thing
itself: a TorchDispatchMode registers the storage of every tensor an op returns, a weak reference with a
callback subtracts it when the storage is freed, in-place storage resizes (FSDP2 frees and refills its
gathered parameters so) adjust it, and the peak is the highest sum seen, starting from the storages alive when
the step begins (parameters, buffers, optimizer state). It counts tensor storages only:
no allocator rounding or caching, no framework workspaces, no Python objects, so it is a lower bound of what
a CUDA allocator would report and comparable across layouts. Activation offloading's host copies on a CPU (the
stand-in of pinned host buffers, parallel/offload.py) are not the device's: `in_host_memory` takes them out.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from moe_train.measure.dtensor import on_dtensors, sharding_propagation


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of a tensor (its local shard for a DTensor)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def param_bytes(model: nn.Module) -> int:
    return sum(local_bytes(p) for p in model.parameters())


def grad_bytes(model: nn.Module) -> int:
    return sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def gathered_param_bytes(model: nn.Module) -> int:
    """Bytes of FSDP2's gathered parameters, every unit's: each parameter's all-gather outputs as allocated at
    its first gather (the padded chunks of all shards, in the dtype gathered: one byte for the weights
    `train.fp8.fp8_all_gather` gathers in fp8), what a step whose units stay gathered holds; 0 without FSDP2
    or before a gather."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is not None:
            total += sum(t.numel() * t.element_size() for p in group.fsdp_params for t in p.all_gather_outputs)
    return total


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer state (AdamW: both moments and the step counters)."""
    return sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


class LiveBytes(TorchDispatchMode):
    """Peak of live tensor-storage bytes while active (see the module docstring)."""

    def __init__(self, alive: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}
        self.live = self.peak = 0
        for tensor in alive:
            self._track(tensor.to_local() if isinstance(tensor, DTensor) else tensor)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key not in self._refs:
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        # A storage seen again may have been resized in place (FSDP2 frees and refills its gathered weights).
        self.live += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= self._sizes.pop(key)

    def __enter__(self) -> LiveBytes:
        # FSDP2 frees and refills its gathered parameters by resizing their storage in place, which is not an
        # op: follow those resizes too, for the duration of the step.
        self._resize = torch.UntypedStorage.resize_
        live = self

        def resize(storage: torch.UntypedStorage, size: int):
            out = live._resize(storage, size)
            key = storage._cdata
            if key in live._sizes:
                live.live += storage.nbytes() - live._sizes[key]
                live._sizes[key] = storage.nbytes()
                live.peak = max(live.peak, live.live)
            return out

        torch.UntypedStorage.resize_ = resize
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if on_dtensors(types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if not sharding_propagation():
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._track(tensor)
        return out


def in_host_memory(tensor: torch.Tensor) -> None:
    """`tensor` stands for host memory, not the device's (parallel/offload.py's CPU pool): every active
    `LiveBytes` stops counting its storage, so measure's peak on a CPU is the device's, as on CUDA."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, LiveBytes):
            mode._free(tensor.untyped_storage()._cdata)
