"""The parts of a module's forward that a parallel layout may wrap, declared by the module itself.

A module whose forward (or one of its steps) a layout changes holds a `LayoutRegion` of that step and runs the
step through it: `self.layout_forward = LayoutRegion(type(self).body)` in `__init__`, `self.layout_forward(self,
x)` in `forward`. With no wrapper the region is the step itself; a layout adds one with
`moe_train.parallel.layout.wrap_region` (the only way it does: no class swaps, no rebound methods), so
`type(module)` stays the model's class and the module's file shows each place a layout can act. What each layout
puts where is listed in parallel/layout.py's docstring: recomputation (checkpointed), offloading (a saved-tensors
pool), tensor parallelism (an input entering its tp region, a MoE layer's token slice), compile (an eager
island), offloading's per-layer pass.

Wrappers compose when added, outermost last (the order of `parallelize`), so nothing is rebuilt per call: a
wrapper is a function of the step (`fn -> fn`) as torch.utils.checkpoint's or torch.compiler.disable are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


class LayoutRegion:
    """One step of a module's forward (a function of the module and its inputs), as the layout wraps it."""

    __slots__ = ("step", "wrappers", "_run")

    def __init__(self, step: Callable[..., Any]) -> None:
        self.step = step
        self.wrappers: tuple[str, ...] = ()  # what each wrapper is, for a reader and the structure test
        self._run = step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    def wrap(self, wrapper: Wrapper, *, reason: str) -> None:
        """Run the step (as wrapped so far) through `wrapper`; `reason`: the layout's name for it."""
        self._run = wrapper(self._run)
        self.wrappers = (*self.wrappers, reason)
