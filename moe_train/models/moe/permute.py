"""Token slots <-> expert-major rows: the local half of every dispatcher.

A token routed to K experts has K slots (slot t*K + k). `permute` copies each kept slot's hidden state into a
buffer sorted by expert (stable: within an expert, token order), so each expert's rows are contiguous for one
grouped GEMM, and each slot's routing weight beside its row (the experts apply it in their activation, as
Megatron-Core's weighted SwiGLU does); `unpermute` reads the rows back into slot order and `slot_sum` adds a
token's K rows, unweighted, keeping nothing for backward. The expert-parallel dispatchers move the permuted
buffer and its weights between ranks and reuse these on both ends.
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
    top_k: int  # slots per token (K)
    row_slots: torch.Tensor | None = None  # padded: [num_rows] int64 slot of each buffer row, T*K for padding


def permute(
    hidden: torch.Tensor,
    topk_indices: torch.Tensor,
    probs: torch.Tensor,
    *,
    num_experts: int,
    keep: torch.Tensor | None = None,
    pad_to: int | None = None,
    kept: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Permutation]:
    """hidden [T, H], topk_indices [T, K], probs [T, K] (the routing weights) -> (rows [N, H] sorted by expert,
    row_probs [N] (each row's slot's weight, 0 for padding), rows per expert [E] int64, perm).

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
        return _padded(hidden, probs, experts, order, num_experts=num_experts, top_k=top_k, pad_to=pad_to,
                       dropping=keep is not None)
    counts = count_per_expert(experts, num_experts + 1)[:num_experts]
    if kept is None:
        kept = int(counts.sum()) if keep is not None else tokens * top_k
    order = order[:kept]
    if kept < tokens * top_k:  # the weights' gather keeps its index: the kept slots', not all slots' storage
        order = order.clone()
    rows = hidden.index_select(0, order // top_k)
    row_probs = probs.reshape(-1).index_select(0, order)
    slot_rows = torch.full((tokens * top_k,), kept, dtype=torch.int64, device=hidden.device)
    slot_rows[order] = torch.arange(kept, device=hidden.device)
    return rows, row_probs, counts, Permutation(slot_rows=slot_rows, num_rows=kept, has_dropped=kept < tokens * top_k,
                                                 top_k=top_k)


def _padded(hidden: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, order: torch.Tensor, *,
            num_experts: int, top_k: int, pad_to: int,
            dropping: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Permutation]:
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
    row_probs = torch.cat([probs.reshape(-1), probs.new_zeros(1)]).index_select(0, row_slots)
    counts = torch.full((num_experts,), pad_to, dtype=torch.int64, device=hidden.device)
    return rows, row_probs, counts, Permutation(slot_rows=slot_rows, num_rows=num_rows, has_dropped=dropping,
                                                top_k=top_k, row_slots=row_slots)


def unpermute(rows: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """rows [N, H] in the order `permute` made -> [T*K, H] in slot order; dropped slots are zero rows."""
    if perm.has_dropped:  # dropped slots read an appended zero row
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    return rows.index_select(0, perm.slot_rows)


def slot_sum(slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """slots [T*K, H] (already weighted: the experts applied each slot's weight) -> [T, H] fp32 (fp64 for fp64
    slots): each token's sum of its K slots. The sum runs in fp32 at least (a bf16 sum of K terms loses bits the
    residual stream would keep); widening and summing keep nothing for backward, so the returned expert rows are
    not kept (the weighted combine kept them, 2 T K H bytes, to differentiate the weights)."""
    return slots.to(_wide(slots.dtype)).view(-1, top_k, slots.shape[-1]).sum(dim=1)


def scatter_sum(rows: torch.Tensor, tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """rows [n, H], tokens [n] int64 -> [num_tokens, H] fp32 at least: each row added into tokens[i]'s sum (the
    all-gather dispatcher's combine, the hierarchical dispatcher's node partials and their sum). Kept for
    backward: the token index only, where index_add of the widened rows would keep those rows (fp32, n H 4
    bytes). On CUDA index_add uses atomics: the order of a token's terms may vary."""
    return _ScatterSum.apply(rows, tokens, num_tokens)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


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
