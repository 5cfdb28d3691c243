"""The vocabulary-parallel cross-entropy: each tp rank holds the logits of its slice of the padded vocabulary,
and no rank ever holds a full-vocabulary row (Megatron-Core's vocab_parallel_cross_entropy).

Per token: the max over the vocabulary (all-reduce max), the sum of exp(logit - max) (all-reduce sum) and the
target's logit (all-reduce sum; only the rank whose slice holds the target contributes) give
loss = log(sum) - (target logit - max). Padding columns (ids >= vocab_size, docs/decisions.md: the padded size does not
depend on tp) are masked to -inf inside the loss, so they get probability 0 and gradient 0, as in the
single-device `moe_train.models.loss`. The backward is softmax - one-hot on each rank's own slice, without
communication. Chunked (`train.loss_chunk_tokens`), the same three all-reduces run per chunk of tokens inside
the GEMM site's `linear_cross_entropy_sum`, on this rank's head rows, after the head's region entry (a copy,
or under sequence parallelism the gathered sequence, which the chunked loss keeps whole for backward).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_train.models.linear import Linear
from moe_train.models.loss import IGNORE_INDEX, LanguageModelLoss, linear_cross_entropy_sum


def _all_reduce(x: torch.Tensor, *, op: dist.ReduceOp, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        """logits [N, V/t] fp32 (this rank's columns from `start`), targets [N] -> per-token loss [N] (0 where
        the target is IGNORE_INDEX)."""
        columns = torch.arange(start, start + logits.shape[-1], device=logits.device)
        if start + logits.shape[-1] > vocab_size:
            logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        dist.all_reduce(target_logit, group=group)

        valid = targets != IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, hit, valid = ctx.saved_tensors
        scale = (grad * valid).unsqueeze(-1)
        grad_logits = softmax * scale
        grad_logits.scatter_add_(-1, index.unsqueeze(-1), -(scale * hit.unsqueeze(-1)))
        return grad_logits, None, None, None, None


class VocabParallelLoss(LanguageModelLoss):
    """The model's language-model loss when the head's output is sharded by vocabulary over `group`."""

    def __init__(self, *, vocab_size: int, padded_vocab_size: int, group: dist.ProcessGroup,
                 chunk_tokens: int = 0) -> None:
        super().__init__(vocab_size=vocab_size, chunk_tokens=chunk_tokens)
        self.group = group
        self.shard = padded_vocab_size // dist.get_world_size(group)
        self.start = dist.get_rank(group) * self.shard

    def head_sum(self, head: Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The head (a column-parallel Linear entering its own region, parallel/tensor.py) and the loss, in
        chunks of `chunk_tokens` when set."""
        if not self.chunk_tokens:
            return super().head_sum(head, hidden, targets)
        x = head.parallel.region.enter(hidden)
        weight = head.weight.to_local() if isinstance(head.weight, DTensor) else head.weight
        return linear_cross_entropy_sum(
            x.flatten(0, -2), weight, targets.flatten(), chunk_tokens=self.chunk_tokens, vocab_size=self.vocab_size,
            start=self.start, reduce_max=functools.partial(_all_reduce, op=dist.ReduceOp.MAX, group=self.group),
            reduce_sum=functools.partial(_all_reduce, op=dist.ReduceOp.SUM, group=self.group), fp8=head.fp8)

    def sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = _VocabParallelCrossEntropy.apply(
            logits.flatten(0, -2).float(), targets.flatten(), self.start, self.vocab_size, self.group
        )
        return losses.sum()

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The Python API's full logits (inference, never training): gathered over the vocabulary."""
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]
