"""Collective traffic of one rank's training step: payload bytes and calls per `<group>/<op>` (the planner's
count of the same is plan/'s, a formula; this one watches what runs).

Every collective torch runs goes through the dispatcher as a `c10d.*` op (torch.distributed's calls, FSDP2,
torch.distributed.nn's autograd collectives) or a `_c10d_functional.*` op (functional collectives, DTensor),
so one TorchDispatchMode sees them all, in forward, backward and recomputation alike, DTensor's implicit
redistributions included (dtensor.py). Payload, as
docs/decisions.md defines it: all-reduce, reduce-scatter and reduce: the input tensor(s); all-gather
and gather: the local shard sent; all-to-all: the bytes sent to other ranks (this rank's own chunk stays);
broadcast: the tensor; send and recv: the tensor sent or received. A collective over a group of one rank moves
nothing and is not counted. Groups are named by their mesh dimension (`dp`, `tp`, `ep`, ...), through the
`name_group` function the caller passes; barriers carry no payload.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moe_train.measure.dtensor import on_dtensors

c10d = torch.ops.c10d
functional = torch.ops._c10d_functional

# op -> (name in the key, index of the payload argument, index of the group argument)
_OPS = {
    c10d.allreduce_.default: ("all_reduce", 0, 1),
    c10d.allreduce_coalesced_.default: ("all_reduce", 0, 1),
    c10d._allgather_base_.default: ("all_gather", 1, 2),
    c10d.allgather_.default: ("all_gather", 1, 2),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 1, 2),
    c10d.allgather_coalesced_.default: ("all_gather", 1, 2),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 1, 2),
    c10d.reduce_scatter_.default: ("reduce_scatter", 1, 2),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1, 2),
    c10d.alltoall_base_.default: ("all_to_all", 1, 2),
    c10d.alltoall_.default: ("all_to_all", 1, 2),
    c10d.broadcast_.default: ("broadcast", 0, 1),
    c10d.reduce_.default: ("reduce", 0, 1),
    c10d.gather_.default: ("gather", 1, 2),
    c10d.scatter_.default: ("scatter", 0, 2),
    c10d.send.default: ("send", 0, 1),
    c10d.recv_.default: ("recv", 0, 1),
    functional.all_reduce.default: ("all_reduce", 0, 2),
    functional.all_reduce_.default: ("all_reduce", 0, 2),
    functional.all_reduce_coalesced.default: ("all_reduce", 0, 2),
    functional.all_reduce_coalesced_.default: ("all_reduce", 0, 2),
    functional.all_gather_into_tensor.default: ("all_gather", 0, 2),
    functional.all_gather_into_tensor_out.default: ("all_gather", 0, 2),
    functional.all_gather_into_tensor_coalesced.default: ("all_gather", 0, 2),
    functional.reduce_scatter_tensor.default: ("reduce_scatter", 0, 3),
    functional.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", 0, 3),
    functional.all_to_all_single.default: ("all_to_all", 0, 3),
    functional.broadcast.default: ("broadcast", 0, 2),
    functional.broadcast_.default: ("broadcast", 0, 2),
}


def process_group(handle: object) -> dist.ProcessGroup:
    """The ProcessGroup behind an op's group argument: a TorchScript-boxed group or a registered group name."""
    if isinstance(handle, str):
        return dist.distributed_c10d._resolve_process_group(handle)
    if isinstance(handle, dist.ProcessGroup):
        return handle
    return dist.ProcessGroup.unbox(handle)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Sequence):
        return [t for item in value for t in _tensors(item)]
    return []


def _nbytes(value: object) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _all_to_all_sent(func, args: tuple, group: dist.ProcessGroup) -> int:
    """Bytes this rank sends to the other ranks of `group` (its own chunk stays local)."""
    size, me = group.size(), group.rank()
    if func is c10d.alltoall_.default:
        return sum(_nbytes(t) for peer, t in enumerate(args[1]) if peer != me)
    source = args[1] if func is c10d.alltoall_base_.default else args[0]
    splits = args[4] if func is c10d.alltoall_base_.default else args[2]
    total = _nbytes(source)
    if not splits:
        return total * (size - 1) // size
    rows = sum(int(s) for s in splits)
    row_bytes = total // rows if rows else 0
    return (rows - int(splits[me])) * row_bytes


class CollectiveTraffic(TorchDispatchMode):
    """Context manager over the step; `bytes` maps `<group>/<op>` to this rank's payload bytes."""

    def __init__(self, name_group: Callable[[dist.ProcessGroup], str]) -> None:
        super().__init__()
        self.name_group = name_group
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._names: dict[str, str] = {}  # group name -> its dimension (naming walks the meshes: slow)

    def _name(self, group: dist.ProcessGroup) -> str:
        if group.group_name not in self._names:
            self._names[group.group_name] = self.name_group(group)
        return self._names[group.group_name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if on_dtensors(types):
            return NotImplemented
        spec = _OPS.get(func)
        if spec is not None:
            op, payload, group_arg = spec
            group = process_group(args[group_arg] if group_arg < len(args) else kwargs["group_name"])
            if group.size() > 1:
                sent = _all_to_all_sent(func, args, group) if op == "all_to_all" else _nbytes(args[payload])
                key = f"{self._name(group)}/{op}"
                self.bytes[key] += sent
                self.calls[key] += 1
        return func(*args, **kwargs)
