"""The language-model loss as a function of (logits, targets): what the stage that holds the loss computes.

The head produces logits over the padded vocabulary (`make_vocab_size_divisible_by`): a vocabulary-sharded
head cannot slice its weight to the real rows, so the padding columns are masked here instead, to -inf, which
gives them probability 0 and gradient 0, exactly as if they did not exist. With train.loss_chunk_tokens the head
GEMM and the loss run in one, a chunk of rows at a time (`linear_cross_entropy_sum`, below), its GEMMs through
the model's GEMM site (models/linear.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_train.models.autograd_phase import recomputation
from moe_train.models.fp8.gemm import Fp8Gemm
from moe_train.models.linear import Linear, linear, linear_input_grad, linear_weight_grad

__all__ = ["IGNORE_INDEX", "LanguageModelLoss", "cross_entropy_sum", "linear_cross_entropy_sum", "mask_padding"]

IGNORE_INDEX = -100  # a target that counts for nothing


def mask_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits [..., padded] with the columns from `vocab_size` on set to -inf (unchanged when unpadded)."""
    if logits.shape[-1] == vocab_size:
        return logits
    padding = torch.arange(logits.shape[-1], device=logits.device) >= vocab_size
    return logits.masked_fill(padding, float("-inf"))


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """fp32 sum of the cross-entropy over the targets that are not IGNORE_INDEX; logits may be padded."""
    logits = mask_padding(logits.flatten(0, -2).float(), vocab_size)
    return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class LanguageModelLoss:
    """The loss a model computes from its head's logits. This single-device version sees the whole (padded)
    vocabulary; tensor parallelism swaps in a vocabulary-parallel one (moe_train/parallel/vocab_parallel.py)
    whose logits are this rank's vocabulary slice, so the model never needs to know which it has."""

    def __init__(self, *, vocab_size: int, chunk_tokens: int = 0) -> None:
        self.vocab_size = vocab_size
        # Tokens per chunk of the head + loss (train.loss_chunk_tokens, set by parallelize); 0: unchunked.
        self.chunk_tokens = chunk_tokens

    def sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """fp32 sum of the cross-entropy over the targets that are not IGNORE_INDEX."""
        return cross_entropy_sum(logits, targets, vocab_size=self.vocab_size)

    def head_sum(self, head: Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`sum` of the head's logits of hidden [..., h]: the head GEMM and the loss in chunks of
        `chunk_tokens` rows when set (no logits kept for backward), else the head then `sum`."""
        if not self.chunk_tokens:
            return self.sum(head(hidden), targets)
        return linear_cross_entropy_sum(hidden.flatten(0, -2), head.weight, targets.flatten(),
                                        chunk_tokens=self.chunk_tokens, vocab_size=self.vocab_size, fp8=head.fp8)

    def head_mean(self, head: Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`head_sum` over the count of targets that are not IGNORE_INDEX (0 when there are none)."""
        return self.head_sum(head, hidden, targets) / (targets != IGNORE_INDEX).sum().clamp(min=1)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output as the Python API returns it: [..., vocab_size], padding stripped."""
        return logits[..., : self.vocab_size]


# the chunked head + loss: the head GEMM (through the GEMM site, models/linear.py) and the cross-entropy in one

Reduce = Callable[[torch.Tensor], torch.Tensor]  # in-place all-reduce over the vocabulary shards


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, padding: torch.Tensor | None,
                  fp8: Fp8Gemm | None) -> torch.Tensor:
    """fp32 logits of one chunk of rows, the padding columns at -inf (as `mask_padding`)."""
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
