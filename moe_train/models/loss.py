"""The language-model loss as a function of (logits, targets): what the stage that holds the loss computes.

The head produces logits over the padded vocabulary (`make_vocab_size_divisible_by`): a vocabulary-sharded
head cannot slice its weight to the real rows, so the padding columns are masked here instead, to -inf, which
gives them probability 0 and gradient 0, exactly as if they did not exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_train.models.linear import IGNORE_INDEX, Linear, linear_cross_entropy_sum

__all__ = ["IGNORE_INDEX", "LanguageModelLoss", "cross_entropy_sum", "mask_padding"]


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
