"""Global batches by step and data-parallel rank, and position ids that restart at document boundaries."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moe_train.data.sources import SampleSource

if TYPE_CHECKING:
    import torch


def global_batch(
    source: SampleSource, *, step: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1
) -> torch.Tensor:
    """This rank's slice of global batch `step`: samples [step*G, (step+1)*G), rank r of D taking the contiguous
    [r*G/D, (r+1)*G/D). The concatenation of all ranks' slices is the dp_size=1 batch, so a run sees the same
    samples under any layout and resumes from the step alone. Returns LongTensor [G // D, seq_length + 1]."""
    import torch

    if global_batch_size % dp_size:
        raise ValueError(f"global_batch_size {global_batch_size} is not divisible by dp_size {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    local = global_batch_size // dp_size
    first = step * global_batch_size + dp_rank * local
    return torch.from_numpy(np.stack([source.sample(i) for i in range(first, first + local)]))


def position_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Positions along the last dimension that restart at 0 on the token after each EOD (the EOD itself ends
    its document), as used with data.reset_at_eod. Same shape as `tokens`, int64."""
    import torch

    length = tokens.shape[-1]
    index = torch.arange(length, device=tokens.device).expand(tokens.shape)
    starts = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
    starts[..., 1:] = tokens[..., :-1] == eod_id
    document_start = torch.where(starts, index, 0).cummax(dim=-1).values
    return index - document_start
