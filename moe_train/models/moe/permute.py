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
    row_slots: torch.Tensor | None = None  # padded: [num_rows] int64 slot of each buffer row, T*K for padding


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
    order = torch.argsort(experts, stable=True)
    if pad_to is not None:
        return _padded(hidden, experts, order, num_experts=num_experts, top_k=top_k, pad_to=pad_to,
                       dropping=keep is not None)
    counts = count_per_expert(experts, num_experts + 1)[:num_experts]
    if kept is None:
        kept = int(counts.sum()) if keep is not None else tokens * top_k
    order = order[:kept]
    rows = hidden.index_select(0, order // top_k)
    slot_rows = torch.full((tokens * top_k,), kept, dtype=torch.int64, device=hidden.device)
    slot_rows[order] = torch.arange(kept, device=hidden.device)
    return rows, counts, Permutation(slot_rows=slot_rows, num_rows=kept, has_dropped=kept < tokens * top_k)


def _padded(hidden: torch.Tensor, experts: torch.Tensor, order: torch.Tensor, *, num_experts: int, top_k: int,
            pad_to: int, dropping: bool) -> tuple[torch.Tensor, torch.Tensor, Permutation]:
    """`permute` with every expert exactly pad_to rows: all shapes follow from (E, pad_to) and the slot count,
    none from how many slots were kept, so nothing is read from the device (what CUDA graphs and fixed-size
    all-to-alls need, and what `measure --fake` can run). Each buffer row gathers its slot's token, or an
    appended zero row where the expert has fewer slots; `dropping` (a keep-mask was given) marks every
    Permutation as possibly dropping, since how many were dropped is not read."""
    slots = experts.shape[0]
    num_rows = num_experts * pad_to
    per_expert = count_per_expert(experts, num_experts + 1)  # the last: dropped slots
    starts = torch.cumsum(per_expert, 0) - per_expert
    sorted_experts = experts.index_select(0, order)
    rank = torch.arange(slots, device=hidden.device) - starts.index_select(0, sorted_experts)
    destination = torch.where(sorted_experts < num_experts, sorted_experts * pad_to + rank, num_rows)
    slot_rows = torch.empty(slots, dtype=torch.int64, device=hidden.device)
    slot_rows[order] = destination
    # row e * pad_to + r holds the r-th slot of expert e, or none (`slots`: token T, an appended zero row)
    row = torch.arange(num_rows, device=hidden.device)
    expert, rank_in_expert = row // pad_to, row % pad_to
    row_slots = torch.full_like(row, slots)
    if slots:
        at = (starts.index_select(0, expert) + rank_in_expert).clamp(max=slots - 1)
        filled = rank_in_expert < per_expert.index_select(0, expert)
        row_slots = torch.where(filled, order.index_select(0, at), row_slots)
    rows = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])]).index_select(0, row_slots // top_k)
    counts = torch.full((num_experts,), pad_to, dtype=torch.int64, device=hidden.device)
    return rows, counts, Permutation(slot_rows=slot_rows, num_rows=num_rows, has_dropped=dropping,
                                     row_slots=row_slots)


def unpermute(rows: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """rows [N, H] in the order `permute` made -> [T*K, H] in slot order; dropped slots are zero rows."""
    if perm.has_dropped:  # dropped slots read an appended zero row
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    return rows.index_select(0, perm.slot_rows)


def weighted_sum(slots: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """slots [T*K, H], topk_weights [T, K] -> [T, H] fp32 (fp64 for fp64 slots): sum_k weight * slot.

    Weighting and summing run in fp32 at least (a bf16 sum of K terms loses bits the residual stream would keep),
    but the slots are kept for backward in their own dtype and widened again there (`_WeightedSum`): autograd
    would keep the fp32 copy, 4 T K H bytes (a quarter of a DeepSeek-V3 MoE layer's saved bytes in bf16).
    """
    return _WeightedSum.apply(slots, topk_weights)


def weighted_scatter(rows: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """rows [n, H], weights [n], tokens [n] int64 -> [num_tokens, H] fp32 at least: row i times weights[i] added
    into tokens[i]'s sum (the all-gather dispatcher's combine). Kept for backward: the rows in their own dtype,
    the weights and the token index, not the fp32 rows nor their weighted copies. On CUDA index_add uses atomics:
    the order of a token's terms may vary."""
    return _WeightedScatter.apply(rows, weights, tokens, num_tokens)


def scatter_sum(rows: torch.Tensor, tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """rows [n, H], tokens [n] int64 -> [num_tokens, H] fp32 at least: each row added into tokens[i]'s sum (the
    hierarchical dispatcher's sum of a token's node partials). Kept for backward: the token index only, where
    index_add of the widened rows would keep those rows (fp32, n H 4 bytes)."""
    return _ScatterSum.apply(rows, tokens, num_tokens)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _WeightedSum(torch.autograd.Function):
    """The weighted sum over a token's K slots, its gradients the ones autograd forms for the same ops (the
    same products, the same reductions: equal bit for bit on CPU)."""

    @staticmethod
    def forward(ctx, slots: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = topk_weights.shape
        ctx.save_for_backward(slots, topk_weights)
        wide = slots.to(_wide(slots.dtype)).view(tokens, top_k, slots.shape[-1])
        return (wide * topk_weights.unsqueeze(-1)).sum(dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        slots, topk_weights = ctx.saved_tensors
        tokens, top_k = topk_weights.shape
        grad = grad.unsqueeze(1)
        grad_slots = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_slots = (grad * topk_weights.unsqueeze(-1)).to(slots.dtype).view(slots.shape)
        if ctx.needs_input_grad[1]:
            wide = slots.to(_wide(slots.dtype)).view(tokens, top_k, slots.shape[-1])
            grad_weights = (grad * wide).sum(dim=-1).to(topk_weights.dtype)
        return grad_slots, grad_weights


class _WeightedScatter(torch.autograd.Function):
    """`weighted_scatter`, its gradients the ones autograd forms for index_add of the widened weighted rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, num_tokens: int):
        ctx.save_for_backward(rows, weights, tokens)
        wide = rows.to(_wide(rows.dtype)) * weights.unsqueeze(-1)
        return wide.new_zeros(num_tokens, rows.shape[1]).index_add(0, tokens, wide)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weights, tokens = ctx.saved_tensors
        grad = grad.index_select(0, tokens)
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_rows = (grad * weights.unsqueeze(-1)).to(rows.dtype)
        if ctx.needs_input_grad[1]:
            grad_weights = (grad * rows.to(_wide(rows.dtype))).sum(dim=-1).to(weights.dtype)
        return grad_rows, grad_weights, None, None


class _ScatterSum(torch.autograd.Function):
    """`scatter_sum`, its gradient the one autograd forms for index_add of the widened rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.dtype = rows.dtype
        wide = rows.to(_wide(rows.dtype))
        return wide.new_zeros(num_tokens, rows.shape[1]).index_add(0, tokens, wide)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        return grad.index_select(0, tokens).to(ctx.dtype), None, None
