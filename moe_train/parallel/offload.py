"""Activation offloading (`parallel.offload.modules`): the tensors that named regions save for backward leave the
device after their layer's forward and come back ahead of its backward, so a layer's saves occupy host memory
instead of device memory between the two. Nothing is computed again: the same values come back, bit for bit.

Regions are the recompute policy's module names (parallel/recompute.py), wrapped the same way: core_attn (SDPA),
layernorm (the block's two norms), mla_up_proj (MLA's up projections, rotary embeddings and attention), mlp (dense
MLPs), moe_act (the routed experts' SwiGLU), moe (the whole MoE layer), shared_experts. A region inside another
offloaded one is not wrapped again. A region is recomputed or offloaded, never both (validate refuses it).

The mechanism is `torch.autograd.graph.saved_tensors_hooks` around each region: its pack hook hands autograd a
handle and keeps the tensor in the layer's group of the pool; when the layer's forward returns the group is
flushed, its storages copied to host buffers and the device references dropped; the first unpack of a group in
backward brings it back (and starts bringing back the layer before it, which backward needs next). A storage is
copied once, whatever number of views of it the region saved (gate and up are views of one output), and views
come back as views of one buffer.

What is never copied, because offloading it would free nothing:
- parameters and views of them (FSDP2's gathered weights, a tensor-parallel GEMM's local shard seen through a
  transpose), told at pack time as measure tells them (measure/activations.py `is_weight`);
- storages something else still holds when the layer's forward returns: a save outside the offloaded regions (an
  FP8 GEMM's kept input that a GEMM outside reads too; a region's input that the next op keeps as well), seen by the
  layer's own outer hooks, which record every storage saved outside the regions; another tensor on the same
  storage (a view held elsewhere: the storage's use count); or the same tensor object held by Python (the rotary
  tables and the attention mask every layer shares, the layer's arguments). Those go to whatever saved-tensor hooks
  surround the layer (measure's tracker, or none), exactly as if no region had hooks.

On CUDA the host buffers are pinned and the copies run on a side stream: out after the layer's forward (the
device memory is released to the caching allocator once the copy has run: `record_stream`), back when backward
first needs the layer or the layer after it (an event orders the compute stream after the copy). On a CPU the
"host" is a separate buffer pool, copied synchronously (and left out of measure's peak, as host memory is on
CUDA), so the mechanism runs and is tested here; the stream
path is written against torch's documented CUDA stream, event and pinned-memory APIs and runs only on a GPU.

An offloaded region runs eagerly inside a compiled block (train.compile): its saves must pass through the hooks,
which a compiled graph's saves do not.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from moe_train.measure.activations import is_weight
from moe_train.measure.memory import in_host_memory
from moe_train.models.autograd_phase import in_backward
from moe_train.models.decoder import DecoderBlock
from moe_train.models.mla import MLA
from moe_train.parallel.layout import wrap_region

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.layout_region import LayoutRegion
    from moe_train.models.model import Transformer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _storage_key(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage()._cdata


class _Entry:
    """One saved storage: on the device until its group is flushed, then a host buffer, then (in backward) a
    device buffer again."""

    __slots__ = ("tensor", "host", "device", "nbytes", "pool", "__weakref__")

    def __init__(self, tensor: torch.Tensor, pool: OffloadPool) -> None:
        self.tensor, self.host, self.device, self.pool = tensor, None, None, pool
        self.nbytes = tensor.untyped_storage().nbytes()

    def __del__(self) -> None:
        if self.host is not None:
            self.pool.host_bytes -= self.nbytes


class _Handle:
    """What autograd keeps for one save: the entry and the view of its storage the save was, or (kept on the
    device) what the hooks outside the region made of it."""

    __slots__ = ("group", "entry", "tensor", "dtype", "size", "stride", "offset", "spec", "requires_grad", "outer")

    def __init__(self, group: _Group, entry: _Entry, tensor: torch.Tensor) -> None:
        local = _local(tensor)
        self.group, self.entry, self.tensor = group, entry, tensor
        self.dtype, self.size, self.stride, self.offset = (
            local.dtype,
            local.shape,
            local.stride(),
            local.storage_offset(),
        )
        self.spec = tensor._spec if isinstance(tensor, DTensor) else None
        self.requires_grad = tensor.requires_grad
        self.outer = None


class _Group:
    """One layer's forward: its saves, in the order packed, and the layer backward reaches after it."""

    __slots__ = ("layer", "previous", "entries", "handles", "stored", "offloaded", "fetched", "outer")

    def __init__(self, layer: int, previous: _Group | None) -> None:
        self.layer, self.previous = layer, previous
        self.entries: dict[int, _Entry] = {}  # by storage, until the flush
        self.handles: list[_Handle] = []
        self.stored: list[weakref.ref] = []  # the entries on the host (autograd's handles keep them alive)
        self.offloaded = self.fetched = None  # CUDA events (None on a CPU, and before the copy)
        self.outer: tuple[Callable, Callable] | None = None  # the saved-tensor hooks around the layer

    def pending(self) -> list[_Entry]:
        """The entries still on the host whose saves autograd has not released."""
        entries = (ref() for ref in self.stored)
        return [e for e in entries if e is not None and e.device is None]


class _Outer:
    """A save the layer's outer hooks packed (`packed`: their object, or the tensor where there were none)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, tensor: torch.Tensor, hooks: tuple[Callable, Callable] | None) -> None:
        self.packed = hooks[0](tensor) if hooks else tensor
        self.unpack = hooks[1] if hooks else None

    def get(self) -> torch.Tensor:
        return self.unpack(self.packed) if self.unpack else self.packed


class OffloadPool:
    """The host pool of one model chunk. `host_bytes`: what it holds now; `offloaded_bytes_per_layer`: what the
    first forward pass moved to it, layer by layer (measure reports it beside the device-resident bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.host_bytes = 0
        self.passes = 0
        self.offloaded_bytes_per_layer: dict[int, int] = {}
        self._last: _Group | None = None
        self._group: _Group | None = None
        self._saved_outside: set[int] = set()

    # ---------------------------------------------------------------------------------------- forward

    def start_pass(self, *_) -> None:
        """A forward pass of the chunk begins (a forward pre-hook): a new chain of layers, a new record of the
        storages saved outside the regions."""
        if not in_backward() and torch.is_grad_enabled():
            self.passes += 1
            self._last = None
            self._saved_outside.clear()

    def run_layer(self, layer: int, forward: Callable, *args, **kwargs):
        """`forward` of decoder block `layer`, its regions' saves gathered in a group and flushed after it."""
        group = self._group = _Group(layer, self._last)
        self._last = group
        group.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_outside, _Outer.get):
                out = forward(*args, **kwargs)
        finally:
            self._group = None
        self._flush(group)
        return out

    def _pack_outside(self, tensor: torch.Tensor) -> _Outer:
        """A save of the layer outside the regions: recorded (its storage stays on the device), then packed by
        the hooks around the layer."""
        self._saved_outside.add(_storage_key(tensor))
        return _Outer(tensor, self._group.outer if self._group else None)

    def region(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Handle | _Outer:
        group = self._group
        if group is None or in_backward() or is_weight(tensor):
            return _Outer(tensor, group.outer if group else None)
        key = _storage_key(tensor)
        entry = group.entries.get(key)
        if entry is None:
            entry = group.entries[key] = _Entry(_local(tensor), self)
        handle = _Handle(group, entry, tensor)
        group.handles.append(handle)
        return handle

    def _held_elsewhere(self, key: int, entry: _Entry, handles: list[_Handle]) -> bool:
        """Whether offloading `entry` would free nothing: see the module docstring."""
        if key in self._saved_outside:
            return True
        # storage references: each distinct tensor of ours on it (the entry's, the saves' local tensors) and the
        # Python storage object made here
        locals_ = {id(_local(h.tensor)) for h in handles} | {id(entry.tensor)}
        if torch._C._storage_Use_Count(entry.tensor.untyped_storage()._cdata) > len(locals_) + 1:
            return True
        for tensor in {id(h.tensor): h.tensor for h in handles}.values():
            # Python references of ours: each handle's, the entry's, this loop's dict and variable, getrefcount's
            ours = sum(h.tensor is tensor for h in handles) + (entry.tensor is tensor) + 3
            if sys.getrefcount(tensor) > ours:
                return True
        return False

    def _flush(self, group: _Group) -> None:
        """After the layer's forward: each storage to the host, or (held elsewhere) to the hooks outside."""
        by_entry: dict[int, list[_Handle]] = {}
        for handle in group.handles:
            by_entry.setdefault(id(handle.entry), []).append(handle)
        moved = 0
        for key, entry in group.entries.items():
            handles = by_entry[id(entry)]
            if self._held_elsewhere(key, entry, handles):
                for handle in handles:
                    handle.outer, handle.entry = _Outer(handle.tensor, group.outer), None
            else:
                self._to_host(entry)
                group.stored.append(weakref.ref(entry))
                moved += entry.nbytes
            for handle in handles:
                handle.tensor = None
            entry.tensor = None
        if self.cuda and moved:
            group.offloaded = torch.cuda.Event()
            group.offloaded.record(self.stream)
        group.entries, group.handles, group.outer = {}, [], None
        if self.passes == 1:
            self.offloaded_bytes_per_layer[group.layer] = self.offloaded_bytes_per_layer.get(group.layer, 0) + moved

    def _to_host(self, entry: _Entry) -> None:
        source = _bytes(entry.tensor)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(source.device))
            host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(self.stream):
                host.copy_(source, non_blocking=True)
            source.record_stream(self.stream)  # its memory is reused only after the copy has run
        else:
            host = source.clone()
            in_host_memory(host)  # measure's peak counts the device's memory only
        entry.host = host
        self.host_bytes += entry.nbytes

    # --------------------------------------------------------------------------------------- backward

    def _fetch(self, group: _Group) -> None:
        """Bring every entry of `group` still on the host back to the device."""
        entries = group.pending()
        if not entries:
            return
        if self.cuda:
            device = torch.device("cuda", torch.cuda.current_device())
            with torch.cuda.stream(self.stream):
                if group.offloaded is not None:
                    self.stream.wait_event(group.offloaded)
                for entry in entries:
                    entry.device = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
                    entry.device.copy_(entry.host, non_blocking=True)
            group.fetched = torch.cuda.Event()
            group.fetched.record(self.stream)
        else:
            for entry in entries:
                entry.device = entry.host.clone()

    def _unpack(self, saved: _Handle | _Outer) -> torch.Tensor:
        if isinstance(saved, _Outer):
            return saved.get()
        if saved.outer is not None:
            return saved.outer.get()
        entry, group = saved.entry, saved.group
        if entry.device is None:
            self._fetch(group)
            if group.previous is not None:  # the layer backward needs next: its copy runs while this one computes
                self._fetch(group.previous)
        if self.cuda:
            current = torch.cuda.current_stream()
            if group.fetched is not None:
                current.wait_event(group.fetched)
            entry.device.record_stream(current)  # allocated on the side stream, read on this one
        view = entry.device.view(saved.dtype).as_strided(saved.size, saved.stride, saved.offset)
        if saved.spec is not None:
            return DTensor(view, saved.spec, requires_grad=saved.requires_grad)
        return view


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor`, as bytes (what is copied: every view of it comes back). A strided view
    from the storage's start, not `set_`: under measure's fake tensors a tensor `set_` to a storage kept that
    storage alive after both were dropped, so the moved saves stayed in measure's peak."""
    elements = tensor.untyped_storage().nbytes() // tensor.element_size()
    return tensor.detach().as_strided((elements,), (1,), 0).view(torch.uint8)


def _in_region(fn: Callable, pool: OffloadPool) -> Callable:
    @torch.compiler.disable
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with pool.region():
            return fn(*args, **kwargs)

    return run


def _offload(region: LayoutRegion, name: str, pool: OffloadPool) -> None:
    """The module's declared region (models/layout_region.py) inside the pool's hooks."""
    wrap_region(region, functools.partial(_in_region, pool=pool), reason=f"offload {name}")


def _regions(block: DecoderBlock, modules: set[str], pool: OffloadPool) -> None:
    """The named regions of `block`, as parallel/recompute.py's `_selective` wraps them."""
    attn = block.self_attn
    if isinstance(attn, MLA) and "mla_up_proj" in modules:
        _offload(attn.layout_up_attend, "mla_up_proj", pool)
    elif "core_attn" in modules:
        _offload(attn.core_attention.layout_forward, "core_attn", pool)
    if "layernorm" in modules:
        _offload(block.input_layernorm.layout_forward, "layernorm", pool)
        _offload(block.post_attention_layernorm.layout_forward, "layernorm", pool)
    if not block.is_moe:
        if "mlp" in modules:
            _offload(block.ffn.layout_forward, "mlp", pool)
        return
    if "moe" in modules:
        _offload(block.ffn.layout_forward, "moe", pool)
        return
    if "moe_act" in modules:
        _offload(block.ffn.experts.layout_activation, "moe_act", pool)
    if "shared_experts" in modules and block.ffn.shared_experts is not None:
        _offload(block.ffn.shared_experts.layout_forward, "shared_experts", pool)


def _one_pass(forward: Callable, *, pool: OffloadPool) -> Callable:
    """A decoder block's forward (module first) as one pass of the pool: its regions' saves in one group,
    flushed when it returns; a forward without autograd, or rerun in backward, stores nothing."""

    @functools.wraps(forward)
    def run(block: DecoderBlock, *args, **kwargs):
        if in_backward() or not torch.is_grad_enabled():
            return forward(block, *args, **kwargs)
        return pool.run_layer(block.layer_index, forward, block, *args, **kwargs)

    return run


def _layer(block: DecoderBlock, pool: OffloadPool) -> None:
    wrap_region(block.layout_forward, functools.partial(_one_pass, pool=pool), reason="offload layer pass")


def apply_offload(model: Transformer, recipe: Recipe, device: torch.device) -> None:
    """Offload the recipe's regions of every decoder block of `model` (MTP blocks included) to `model.offload_pool`."""
    modules = set(recipe.parallel.offload.modules)
    if not modules:
        return
    pool = model.offload_pool = OffloadPool(device)
    model.register_forward_pre_hook(pool.start_pass)
    for block in model.modules():
        if isinstance(block, DecoderBlock):
            _regions(block, modules, pool)
            _layer(block, pool)
