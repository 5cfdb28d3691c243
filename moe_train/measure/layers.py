"""Which decoder layer's forward is running, and whether autograd is running a backward pass.

The FLOP counter and the saved-tensor tracker both attribute work to a layer and a phase. Layers are the
model's `layers[i]` and its MTP modules (index num_layers + k, the index their decoder block carries); a
forward pre-hook pushes the index and an always-called forward hook pops it. An op is a recomputation while
activation checkpointing runs a region again in backward (`models.autograd_phase.in_recomputation`:
checkpoint's recompute context), whether the region is a whole group of layers or one module inside a layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from torch import nn

from moe_train.models.autograd_phase import in_backward, in_recomputation


def tracked_layers(model: nn.Module) -> dict[int, nn.Module]:
    """{layer index: module}: the decoder layers this model (or pipeline stage) holds, then its MTP modules."""
    layers = {int(name): module for name, module in model.layers.items()}
    for name, module in getattr(model, "mtp", {}).items():
        layers[model.cfg.num_layers + int(name)] = module
    return layers


class LayerTracker:
    """Hooks on every tracked layer of a rank's model chunks (one, or a pipeline rank's virtual stages);
    `current` is the innermost running layer (None outside every layer).

    `micro_batch` names the micro-batch the running chunk is on, as (chunk position, its forward calls so far),
    and stays at the last chunk's after it returns (the pipeline's loss function runs between chunks);
    `phase()` is forward, backward or recompute for the op running now.
    """

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        self.layers: dict[int, nn.Module] = {}
        for chunk in chunks:
            self.layers.update(tracked_layers(chunk))
        self.stack: list[int] = []
        self.chunk_forwards = [0] * len(chunks)
        self.micro_batch: tuple[int, int] = (0, 0)
        self._handles = [chunk.register_forward_pre_hook(partial(self._chunk_forward, position))
                         for position, chunk in enumerate(chunks)]
        for index, module in self.layers.items():
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, index)))
            self._handles.append(module.register_forward_hook(partial(self._exit, index), always_call=True))

    def _chunk_forward(self, position: int, module: nn.Module, args: tuple) -> None:
        if not in_backward():
            self.chunk_forwards[position] += 1
            self.micro_batch = (position, self.chunk_forwards[position])

    def _enter(self, index: int, module: nn.Module, args: tuple) -> None:
        self.stack.append(index)

    def _exit(self, index: int, module: nn.Module, args: tuple, output: object) -> None:
        self.stack.pop()

    @property
    def current(self) -> int | None:
        return self.stack[-1] if self.stack else None

    def phase(self) -> str:
        if in_recomputation():
            return "recompute"
        return "backward" if in_backward() else "forward"

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
