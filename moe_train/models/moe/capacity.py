"""Expert capacity and token dropping: bound the rows each expert processes when `capacity_factor` is set.

Dropless routing (capacity_factor null) is the default; a capacity gives static per-expert shapes (with
`pad_to_capacity`) at the cost of dropping the assignments that overflow an expert. A dropped assignment
contributes nothing to its token's output; the token's other experts keep their weights (no renormalisation),
and the residual connection carries the token on. The capacity itself (config/routing_shapes.py
`expert_capacity`) is host arithmetic the planner shares.
"""

from __future__ import annotations

import torch


def capacity_keep_mask(
    topk_indices: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int, capacity: int, policy: str
) -> torch.Tensor:
    """[T, K] bool: which token->expert assignments fit in their expert's capacity.

    policy "probs" keeps each expert's `capacity` highest-weight assignments (ties: the earlier token);
    "position" keeps each expert's earliest tokens in the batch order.
    """
    tokens = topk_indices.shape[0]
    routed = torch.zeros(tokens, num_experts, dtype=torch.bool, device=topk_indices.device)
    routed.scatter_(1, topk_indices, True)
    if policy == "probs":
        weights = torch.full((tokens, num_experts), -1.0, dtype=torch.float32, device=topk_indices.device)
        weights.scatter_(1, topk_indices, topk_weights.detach().float())
        # A stable descending sort per expert, so ties keep the earlier token as "position" would.
        order = torch.sort(weights, dim=0, descending=True, stable=True).indices[: min(capacity, tokens)]
        fits = torch.zeros_like(routed).scatter_(0, order, True)
    elif policy == "position":
        fits = torch.cumsum(routed.to(torch.int64), dim=0) <= capacity
    else:
        raise ValueError(f"model.moe.drop_policy must be 'probs' or 'position', got {policy!r}")
    return (routed & fits).gather(1, topk_indices)
