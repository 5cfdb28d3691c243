"""Fake CUDA on a CPU-only torch: run the engine's CUDA branches through torch's real meta kernels.

Under `FakeTensorMode` a tensor made with device="cuda" is a fake CUDA tensor, and each op on it runs the op's
meta kernel: the dtype, shape and stride checks torch's CUDA kernels make (torch._scaled_mm's row/column-major
and multiple-of-16 rules, torch._scaled_grouped_mm's e4m3-only rule, torch._grouped_mm's 16-byte strides), with
no storage and no device. What a CPU-only build of torch (2.13) lacks for that, and `fake_cuda` stands in for,
only while the block runs:

- a CUDA device guard: the Python bindings of `Tensor.__getitem__`, `__setitem__`, `contiguous`, `__invert__`
  and a `to` onto CUDA take one before dispatching ("PyTorch is not linked with support for cuda devices";
  FakeTensorMode's own stand-in, `_ensureCUDADeviceGuardSet`, applies to a CUDA build without a device only).
  Those methods are re-expressed on CUDA tensors through `torch.ops.aten` (slice, select, unsqueeze, index,
  copy_, index_put_, clone, bitwise_not, _to_copy), which dispatch without the guard; every other tensor and
  every other method goes through torch's own code;
- `torch.cuda`'s device queries (`get_device_capability`: the capability the test asks for, `get_device_name`),
  `synchronize`, and streams and events (`Stream`, `Event`, `current_stream`, `stream`, `Tensor.record_stream`):
  stand-ins that keep a log of what waited on what, so a test can check the order a side stream is joined in.

What cannot be stood in for: autograd. Recording a graph on a fake CUDA tensor makes autograd take the device's
stream (`InputMetadata`, through the device guard: `terminate`, the whole process aborts, no exception), and
its backward asks `at::accelerator::getCurrentStream`, which a CPU-only build answers with "Cannot access
accelerator device when none is available" even where a CUDA guard is registered (its CUDA hooks say there is
no CUDA, fixed when torch starts). So the block runs under `torch.no_grad()`, and a test calls the backward
products (the GEMMs an autograd Function's backward runs) itself.

Nothing numerical runs: fake tensors have no values, so a host read (`.item()`, a data-dependent shape) raises,
and what the real kernels compute, how fast, and which cuBLAS or Triton kernel they pick stay for a real GPU
(docs/gpu.md). The engine's module-level caches that remember a device (the compute capability, fp8 fallbacks,
the side stream) are emptied on entry and exit, so a capability never leaks from one test into the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

aten = torch.ops.aten

SM80, SM90, SM100 = (8, 0), (9, 0), (10, 0)
NAMES = {SM80: "NVIDIA A100-SXM4-80GB", SM90: "NVIDIA H200", SM100: "NVIDIA B200"}


def _on_fake_cuda(tensor: object) -> bool:
    """A CUDA tensor, which in a CPU-only torch is a fake one (or a wrapper of one: vmap's batched tensors)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda"


# ------------------------------------------------------------------------------------------------- indexing


def _basic(tensor: torch.Tensor, index: object) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """Python indexing's basic part (ints, slices, None, Ellipsis) applied with aten views, and the advanced
    indices (tensors, lists) with the dimension of the result they index, as torch's own applySlicing does."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = sum(
        item.dim() if isinstance(item, torch.Tensor) and item.dtype == torch.bool else 1
        for item in items
        if item is not None and item is not Ellipsis
    )
    result, dim, advanced = tensor, 0, []
    for item in items:
        if item is None:
            result = aten.unsqueeze.default(result, dim)
            dim += 1
        elif item is Ellipsis:
            dim += tensor.dim() - consumed
        elif isinstance(item, slice):
            result = aten.slice.Tensor(result, dim, item.start, item.stop, 1 if item.step is None else item.step)
            dim += 1
        elif isinstance(item, (torch.Tensor, list)):
            item = item if isinstance(item, torch.Tensor) else torch.tensor(item, device=tensor.device)
            advanced.append((dim, item))
            dim += item.dim() if item.dtype == torch.bool else 1
        else:  # an int (a SymInt too)
            result = aten.select.int(result, dim, item)
    return result, advanced


def _indices(result: torch.Tensor, advanced: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor | None]:
    indices: list[torch.Tensor | None] = [None] * (max(d for d, _ in advanced) + 1)
    for dim, item in advanced:
        indices[dim] = item
    return indices


def _getitem(original):
    def getitem(self, index):
        if not _on_fake_cuda(self):
            return original(self, index)
        result, advanced = _basic(self, index)
        return aten.index.Tensor(result, _indices(result, advanced)) if advanced else result

    return getitem


def _setitem(original):
    def setitem(self, index, value):
        if not _on_fake_cuda(self):
            return original(self, index, value)
        view, advanced = _basic(self, index)
        if advanced:
            source = (
                value
                if isinstance(value, torch.Tensor)
                else torch.full((), value, dtype=self.dtype, device=self.device)
            )
            aten.index_put_.default(view, _indices(view, advanced), source)
        elif isinstance(value, torch.Tensor):
            aten.copy_.default(view, value)
        else:
            aten.fill_.Scalar(view, value)

    return setitem


def _contiguous(original):
    def contiguous(self, memory_format=torch.contiguous_format):
        if not _on_fake_cuda(self):
            return original(self, memory_format=memory_format)
        if self.is_contiguous(memory_format=memory_format):
            return self
        return aten.clone.default(self, memory_format=memory_format)

    return contiguous


def _invert(original):
    def invert(self):
        return aten.bitwise_not.default(self) if _on_fake_cuda(self) else original(self)

    return invert


def _to(original):
    def to(self, *args, **kwargs):
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if not isinstance(self, FakeTensor) or device is None or device.type != "cuda" or self.device == device:
            return original(self, *args, **kwargs)
        return aten._to_copy.default(
            self,
            dtype=dtype or self.dtype,
            device=device,
            non_blocking=non_blocking,
            memory_format=memory_format or torch.preserve_format,
        )

    return to


# ------------------------------------------------------------------------------------------ streams, events


@dataclasses.dataclass(eq=False)
class FakeStream:
    """A CUDA stream stand-in: its name and the log of the device it belongs to."""

    name: str
    log: list[tuple]

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.recorded_on))

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.log)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))

    def query(self) -> bool:
        return True


@dataclasses.dataclass(eq=False)
class FakeEvent:
    log: list[tuple]
    recorded_on: str | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded_on = stream.name if stream is not None else "main"
        self.log.append(("record", self.recorded_on))

    def wait(self, stream: FakeStream | None = None) -> None:
        self.log.append(("wait", stream.name if stream is not None else "main", self.recorded_on))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.recorded_on))

    def query(self) -> bool:
        return True


@dataclasses.dataclass
class FakeCuda:
    """What a `fake_cuda` block gives its test: the fake mode, the capability, the streams' log, and the
    streams each tensor was marked as used on (`record_stream`)."""

    mode: FakeTensorMode
    capability: tuple[int, int]
    log: list[tuple] = dataclasses.field(default_factory=list)
    current: list[FakeStream] = dataclasses.field(default_factory=list)
    streams_made: int = 0

    def current_stream(self, device: object = None) -> FakeStream:
        return self.current[-1]

    def new_stream(self, device: object = None, priority: int = 0) -> FakeStream:
        self.streams_made += 1
        return FakeStream(f"side{self.streams_made}", self.log)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        assert _on_fake_cuda(tensor) and isinstance(stream, FakeStream), (type(tensor), type(stream))
        self.log.append(("record_stream", tuple(tensor.shape), stream.name))


def on_fake_cuda(module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """`module` (built on the meta device) with every parameter an empty fake CUDA tensor of `dtype` that needs
    no gradient (autograd cannot run here: module docstring), and every floating buffer likewise in its own
    dtype; inside `fake_cuda`."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device="cuda"), requires_grad=False
                )
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device="cuda")
    return module


def _engine_caches() -> list:
    """The engine's per-process memories of a device, emptied around every block."""
    from moe_train.models.fp8 import gemm
    from moe_train.models.moe import layer

    return [gemm._CAPABILITY.clear, gemm._FALLEN_BACK.clear, layer._side_stream.cache_clear]


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int] = SM90) -> Iterator[FakeCuda]:
    """Inside: tensors made on "cuda" are fake CUDA tensors of a device of `capability`; torch.cuda's queries,
    streams and events are stand-ins (module docstring). Everything is restored on exit."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake = FakeCuda(mode=mode, capability=capability)
    fake.current.append(FakeStream("main", fake.log))
    Tensor = torch.Tensor
    patches = [
        mock.patch.object(Tensor, "__getitem__", _getitem(Tensor.__getitem__)),
        mock.patch.object(Tensor, "__setitem__", _setitem(Tensor.__setitem__)),
        mock.patch.object(Tensor, "contiguous", _contiguous(Tensor.contiguous)),
        mock.patch.object(Tensor, "to", _to(Tensor.to)),
        mock.patch.object(Tensor, "__invert__", _invert(Tensor.__invert__)),
        mock.patch.object(Tensor, "record_stream", lambda tensor, stream: fake.record_stream(tensor, stream)),
        mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability),
        mock.patch.object(torch.cuda, "get_device_name", lambda device=None: NAMES.get(capability, "NVIDIA GPU")),
        mock.patch.object(torch.cuda, "synchronize", lambda device=None: fake.log.append(("synchronize", "all"))),
        mock.patch.object(torch.cuda, "Stream", fake.new_stream),
        mock.patch.object(torch.cuda, "Event", lambda *args, **kwargs: FakeEvent(fake.log)),
        mock.patch.object(torch.cuda, "current_stream", fake.current_stream),
        mock.patch.object(torch.cuda, "stream", fake.stream),
    ]
    for clear in _engine_caches():
        clear()
    try:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            stack.enter_context(torch.no_grad())  # autograd on a fake CUDA tensor aborts the process (docstring)
            stack.enter_context(mode)
            yield fake
    finally:
        for clear in _engine_caches():
            clear()
