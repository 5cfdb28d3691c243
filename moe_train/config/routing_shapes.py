"""Routing's shapes computed on the host, torch-free, where the model and the planner must agree: the expert
capacity (the rows each expert takes when `capacity_factor` is set), and under forced even routing (`measure`
routes token t to experts (tK + j) mod E: models/moe/router.py `even_topk_indices`) the tokens each node
needs, which the hierarchical dispatcher sizes its network all-to-all from without reading the device and the
planner counts. Both ask here, so they agree.
"""

from __future__ import annotations

import math


def expert_capacity(*, num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert: ceil(T * K / E * factor) (factor 1: every expert takes exactly its fair share)."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def even_share(slots: int, num_experts: int, local_experts: int) -> int:
    """Slots of `slots` (forced even routing: slot s to expert s mod E) that the experts of expert-parallel
    rank 0 receive (the most loaded: the remainder goes to the first experts)."""
    base, extra = divmod(slots, num_experts)
    return local_experts * base + min(extra, local_experts)


def even_node_tokens(tokens: int, top_k: int, num_experts: int, nodes: int) -> list[int]:
    """Under forced even routing, how many of `tokens` tokens need each node (experts [b E/N, (b + 1) E/N) on
    node b): the rows the hierarchical dispatcher sends there. The pattern repeats every E / gcd(K, E) tokens."""
    per_node = num_experts // nodes
    period = num_experts // math.gcd(top_k, num_experts)

    def needs(t: int) -> set[int]:
        return {((t * top_k + j) % num_experts) // per_node for j in range(top_k)}

    counts = [0] * nodes
    cycles, rest = divmod(tokens, period)
    for t in range(period):
        for node in needs(t):
            counts[node] += cycles + (t < rest)
    return counts
