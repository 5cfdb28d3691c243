"""The model's GEMM site: every matrix product with a weight runs through a function of this file.

Attention projections, MLPs, shared experts, the router, MTP's projection and the head call `linear` (through
the `Linear` module, or directly on a weight); the routed experts call `grouped_mm` (or `batched_mm` on rows
padded per expert, where the grouped GEMM does not run); the tensor-parallel styles (parallel/tensor.py) call
the same functions on their local shards, and the sequence-parallel column GEMM's hand-written backward calls
`linear_input_grad` / `linear_weight_grad`. So a precision or kernel choice (FP8 with its scales, the chunked
head + loss: `linear_cross_entropy_sum`) is made in one place, for every layout. No other module of
models/ or parallel/ calls F.linear, matmul or a grouped GEMM (tests/test_gemm_site.py checks).

FP8 (`train.precision: fp8`): each function takes the `fp8` of the module it serves (`Linear.fp8`,
`GroupedExperts.fp8`, set by models/fp8/select.py for the GEMMs `train.fp8.modules` names; None: the compute
dtype's GEMM) and hands the product to models/fp8/gemm.py, the site's fp8 half.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_train.models.autograd_phase import recomputation
from moe_train.models.fp8.gemm import Fp8Gemm

IGNORE_INDEX = -100  # a target that counts for nothing (models/loss.py re-exports it)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias) -> [..., out]."""
    if fp8 is not None:
        return fp8.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, *, fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """The gradient of `linear`'s input: grad [..., out] @ weight [out, in] -> [..., in]."""
    if fp8 is not None:
        return fp8.input_grad(grad, weight)
    return grad.matmul(weight)


def linear_weight_grad(grad: torch.Tensor, x: torch.Tensor, *, fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """The gradient of `linear`'s weight: grad [..., out]^T @ x [..., in] -> [out, in], summed over the rows."""
    if fp8 is not None:
        return fp8.weight_grad(grad, x)
    return grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


def attention_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, k] @ b [..., k, n]: the weightless products of attention written by hand (context
    parallelism's score tiles and their gradients, parallel/ring_attention.py), here so that the site still
    holds every matrix product a precision or kernel choice may have to see."""
    return a.matmul(b)


def expert_offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """[E] int32 end row of each expert's rows: what `grouped_mm` takes (computed once per expert layer)."""
    return torch.cumsum(tokens_per_expert, 0).to(torch.int32)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
               fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """rows [N, in] sorted by expert (expert e's rows end at offsets[e]) @ weight [E, out, in]^T per expert ->
    [N, out], all experts in one kernel (torch._grouped_mm; `GroupedExperts` falls back to `linear` per
    expert where it cannot run)."""
    if fp8 is not None:
        return fp8.grouped_mm(rows, weight, offsets)
    return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


def batched_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [E, rows, in] @ weight [E, out, in]^T per expert -> [E, rows, out]: every expert's (padded) rows in one
    batched GEMM (`GroupedExperts`' padded path, where torch._grouped_mm does not run)."""
    return torch.bmm(x, weight.transpose(-2, -1))


# The input and weight gradients of `grouped_mm` and `batched_mm` (compute dtype), written as their autograd
# formulas compute them (the same kernels on the same operands, so bit for bit: tests/test_deferred_wgrad.py), for
# the routed experts' delayed weight gradients (models/moe/deferred_wgrad.py), which take the two apart.
def grouped_mm_input_grad(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad [N, out] @ weight [E, out, in] per expert -> [N, in]."""
    return torch._grouped_mm(grad, weight, offs=offsets)


def grouped_mm_weight_grad(grad: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Expert e's grad_e^T @ rows_e -> [E, out, in], summed over its own rows."""
    return torch._grouped_mm(grad.t(), rows, offs=offsets)


def batched_mm_input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad [E, rows, out] @ weight [E, out, in] -> [E, rows, in]."""
    return torch.bmm(grad, weight)


def batched_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(x [E, rows, in]^T @ grad [E, rows, out])^T -> [E, out, in], summed over the rows."""
    return torch.bmm(x.transpose(1, 2), grad).transpose(1, 2)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose product runs through `linear`; `fp8` (a class
    default of None, set per module by models/fp8/select.py) is what its GEMMs run in fp8 with.

    Layouts: `parallel` (a class default of None, set per module by tensor parallelism, parallel/tensor.py) is
    the GEMM under tp, column-parallel (weight rows sharded, the input entering the tp region) or row-parallel
    (columns sharded, the partial sums reduced); called with the module and the input."""

    fp8: Fp8Gemm | None = None
    parallel: Callable[[Linear, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            return self.parallel(self, x)
        return linear(x, self.weight, self.bias, fp8=self.fp8)


# ------------------------------------------------------------------------------- the chunked head + loss

Reduce = Callable[[torch.Tensor], torch.Tensor]  # in-place all-reduce over the vocabulary shards


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, padding: torch.Tensor | None,
                  fp8: Fp8Gemm | None) -> torch.Tensor:
    """fp32 logits of one chunk of rows, the padding columns at -inf (models/loss.py's `mask_padding`)."""
    logits = linear(x, weight, fp8=fp8).float()
    return logits if padding is None else logits.masked_fill_(padding, float("-inf"))


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of CE(x @ weight^T, targets), a chunk of rows at a time; keeps one fp32 log-sum-exp per
    row, no logits: backward recomputes each chunk's logits (one more head GEMM, booked as a recomputation)
    and turns them into softmax - one-hot there. Chosen over computing the gradients in forward (Liger's
    fused loss, no extra GEMM) because those hold a full fp32 weight gradient from each micro-batch's forward
    to its backward, once per micro-batch a pipeline keeps in flight. Under vocabulary parallelism `weight`
    is this rank's rows (columns `start`.. of the padded vocabulary) and `reduce_max` / `reduce_sum` complete
    each row's max, sum of exponentials and target logit over the shards; backward needs no communication.
    `fp8`: the head's (`head` in train.fp8.modules): each chunk's three GEMMs and the recomputed logits in fp8."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                vocab_size: int, start: int, reduce_max: Reduce, reduce_sum: Reduce,
                fp8: Fp8Gemm | None) -> torch.Tensor:
        columns = weight.shape[0]
        padding = None
        if start + columns > vocab_size:
            padding = torch.arange(start, start + columns, device=x.device) >= vocab_size
        local = targets - start
        mine = (local >= 0) & (local < columns)
        index = local.clamp(0, columns - 1).unsqueeze(-1)
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        target_logit = torch.empty_like(lse)
        for begin in range(0, x.shape[0], chunk_tokens):
            rows = slice(begin, begin + chunk_tokens)
            logits = _chunk_logits(x[rows], weight, padding, fp8)
            target_logit[rows] = logits.gather(-1, index[rows]).squeeze(-1).masked_fill_(~mine[rows], 0.0)
            row_max = reduce_max(logits.max(dim=-1).values)
            sum_exp = reduce_sum(logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1))
            lse[rows] = sum_exp.log_().add_(row_max)
        valid = targets != IGNORE_INDEX
        loss = (lse - reduce_sum(target_logit)).masked_fill_(~valid, 0.0).sum()
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.chunk_tokens, ctx.start, ctx.padding, ctx.fp8 = chunk_tokens, start, padding, fp8
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, targets, lse = ctx.saved_tensors
        columns = weight.shape[0]
        local = targets - ctx.start
        hit = ((local >= 0) & (local < columns)).unsqueeze(-1)
        index = local.clamp(0, columns - 1).unsqueeze(-1)
        scale = (grad * (targets != IGNORE_INDEX)).unsqueeze(-1)  # fp32 [N, 1]
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for begin in range(0, x.shape[0], ctx.chunk_tokens):
            rows = slice(begin, begin + ctx.chunk_tokens)
            with recomputation():
                logits = _chunk_logits(x[rows], weight, ctx.padding, ctx.fp8)
            probs = logits.sub_(lse[rows].unsqueeze(-1)).exp_()
            probs.scatter_add_(-1, index[rows], -hit[rows].to(probs.dtype))
            grad_logits = probs.mul_(scale[rows]).to(x.dtype)
            grad_x[rows] = linear_input_grad(grad_logits, weight, fp8=ctx.fp8)
            grad_weight += linear_weight_grad(grad_logits, x[rows], fp8=ctx.fp8)
        return grad_x, grad_weight.to(weight.dtype), None, None, None, None, None, None, None


def linear_cross_entropy_sum(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             chunk_tokens: int, vocab_size: int, start: int = 0, reduce_max: Reduce = _no_reduce,
                             reduce_sum: Reduce = _no_reduce, fp8: Fp8Gemm | None = None) -> torch.Tensor:
    """fp32 sum of the cross-entropy of the logits x [N, in] @ weight [V, in]^T over the targets [N] that are
    not IGNORE_INDEX, `chunk_tokens` rows at a time: the head GEMM and the loss in one, whose peak holds one
    chunk's logits and which keeps only x and one fp32 log-sum-exp per row for backward. Columns from
    `vocab_size` on (padding) get probability 0; `start`, `reduce_*`: vocabulary parallelism (above); `fp8`: the
    head's GEMMs in fp8."""
    return _LinearCrossEntropy.apply(x, weight, targets, chunk_tokens, vocab_size, start, reduce_max, reduce_sum,
                                     fp8)
