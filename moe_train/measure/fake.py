"""`--fake`: a full-size step on this machine, with no real memory, data or peers.

Tensors are FakeTensors on the CPU device (FakeTensorMode: shapes, dtypes and strides only), so the kernels
chosen are the CPU ones (SDPA's flash kernel for CPU, not a math fallback that would store s x s scores).
The process group is torch's fake backend at the recipe's world size, this process playing one rank: every
collective returns at once with outputs of the right shape, and the comm counter sees it as on a real run.
MoE routing is forced to an even spread (`Router.even_routing`, set by measure_step), since fake tensors have no
values.
The meshes are built on the fake process group before fake mode starts (their rank tables are real).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from moe_train.measure.dtensor import on_dtensors


class CpuKernelShapes(TorchDispatchMode):
    """What torch's fake kernels lack for a CPU step: `_grouped_mm`'s meta kernel accepts only CUDA's bf16.
    The CPU kernel runs fp32/bf16/f16 with the same output shape, so the shape is taken from the meta kernel on
    contiguous bf16 stand-ins, and the output gets the real dtype. Nothing else is stood in for: a host read
    (the step makes none, train/step.py) fails on fake tensors, so a step that needs one cannot be measured.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if on_dtensors(types):
            return NotImplemented
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            a, b, *rest = args
            shape = func(a.to(torch.bfloat16).contiguous(), b.to(torch.bfloat16).contiguous(), *rest, **kwargs).shape
            return torch.empty(shape, dtype=kwargs.get("out_dtype") or a.dtype, device=a.device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_process_group(*, rank: int, world_size: int) -> Iterator[None]:
    """torch's fake backend as the default process group: this process is `rank` of `world_size`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def real_rank_tables() -> Iterator[None]:
    """Device meshes made or read while fake mode runs (FSDP2 joins its dp mesh with a parameter's tp mesh)
    keep their rank tables in real integer tensors, as when the meshes were first built: those ops run outside
    fake mode."""
    init, mesh = DeviceMesh.__init__, DeviceMesh.mesh

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def real_mesh(self):
        with unset_fake_temporarily():
            return mesh.fget(self)

    DeviceMesh.__init__, DeviceMesh.mesh = real_init, property(real_mesh)
    try:
        yield
    finally:
        DeviceMesh.__init__, DeviceMesh.mesh = init, mesh


@contextlib.contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """FakeTensorMode (CPU semantics) with the CPU shape rules above; tensors created inside are fake."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with real_rank_tables(), mode, CpuKernelShapes():
        yield mode
