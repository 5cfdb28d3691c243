"""The language-model loss as a function of (logits, targets): what the stage that holds the loss computes.

The head produces logits over the padded vocabulary (`make_vocab_size_divisible_by`): a vocabulary-sharded
head cannot slice its weight to the real rows, so the padding columns are masked here instead, to -inf, which
gives them probability 0 and gradient 0, exactly as if they did not exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


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


def cross_entropy_mean(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Mean over the targets that are not IGNORE_INDEX (0 when there are none)."""
    total = cross_entropy_sum(logits, targets, vocab_size=vocab_size)
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)
