"""Routing's shapes computed on the host, torch-free, where the model and the planner must agree: the expert
capacity (the rows each expert takes when `capacity_factor` is set), how many distinct destinations (nodes,
ranks) a token of the model's router needs in expectation, and `measure`'s forced routing, whose counts (the
slots of each expert, the tokens each node needs) the dispatchers size their all-to-alls from without reading
the device and the planner counts. Both ask here, so they agree.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


def expert_capacity(*, num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert: ceil(T * K / E * factor) (factor 1: every expert takes exactly its fair share)."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


Poly = dict[tuple[int, int, int], int]  # (groups chosen, experts chosen, domains hit) -> number of ways


def _multiply(left: Poly, right: Poly, *, groups: int, top_k: int) -> Poly:
    out: Poly = {}
    for (c1, j1, d1), w1 in left.items():
        for (c2, j2, d2), w2 in right.items():
            if c1 + c2 <= groups and j1 + j2 <= top_k:
                key = (c1 + c2, j1 + j2, d1 + d2)
                out[key] = out.get(key, 0) + w1 * w2
    return out


def _power(unit: Poly, times: int, *, groups: int, top_k: int) -> Poly:
    out: Poly = {(0, 0, 0): 1}
    for _ in range(times):
        out = _multiply(out, unit, groups=groups, top_k=top_k)
    return out


@functools.cache
def destination_histogram(*, num_experts: int, top_k: int, domains: int, num_groups: int = 1,
                          group_top_k: int = 1) -> tuple[float, ...]:
    """P(a token's top_k experts lie in exactly d of `domains` equal contiguous blocks of experts), index d:
    the distinct nodes (or ranks) a token is sent to, for a router whose scores are independent and identically
    distributed over the experts (Megatron-Core's forced balancing draws random logits).

    Uniform top-k (one group): the K experts are a uniform K-subset of E, so the ways to hit exactly d blocks of
    m = E / domains experts are the coefficient of x^K y^d in (1 + y((1 + x)^m - 1))^domains, over C(E, K).
    Group-limited (DeepSeek-V3: num_groups G, group_top_k g): the g groups are a uniform g-subset of G (each
    group's score is the sum of its two best, the same distribution for every group), and every chosen group
    gives at least one expert (it was chosen for its best scores), the K experts uniform among those subsets:
    a chosen group of s = E / G experts contributes (1 + x)^s - 1. Groups inside blocks (G a multiple of
    domains): a block is hit when one of its groups is chosen. Blocks inside groups: a chosen group spreads its
    experts over its blocks as the uniform case does. Exact integer counts (the polynomials' coefficients).
    DeepSeek-V3 at 4 nodes: uniform 3.62, group-limited 3.14 (a simulation of its router on random logits: 3.12);
    at EP32, 8 experts a rank: 7.27 / 6.80 distinct ranks (the simulation: 7.26 / 6.84)."""
    if num_experts % domains or num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not divide into {domains} blocks and {num_groups} groups")
    groups, keep = (num_groups, group_top_k) if group_top_k < num_groups else (1, 1)
    size = num_experts // groups
    if groups % domains == 0:  # groups inside blocks: per block, its chosen groups' experts, hit if any
        chosen = {(1, j, 0): math.comb(size, j) for j in range(1, min(size, top_k) + 1)}
        block = _power({(0, 0, 0): 1, **chosen}, groups // domains, groups=keep, top_k=top_k)
        unit = {(c, j, int(c > 0)): w for (c, j, _), w in block.items()}
        total = _power(unit, domains, groups=keep, top_k=top_k)
    elif domains % groups == 0:  # blocks inside groups: a chosen group fills its blocks like the uniform case
        per = num_experts // domains
        block = {(0, j, int(j > 0)): math.comb(per, j) for j in range(0, min(per, top_k) + 1)}
        spread = _power(block, domains // groups, groups=keep, top_k=top_k)
        unit = {(1, j, d): w for (_, j, d), w in spread.items() if j > 0}
        unit[(0, 0, 0)] = 1
        total = _power(unit, groups, groups=keep, top_k=top_k)
    else:
        raise ValueError(f"{num_groups} expert groups and {domains} blocks do not nest")
    ways = [0] * (min(top_k, domains) + 1)
    for (c, j, d), w in total.items():
        if c == keep and j == top_k:
            ways[d] += w
    return tuple(w / sum(ways) for w in ways)


def expected_destinations(**routing: int) -> float:
    """The mean of `destination_histogram(**routing)`: distinct blocks (nodes, ranks) per token."""
    return sum(d * p for d, p in enumerate(destination_histogram(**routing)))


@dataclass(frozen=True)
class ForcedRouting:
    """`measure`'s routing without values: deterministic, the same on every rank, and the tokens' distinct
    domains (the hierarchical dispatcher's nodes) following the model's router; plan counts the same pattern.

    One domain (every dispatcher but the hierarchical one, whose bytes do not depend on the spread): token t
    to experts (t K + j) mod E, as before. Several (N): the tokens go in rotation groups of N: of the T // N
    groups, round(T / N x P(d)) span d domains (`destination_histogram`; largest remainders, the most domains
    first); a group's token i takes domains i, i + 1, ..., i + d - 1 (mod N), K split over them evenly (the
    first K mod d one more), and in each domain the next experts round-robin. So every domain gets the same
    tokens and slots, and where E / N divides T K / N every expert gets exactly T K / E slots; the realised
    mean spread is the expectation's integer version at T / N groups (3.1426 of 3.1429 for DeepSeek-V3 at 4
    nodes and 4,096 tokens). T mod N tokens left over form a partial group of the likeliest span."""

    top_k: int
    num_experts: int
    domains: int = 1
    num_groups: int = 1
    group_top_k: int = 1

    @classmethod
    def of(cls, moe, domains: int = 1) -> ForcedRouting:
        """The forced routing of a `MoEConfig` (its router's groups) over `domains` blocks of experts."""
        groups = moe.router.num_groups or 1
        return cls(top_k=moe.top_k, num_experts=moe.num_experts, domains=domains, num_groups=groups,
                   group_top_k=moe.router.group_top_k or groups)

    def histogram(self) -> tuple[float, ...]:
        return destination_histogram(num_experts=self.num_experts, top_k=self.top_k, domains=self.domains,
                                     num_groups=self.num_groups, group_top_k=self.group_top_k)

    def spans(self, groups: int) -> list[int]:
        """Rotation groups spanning d domains, index d, of `groups`: round(groups x P(d)), largest remainders
        first (ties: the more domains)."""
        exact = [groups * p for p in self.histogram()]
        spans = [math.floor(x) for x in exact]
        order = sorted(range(len(exact)), key=lambda d: (spans[d] - exact[d], -d))
        for d in order[: groups - sum(spans)]:
            spans[d] += 1
        return spans

    def indices(self, tokens: int) -> tuple[tuple[int, ...], ...]:
        """Each token's K experts (global ids)."""
        return _indices(self, tokens)

    def counts(self, tokens: int) -> list[int]:
        """Slots per expert: what a dispatcher needs for its split sizes without a device read."""
        return list(_counts(self, tokens))

    def domain_tokens(self, tokens: int) -> list[int]:
        """Tokens that need each domain: the rows the hierarchical dispatcher sends to each node."""
        return list(_domain_tokens(self, tokens))

    def mean_spread(self, tokens: int) -> float:
        """Distinct domains per token of this pattern (the expectation's integer version)."""
        return sum(self.domain_tokens(tokens)) / tokens if tokens else 0.0


@functools.cache
def _indices(routing: ForcedRouting, tokens: int) -> tuple[tuple[int, ...], ...]:
    k, e, domains = routing.top_k, routing.num_experts, routing.domains
    if domains == 1:
        return tuple(tuple((t * k + j) % e for j in range(k)) for t in range(tokens))
    per = e // domains
    groups, rest = divmod(tokens, domains)
    spans = routing.spans(groups)
    widths = [d for d in range(len(spans) - 1, 0, -1) for _ in range(spans[d])]
    likeliest = max(range(len(spans)), key=lambda d: (routing.histogram()[d], d))
    filled, out = [0] * domains, []
    for width, size in [(w, domains) for w in widths] + [(likeliest, rest)]:
        base, extra = divmod(k, width)
        for i in range(size):
            experts = []
            for j in range(width):
                block = (i + j) % domains
                for _ in range(base + (j < extra)):
                    experts.append(block * per + filled[block] % per)
                    filled[block] += 1
            out.append(tuple(experts))
    return tuple(out)


@functools.cache
def _counts(routing: ForcedRouting, tokens: int) -> tuple[int, ...]:
    counts = [0] * routing.num_experts
    for experts in _indices(routing, tokens):
        for expert in experts:
            counts[expert] += 1
    return tuple(counts)


@functools.cache
def _domain_tokens(routing: ForcedRouting, tokens: int) -> tuple[int, ...]:
    per, counts = routing.num_experts // routing.domains, [0] * routing.domains
    for experts in _indices(routing, tokens):
        for block in {expert // per for expert in experts}:
            counts[block] += 1
    return tuple(counts)
