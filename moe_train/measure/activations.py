"""Activation bytes: what one micro-batch's forward saves for backward, per decoder layer.

A `saved_tensors_hooks` pack hook sees every tensor autograd saves. Each is attributed to the layer whose
forward is running (LayerTracker) and counted by storage: a storage saved several times (a tensor and its
views, or the same input saved by two ops) counts once, at its full size, since that is what stays allocated.
Not activations, so not counted: parameters and views of them (FSDP2's gathered weights are the module's
parameters while it runs; tensor-parallel GEMMs use their local shards). A dtype copy of a weight that an op
saves (the router's fp32 copy of its bf16 weight) is memory held until backward: it counts.
`other` holds what belongs to no single layer: storages saved by several layers, the rotary tables (outputs
of `model.rope`) and boolean attention masks that every layer shares, and what the embedding, the final
norm, the output head and the loss save. Saves made during a backward pass (a recomputed region saving for
its own backward) are transient and not counted. The figures are those of the step's first micro-batch:
every micro-batch has the same shapes and saves the same bytes.

The peak (`activation_bytes_peak`) is the most of those saves alive at once during the step: autograd keeps
each save in a holder until the backward that uses it has run, and the holder's release is counted. Without a
pipeline one micro-batch's backward follows its forward, so the peak is about one micro-batch's total; a
pipeline stage holds the micro-batches its schedule keeps in flight (1F1B: pp - stage on the first stage).

Recomputation (torch.utils.checkpoint, non-reentrant): a checkpointed region keeps its inputs, saved through
the same hooks before the region runs, and nothing else (its own saves go to checkpoint's hooks, not ours,
and come back only in backward). A region inside a layer (selective recompute) keeps them while that layer
runs, so they count for it; a region of whole layers (full recompute) saves its inputs before its first layer
starts, so those saves wait for the next layer to start and count for it (`_CheckpointFrame.save_inputs` is
watched to tell them from the embedding's or the head's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import _CheckpointFrame

from moe_train.measure.layers import LayerTracker
from moe_train.models.autograd_phase import in_backward

OTHER = "other"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's memory is its local shard (tensor-parallel activations are saved as DTensors)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (the C++ StorageImpl), the same for every view of it."""
    return _local(tensor).untyped_storage()._cdata


def storage_bytes(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().nbytes()


def _is_parameter(tensor: object) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


# Autograd nodes of ops whose output aliases their input (views), and DTensor's to_local.
_ALIASING = frozenset({
    "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "AliasBackward0", "ExpandBackward0", "AsStridedBackward0", "SliceBackward0", "SelectBackward0",
    "UnbindBackward0", "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0", "_ToTorchTensorBackward",
})


def _views_a_parameter(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a parameter seen through views: tensor-parallel GEMMs run on the local shard of a
    DTensor weight (`to_local()`, then a transpose), which is a plain tensor whose `_base` is no Parameter; its
    autograd history leads to the parameter through aliasing ops only."""
    node = tensor.grad_fn
    while node is not None:
        if type(node).__name__ == "AccumulateGrad":
            return isinstance(node.variable, nn.Parameter)
        if type(node).__name__ not in _ALIASING:
            return False
        node = next((fn for fn, _ in node.next_functions if fn is not None), None)
    return False


def is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a parameter seen through views: memory that saving it for backward does not add (the
    offload pool, parallel/offload.py, leaves these on the device too)."""
    return _is_parameter(tensor) or _views_a_parameter(tensor)


@dataclass
class _Saved:
    bytes: int
    layers: set  # indices of the layers that saved it; None: saved outside every layer


class _Held:
    """What autograd keeps for one save: the tensor, and a call made when autograd lets go of it."""

    __slots__ = ("tensor", "_release")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]) -> None:
        self.tensor, self._release = tensor, release

    def __del__(self) -> None:
        self._release()


def _unpack(saved: torch.Tensor | _Held) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Held) else saved


class SavedTensorTracker:
    """Context manager around the step; `per_layer()` reads the first micro-batch's figures, `peak` the most
    saved bytes alive at once over the whole step (a pipeline stage holds several micro-batches' saves)."""

    def __init__(self, chunks: Sequence[nn.Module], layers: LayerTracker) -> None:
        self.layers = layers
        # Keyed by (micro-batch, storage): a storage freed by one micro-batch's backward may be reused by the next.
        self.saved: dict[tuple[tuple[int, int], int], _Saved] = {}
        self.shared: set[tuple[tuple[int, int], int]] = set()  # (micro-batch, storage), as `saved`
        self._weights = {storage_key(p) for chunk in chunks for p in chunk.parameters()}
        self._handles = [chunk.rope.register_forward_hook(self._rope_tables)
                         for chunk in chunks if hasattr(chunk, "rope")]
        self._handles += [m.register_forward_pre_hook(self._layer_starts) for m in layers.layers.values()]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saving_checkpoint_inputs = False
        self._pending: list[tuple[tuple[int, int], int]] = []  # checkpoint inputs saved outside every layer
        self._holders: dict[int, int] = defaultdict(int)  # storage -> saves of it not yet released
        self._live_sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _rope_tables(self, module: nn.Module, args: tuple, output: object) -> None:
        micro_batch = self.layers.micro_batch
        self.shared.update((micro_batch, storage_key(t)) for t in tree_leaves(output) if isinstance(t, torch.Tensor))

    def _layer_starts(self, module: nn.Module, args: tuple) -> None:
        """Attention masks among a layer's arguments (boolean, or the additive [b, 1, s, s] one: the only 4-D
        argument) are shared by every layer; checkpoint inputs saved before this layer started (a full-recompute
        group's input) are this layer's."""
        micro_batch = self.layers.micro_batch
        self.shared.update(
            (micro_batch, storage_key(t)) for t in args
            if isinstance(t, torch.Tensor) and (t.dtype == torch.bool or t.dim() == 4)
        )
        if self._pending and not in_backward():
            index = self.layers.stack[-1]
            for key in self._pending:
                layers = self.saved[key].layers
                layers.discard(None)
                layers.add(index)
            self._pending.clear()

    def _save_inputs(self, frame: _CheckpointFrame, *args) -> None:
        self._saving_checkpoint_inputs = True
        try:
            self._original_save_inputs(frame, *args)
        finally:
            self._saving_checkpoint_inputs = False

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Held:
        if in_backward() or _is_parameter(tensor):
            return tensor
        key = storage_key(tensor)
        if key in self._weights or _views_a_parameter(tensor):
            return tensor
        layer = self.layers.current
        entry = self.saved.get((self.layers.micro_batch, key))
        if entry is None:
            entry = self.saved[self.layers.micro_batch, key] = _Saved(storage_bytes(tensor), set())
        entry.layers.add(layer)
        if layer is None and self._saving_checkpoint_inputs:
            self._pending.append((self.layers.micro_batch, key))
        return self._hold(tensor, key)

    def _hold(self, tensor: torch.Tensor, key: int) -> _Held:
        """Count the storage live until autograd drops the last save of it (after the backward that used it)."""
        if self._holders[key] == 0:
            self._live_sizes[key] = storage_bytes(tensor)
            self.live += self._live_sizes[key]
            self.peak = max(self.peak, self.live)
        self._holders[key] += 1
        return _Held(tensor, partial(self._release, key))

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            self.live -= self._live_sizes.pop(key)

    def __enter__(self) -> SavedTensorTracker:
        self._original_save_inputs = _CheckpointFrame.save_inputs
        _CheckpointFrame.save_inputs = lambda frame, *args: self._save_inputs(frame, *args)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        _CheckpointFrame.save_inputs = self._original_save_inputs
        for handle in self._handles:
            handle.remove()

    def per_layer(self) -> dict[str, int]:
        """{layer index (str): bytes, ..., "other": bytes} for the first micro-batch."""
        out: dict[str, int] = defaultdict(int)
        for index in sorted(self.layers.layers):
            out[str(index)] = 0
        out[OTHER] = 0
        for (micro_batch, key), entry in self.saved.items():
            if micro_batch[1] != 1:  # each chunk's first micro-batch
                continue
            (layer,) = entry.layers if len(entry.layers) == 1 else (None,)
            out[OTHER if layer is None or (micro_batch, key) in self.shared else str(layer)] += entry.bytes
        return dict(out)
