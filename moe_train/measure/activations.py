"""Activation bytes: what one micro-batch's forward saves for backward, per decoder layer.

A `saved_tensors_hooks` pack hook sees every tensor autograd saves. Each is attributed to the layer whose
forward is running (LayerTracker) and counted by storage: a storage saved several times (a tensor and its
views, or the same input saved by two ops) counts once, at its full size, since that is what stays allocated.
Not activations, so not counted: parameters, views of parameters, and copies of parameters made by a dtype
cast (autocast's bf16 weights) or gathered by FSDP (registered as the module's parameters while it runs).
`other` holds what belongs to no single layer: storages saved by several layers, the rotary tables (outputs
of `model.rope`) and boolean attention masks that every layer shares, and what the embedding, the final
norm, the output head and the loss save. Saves made during a backward pass (a recomputed region saving for
its own backward) are transient and not counted. The figures are those of the step's first micro-batch:
every micro-batch has the same shapes and saves the same bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moe_train.measure.dtensor import on_dtensors
from moe_train.measure.layers import LayerTracker, in_backward

OTHER = "other"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's memory is its local shard (tensor-parallel activations are saved as DTensors)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (the C++ StorageImpl), the same for every view of it."""
    return _local(tensor).untyped_storage()._cdata


def storage_bytes(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().nbytes()


class ParameterCopies(TorchDispatchMode):
    """Marks the storages that dtype casts of parameters produce (autocast's weight copies): not activations."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if on_dtensors(types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and _is_parameter(args[0]):
            self.keys.add(storage_key(out))
        return out


def _is_parameter(tensor: object) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


@dataclass
class _Saved:
    bytes: int
    layers: set  # indices of the layers that saved it; None: saved outside every layer


class SavedTensorTracker:
    """Context manager around the step; `per_layer()` reads the first micro-batch's figures."""

    def __init__(self, model: nn.Module, layers: LayerTracker) -> None:
        self.layers = layers
        # Keyed by (micro-batch, storage): a storage freed by one micro-batch's backward may be reused by the next.
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.shared: set[tuple[int, int]] = set()  # (micro-batch, storage), as `saved`
        self.copies = ParameterCopies()
        self._weights = {storage_key(p) for p in model.parameters()}
        self._handles = [model.rope.register_forward_hook(self._rope_tables)] if hasattr(model, "rope") else []
        self._handles += [m.register_forward_pre_hook(self._masks) for m in layers.layers.values()]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _rope_tables(self, module: nn.Module, args: tuple, output: object) -> None:
        micro_batch = self.layers.model_forwards
        self.shared.update((micro_batch, storage_key(t)) for t in tree_leaves(output) if isinstance(t, torch.Tensor))

    def _masks(self, module: nn.Module, args: tuple) -> None:
        micro_batch = self.layers.model_forwards
        self.shared.update(
            (micro_batch, storage_key(t)) for t in args if isinstance(t, torch.Tensor) and t.dtype == torch.bool
        )

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if in_backward() or _is_parameter(tensor):
            return tensor
        key = storage_key(tensor)
        if key in self._weights or key in self.copies.keys:
            return tensor
        layer = self.layers.current
        entry = self.saved.get((self.layers.model_forwards, key))
        if entry is None:
            entry = self.saved[self.layers.model_forwards, key] = _Saved(storage_bytes(tensor), set())
        entry.layers.add(layer)
        return tensor

    def __enter__(self) -> SavedTensorTracker:
        self.copies.__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self.copies.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    def per_layer(self) -> dict[str, int]:
        """{layer index (str): bytes, ..., "other": bytes} for the first micro-batch."""
        out: dict[str, int] = defaultdict(int)
        for index in sorted(self.layers.layers):
            out[str(index)] = 0
        out[OTHER] = 0
        for (micro_batch, key), entry in self.saved.items():
            if micro_batch != 1:
                continue
            (layer,) = entry.layers if len(entry.layers) == 1 else (None,)
            out[OTHER if layer is None or (micro_batch, key) in self.shared else str(layer)] += entry.bytes
        return dict(out)
