"""Token slots <-> expert-major rows: the local half of every dispatcher.

A token routed to K experts has K slots (slot t*K + k). `permute` copies each kept slot's hidden state into a
buffer sorted by expert (stable: within an expert, token order), so each expert's rows are contiguous for one
grouped GEMM; `unpermute` reads the rows back into slot order; `weighted_sum` applies the routing weights. The
expert-parallel dispatchers move the permuted buffer between ranks and reuse these on both ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_train.models.moe.router import count_per_expert


@dataclass
class Permutation:
    """Where each token slot went: what `unpermute` needs to undo `permute`."""

    slot_rows: torch.Tensor  # [T*K] int64 row of the expert buffer holding each slot; num_rows when dropped
    num_rows: int  # rows of the expert buffer (including padding)
    has_dropped: bool


def permute(
    hidden: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    num_experts: int,
    keep: torch.Tensor | None = None,
    pad_to: int | None = None,
    kept: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Permutation]:
    """hidden [T, H], topk_indices [T, K] -> (rows [N, H] sorted by expert, rows per expert [E] int64, perm).

    keep [T, K] (bool) drops the slots that are False (their expert index may then be anything in range);
    `kept`, when the caller knows how many slots `keep` keeps, spares the device read that counts them.
    pad_to gives every expert exactly that many rows (zeros after its real ones), for static shapes; each
    expert must then have at most pad_to kept slots (the capacity keep-mask guarantees it).
    """
    tokens, top_k = topk_indices.shape
    experts = topk_indices.reshape(-1)
    if keep is not None:
        experts = experts.masked_fill(~keep.reshape(-1), num_experts)  # dropped slots sort last
    counts = count_per_expert(experts, num_experts + 1)[:num_experts]
    order = torch.argsort(experts, stable=True)
    if kept is None:
        kept = int(counts.sum()) if keep is not None else tokens * top_k
    order = order[:kept]
    source_tokens = order // top_k
    if pad_to is None:
        rows = hidden.index_select(0, source_tokens)
        num_rows = kept
        destination = torch.arange(kept, device=hidden.device)
    else:
        starts = torch.cumsum(counts, 0) - counts
        sorted_experts = experts[order]
        rank = torch.arange(kept, device=hidden.device) - starts[sorted_experts]
        destination = sorted_experts * pad_to + rank
        num_rows = num_experts * pad_to
        rows = hidden.new_zeros(num_rows, hidden.shape[1]).index_copy(
            0, destination, hidden.index_select(0, source_tokens)
        )
        counts = torch.full_like(counts, pad_to)
    slot_rows = torch.full((tokens * top_k,), num_rows, dtype=torch.int64, device=hidden.device)
    slot_rows[order] = destination
    return rows, counts, Permutation(slot_rows=slot_rows, num_rows=num_rows, has_dropped=kept < tokens * top_k)


def unpermute(rows: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """rows [N, H] in the order `permute` made -> [T*K, H] in slot order; dropped slots are zero rows."""
    if perm.has_dropped:  # dropped slots read an appended zero row
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    return rows.index_select(0, perm.slot_rows)


def weighted_sum(slots: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """slots [T*K, H], topk_weights [T, K] -> [T, H] fp32 (fp64 for fp64 slots): sum_k weight * slot.

    Weighting and summing run in fp32 at least (a bf16 sum of K terms loses bits the residual stream would keep).
    """
    tokens, top_k = topk_weights.shape
    slots = slots.to(torch.promote_types(slots.dtype, torch.float32))
    return (slots.view(tokens, top_k, slots.shape[-1]) * topk_weights.unsqueeze(-1)).sum(dim=1)
