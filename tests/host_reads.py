"""Count device-to-host reads made by moe-train's own code: every call of Tensor.item, .tolist, .cpu, .numpy,
__bool__, __int__ and __float__ whose caller is a moe_train source line, by that line.

A TorchDispatchMode alone misses `.tolist()` and `bool(t)` (they read the storage without dispatching an op), so
the methods themselves are wrapped. What is on the host already is free: a tensor `.cpu()` returned, and (a
dispatch mode follows them) every tensor computed from host tensors only, as on a GPU, where those would be CPU
tensors; on the CPU `.cpu()` returns the tensor itself, which then counts once, as a device would. Calls from
torch's own code are not counted (the optimizer reads its CPU step counters, say).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import moe_train

SOURCE = Path(moe_train.__file__).resolve().parent
METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


class HostReads:
    def __init__(self) -> None:
        self.by_line: Counter[str] = Counter()
        self._host: dict[int, torch.Tensor] = {}  # id -> the tensor (held, so the id is not reused)

    def total(self, *, under: str = "") -> int:
        """Reads whose source file lies under `under` (a path relative to the package, e.g. 'models/')."""
        return sum(n for where, n in self.by_line.items() if where.startswith(under))

    def _caller(self) -> str | None:
        frame = sys._getframe(2)
        path = Path(frame.f_code.co_filename).resolve()
        if SOURCE not in path.parents:
            return None
        return f"{path.relative_to(SOURCE).as_posix()}:{frame.f_lineno}"

    def _wrap(self, name: str, original):
        def counted(tensor, *args, **kwargs):
            where = self._caller()
            if where is not None and id(tensor) not in self._host:
                self.by_line[where] += 1
            out = original(tensor, *args, **kwargs)
            if name == "cpu" and isinstance(out, torch.Tensor):
                self._host[id(out)] = out
            return out

        return counted

    @contextlib.contextmanager
    def counting(self) -> Iterator[HostReads]:
        originals = {name: getattr(torch.Tensor, name) for name in METHODS}
        try:
            for name, original in originals.items():
                setattr(torch.Tensor, name, self._wrap(name, original))
            with _FollowHost(self._host):
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


class _FollowHost(TorchDispatchMode):
    """Marks an op's outputs as host tensors when it had tensor inputs and all of them were host tensors."""

    def __init__(self, host: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.host = host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if inputs and all(id(t) in self.host for t in inputs):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.host[id(t)] = t
        return out
