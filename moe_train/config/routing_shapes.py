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
    node b): the rows the hierarchical dispatcher sends there. Token t's K slots are the consecutive experts
    tK .. tK + K - 1 (mod E), so the nodes it needs are one cyclic run of nodes; the pattern repeats every
    E / gcd(K, E) tokens. One step per token of a period (never per slot), at most E of them."""
    per_node = num_experts // nodes
    period = num_experts // math.gcd(top_k, num_experts)
    cycles, rest = divmod(tokens, period)
    every = 0  # tokens that need every node
    starts = [0] * (nodes + 1)  # a difference array over nodes: runs [first, last] add their weight
    for t in range(min(period, tokens)):
        weight = cycles + (t < rest)
        first = t * top_k % num_experts // per_node
        last = (t * top_k % num_experts + top_k - 1) // per_node  # past nodes - 1: the run wraps around
        if last - first + 1 >= nodes:
            every += weight
        elif last < nodes:
            starts[first] += weight
            starts[last + 1] -= weight
        else:
            starts[first] += weight
            starts[0] += weight
            starts[last - nodes + 1] -= weight
    counts, running = [], every
    for node in range(nodes):
        running += starts[node]
        counts.append(running)
    return counts
