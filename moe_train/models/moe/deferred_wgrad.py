"""Delayed expert weight gradients (`parallel.split_wgrad`; Megatron-Core's `--delay-wgrad-compute`): the routed
experts' backward computes each GEMM's input gradient at once and queues its weight gradient (dW = dy^T x), and
the dispatch's backward runs the queue after issuing its all-to-all and before waiting on it.

Why: the dispatch's backward collective (the rows' and routing weights' gradients going home) needs the experts'
input gradients only. Their weight gradients, a third of the experts' backward FLOPs, can run while it is in
flight, in every backward: an overlapped pair's (before the baton goes to the paired forward), the cool-down's
and the plain step's, where nothing else would fill it. Megatron-Core runs them beside the paired forward's
dispatch instead; here they sit beside both (the paired forward's dispatch is still in flight when the backward
issues its own).

Equal results, bit for bit: each GEMM's two gradients are the formulas its autograd node computes
(models/linear.py, the same kernels on the same operands), and each weight's gradient is handed to that weight's
own autograd path (the expert DTensor's to_local, the loop's unbind, AccumulateGrad) in one nested backward per
drain, so it accumulates as the plain step's does, in the same micro-batch's backward. FSDP2 reduces a unit's
gradients in its post-backward, which fires as soon as the experts' inputs have their gradients, before the
dispatch's backward: `hold` lets parallel/data_parallel.py postpone it to the end of the drain. A queue still
holding gradients when its backward ends raises: a weight gradient is never late or lost silently.

FP8 (the routed experts in `train.fp8.modules`): the same split of models/fp8/gemm.py's products, what its
GEMMs' autograd Functions compute in one backward (the kept fp8 input under `saved_inputs: fp8` too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_train.models.fp8.gemm import Fp8Gemm
from moe_train.models.fp8.scaling import GroupQuantised
from moe_train.models.linear import (
    batched_mm,
    batched_mm_input_grad,
    batched_mm_weight_grad,
    grouped_mm,
    grouped_mm_input_grad,
    grouped_mm_weight_grad,
    linear,
    linear_input_grad,
    linear_weight_grad,
)
from moe_train.models.moe.collective_turns import record


class _Gemm:
    """One kind of the experts' GEMM, y = x W^T, as its three products: forward, input gradient, weight gradient
    (the formulas its autograd node computes), and what it keeps of x for the last (fp8 `saved_inputs`)."""

    def __init__(self, kind: str, offsets: torch.Tensor | None, fp8: Fp8Gemm | None) -> None:
        self.kind, self.offsets, self.fp8 = kind, offsets, fp8

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        kind, offsets, fp8 = self.kind, self.offsets, self.fp8
        if kind == "grouped":
            return grouped_mm(x, weight, offsets) if fp8 is None else fp8.grouped_forward(x, weight, offsets)
        if kind == "batched":
            return batched_mm(x, weight)
        return linear(x, weight) if fp8 is None else fp8.forward(x, weight)

    def kept(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What backward keeps of x: x, or with fp8 `saved_inputs: fp8` its fp8 data and scales."""
        if self.fp8 is None or self.fp8.saved_inputs != "fp8":
            return (x,)
        kept = self.fp8.kept_rows(x, self.offsets) if self.kind == "grouped" else self.fp8.kept_input(x)
        return kept.data, kept.scale

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        kind, offsets, fp8 = self.kind, self.offsets, self.fp8
        if kind == "grouped":
            if fp8 is None:
                return grouped_mm_input_grad(grad, weight, offsets)
            return fp8.grouped_input_grad(grad.contiguous(), weight, offsets)
        if kind == "batched":
            return batched_mm_input_grad(grad, weight)
        return linear_input_grad(grad, weight, fp8=fp8)

    def weight_grad(self, grad: torch.Tensor, kept: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        kind, offsets, fp8 = self.kind, self.offsets, self.fp8
        if fp8 is None:
            (x,) = kept
            if kind == "grouped":
                return grouped_mm_weight_grad(grad, x, offsets)
            return batched_mm_weight_grad(grad, x) if kind == "batched" else linear_weight_grad(grad, x)
        if len(kept) == 2:
            x = GroupQuantised(*kept, fp8.recipe) if kind == "grouped" else fp8.weight_grad_operand(*kept)
        else:
            (x,) = kept
        if kind == "grouped":
            return fp8.grouped_weight_grad(grad.contiguous(), x, offsets).to(dtype)
        return fp8.weight_grad(grad, x).to(dtype)


class DeferredWeightGrads:
    """One routed-experts module's queue of weight gradients, filled by its backward and run by its dispatch's
    (`run`, the dispatch collectives' `beside`). One backward of a module runs at a time (an overlapped pair's
    other half is a forward), so one queue per module serves every micro-batch."""

    def __init__(self) -> None:
        self._weights: list[torch.Tensor] = []
        self._grads: list[Callable[[], torch.Tensor]] = []
        self._held: list[Callable[[], None]] = []

    @torch.compiler.disable  # a Python queue and a nested backward: eager under train.compile (a graph break)
    def gemm(self, kind: str, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None = None, *,
             fp8: Fp8Gemm | None = None) -> torch.Tensor:
        """The experts' GEMM `kind` (grouped: `grouped_mm` over `offsets`; batched: `batched_mm`; linear) of rows x
        and a weight, in fp8 with `fp8` (grouped, linear), its weight gradient delayed to `run`. Without autograd
        it is the plain product."""
        product = _Gemm(kind, offsets, fp8)
        if not (torch.is_grad_enabled() and x.requires_grad and weight.requires_grad):
            return product.forward(x, weight)
        return _DelayedWeightGemm.apply(x, (weight,), product, self)

    def defer(self, weight: torch.Tensor, grad: Callable[[], torch.Tensor]) -> None:
        if not self._weights:  # the first of a backward: check at its end that the queue ran
            torch.autograd.Variable._execution_engine.queue_callback(self._check_ran)
        self._weights.append(weight)
        self._grads.append(grad)

    def hold(self, post_backward: Callable[[], None]) -> bool:
        """Run `post_backward` after the queued gradients instead of now, if any are queued (True then)."""
        if not self._weights:
            return False
        self._held.append(post_backward)
        return True

    def run(self) -> None:
        """Compute the queued weight gradients and accumulate them through their weights' autograd paths, then
        what was held for after them. Nothing queued: nothing to do."""
        if not self._weights:
            return
        record("wgrad", "experts")
        weights, grads = self._weights, [grad() for grad in self._grads]
        self._weights, self._grads = [], []
        torch.autograd.backward(weights, grads)
        held, self._held = self._held, []
        for post_backward in held:
            post_backward()

    def _check_ran(self) -> None:
        if self._weights:
            raise RuntimeError("parallel.split_wgrad: the routed experts' delayed weight gradients were never run "
                               "(no dispatch collective ran their queue in this backward)")


class _DelayedWeightGemm(torch.autograd.Function):
    """y = x W^T (a `_Gemm`) with only x's gradient in backward; the weight's is queued. The weight comes boxed (a
    tuple), so autograd draws no edge to it: its gradient reaches it through `DeferredWeightGrads.run`."""

    @staticmethod
    def forward(ctx, x, boxed, product, queue):
        (weight,) = boxed
        ctx.product, ctx.queue, ctx.weight = _Gemm(product.kind, None, product.fp8), queue, weight
        kept = product.kept(x)
        # what the GEMM's own autograd node saves: its input, the grouped offsets, and the weight as it came (not
        # detached: measure and the offload pool tell a weight by its autograd history, measure/activations.py)
        ctx.grouped = product.offsets is not None
        ctx.save_for_backward(*kept, weight, *((product.offsets,) if ctx.grouped else ()))
        return product.forward(x, weight.detach())

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        if ctx.grouped:
            *kept, weight, offsets = saved
            product = _Gemm(ctx.product.kind, offsets, ctx.product.fp8)
        else:
            (*kept, weight), product = saved, ctx.product
        kept, weight, dtype = tuple(kept), weight.detach(), weight.dtype
        ctx.queue.defer(ctx.weight, lambda: product.weight_grad(grad, kept, dtype))
        return product.input_grad(grad, weight), None, None, None
