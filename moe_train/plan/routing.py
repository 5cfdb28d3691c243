"""Real routing, torch-free: a run's routing trace (routing.jsonl, `logging.routing_trace`), the per-rank loads
it gives under any expert placement and ep, and the packing of experts onto ranks (`moe-train experts place`).

The trace holds tokens per expert (global ids) per MoE layer per step, so the loads of any layout follow from
it: rank r of ep holds the experts its placement gives it, and receives the sum of their tokens. That is what
`plan --routing` prices (the most loaded rank's expert GEMM rows and all-to-all bytes) and what `experts place`
balances. Nothing here models how tokens spread; it adds up what was measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moe_train.config.placement import Placement, contiguous
from moe_train.run_files import ROUTING_TRACE_FILE


class TraceError(ValueError):
    """A run folder whose routing trace is missing or unreadable; the message names the file."""


@dataclass(frozen=True)
class ExpertLoads:
    """Tokens per expert per MoE layer, summed over the trace's steps, and how many steps that is."""

    steps: int
    tokens: dict[int, list[int]]  # MoE layer index -> tokens per expert (global ids), over `steps` steps
    recorded_ep: int

    @property
    def num_experts(self) -> int:
        return len(next(iter(self.tokens.values())))

    def per_step(self, layer: int) -> list[float]:
        return [t / self.steps for t in self.tokens[layer]]


def read_trace(run_dir: str | Path) -> ExpertLoads:
    """The run folder's routing trace summed over its steps (TraceError if it has none)."""
    path = Path(run_dir) / ROUTING_TRACE_FILE
    if not path.is_file():
        raise TraceError(f"{path}: no routing trace (train with logging.routing_trace: true)")
    tokens: dict[int, list[int]] = {}
    steps, ep = 0, 1
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            steps, ep = steps + 1, record["ep"]
            for layer, counts in record["experts"].items():
                total = tokens.setdefault(int(layer), [0] * len(counts))
                for expert, count in enumerate(counts):
                    total[expert] += count
    except (ValueError, KeyError, TypeError) as error:
        raise TraceError(f"{path}: not a routing trace ({error})") from None
    if not steps:
        raise TraceError(f"{path}: the routing trace holds no step")
    return ExpertLoads(steps=steps, tokens=tokens, recorded_ep=ep)


def rank_loads(expert_tokens: list[float], ranks: tuple[tuple[int, ...], ...]) -> list[float]:
    """The tokens each rank receives: the sum over the experts it holds."""
    return [sum(expert_tokens[e] for e in experts) for experts in ranks]


def max_over_mean(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 0.0


def pack(expert_tokens: list[float], *, ep: int) -> tuple[tuple[int, ...], ...]:
    """Experts onto ep ranks of E/ep each: the most loaded expert first onto the least loaded rank that still
    has room (greedy longest-processing-time with a capacity), then pairwise swaps between the most loaded rank
    and any other while one lowers the maximum. Ties go to the lower expert and rank ids (deterministic)."""
    experts, local = len(expert_tokens), len(expert_tokens) // ep
    ranks: list[list[int]] = [[] for _ in range(ep)]
    loads = [0.0] * ep
    for expert in sorted(range(experts), key=lambda e: (-expert_tokens[e], e)):
        rank = min((r for r in range(ep) if len(ranks[r]) < local), key=lambda r: (loads[r], r))
        ranks[rank].append(expert)
        loads[rank] += expert_tokens[expert]
    improved = True
    while improved:
        improved = False
        top = max(range(ep), key=lambda r: (loads[r], -r))
        for other in range(ep):
            best = None
            for a in ranks[top]:
                for b in ranks[other]:
                    delta = expert_tokens[a] - expert_tokens[b]  # moved from top to other
                    if delta > 0 and loads[other] + delta < loads[top] and (best is None or delta > best[0]):
                        best = (delta, a, b)
            if best is not None and max(loads[top] - best[0], loads[other] + best[0]) < loads[top]:
                delta, a, b = best
                ranks[top][ranks[top].index(a)], ranks[other][ranks[other].index(b)] = b, a
                loads[top] -= delta
                loads[other] += delta
                improved = True
                break
    return tuple(tuple(sorted(r)) for r in ranks)


@dataclass(frozen=True)
class PackedLayer:
    layer: int
    before: float  # max/mean rank load under the contiguous placement
    after: float  # under the packed one


def place(loads: ExpertLoads, *, ep: int) -> tuple[Placement, list[PackedLayer]]:
    """A placement over `ep` ranks packed from the trace's loads, and each layer's objective before and after."""
    experts = loads.num_experts
    if ep < 1 or experts % ep:
        raise ValueError(f"--ep {ep} must divide the {experts} experts")
    layers = sorted(loads.tokens)
    default = contiguous(num_experts=experts, ep=ep, layers=layers)
    ranks, report = {}, []
    for layer in layers:
        tokens = loads.per_step(layer)
        ranks[layer] = pack(tokens, ep=ep)
        report.append(
            PackedLayer(
                layer,
                max_over_mean(rank_loads(tokens, default.ranks[layer])),
                max_over_mean(rank_loads(tokens, ranks[layer])),
            )
        )
    return Placement(num_experts=experts, ep=ep, ranks=ranks), report


# ------------------------------------------------------------------------------------------ plan --routing


@dataclass(frozen=True)
class TracedRouting:
    """A trace's routing in the form plan/comm_bytes.py's dispatch model reads measure's forced routing
    (`counts`): a micro-batch's slots on each expert slot of the layout, this rank's own slots first. Every rank
    is taken to route as the whole batch did (the trace holds no sources), which is exact when they do."""

    shares: tuple[float, ...]  # per slot, from this rank's own on: the share of the layer's routed slots
    top_k: int

    def counts(self, tokens: int) -> list[float]:
        return [tokens * self.top_k * share for share in self.shares]


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer of the planned layout under the trace's loads, per expert-parallel rank and step."""

    layer: int
    rank_rows: list[float]  # expert GEMM rows each ep rank receives
    rows_mean: float  # the even share (what forced even routing gives every rank)
    rank_all_to_all_bytes: list[float]  # all-to-all bytes each ep rank sends (as measure counts them)
    all_to_all_bytes_balanced: float  # under measure's forced (even) routing
    rank_exchange_bytes: list[float]  # the bytes that time each rank's all-to-alls (`routing_plan`)
    exchange_bytes_balanced: float
    # of them, the forwards' (the rest ran in the backwards): what ep_overlap hides behind which (plan/overlap.py)
    rank_exchange_forward_bytes: list[float]
    exchange_forward_bytes_balanced: float

    @property
    def straggler_rank(self) -> int:
        return max(range(len(self.rank_rows)), key=lambda r: (self.rank_rows[r], -r))

    @property
    def rows_max(self) -> float:
        return self.rank_rows[self.straggler_rank]

    @property
    def all_to_all_bytes_max(self) -> float:
        return max(self.rank_all_to_all_bytes)

    @property
    def imbalance(self) -> float:
        return self.rows_max / self.rows_mean if self.rows_mean else 1.0


@dataclass(frozen=True)
class RoutingPlan:
    ep: int
    placement: str  # "contiguous" or the recipe's placement file
    steps: int  # of the trace
    layers: list[LayerRouting]

    @property
    def imbalance(self) -> float:
        """The measured `moe_imbalance`: every layer's all-to-all waits for its own most loaded rank, so the
        step pays each layer's maximum; their mean is the factor on the even share of expert rows."""
        return sum(layer.imbalance for layer in self.layers) / len(self.layers)

    def to_json(self) -> dict:
        return {
            "ep": self.ep,
            "placement": self.placement,
            "trace_steps": self.steps,
            "moe_imbalance": self.imbalance,
            "layers": {
                str(x.layer): {
                    "straggler_rank": x.straggler_rank,
                    "rows_max": x.rows_max,
                    "rows_mean": x.rows_mean,
                    "rank_rows": x.rank_rows,
                    "all_to_all_bytes_max": x.all_to_all_bytes_max,
                    "all_to_all_bytes_balanced": x.all_to_all_bytes_balanced,
                    "rank_all_to_all_bytes": x.rank_all_to_all_bytes,
                    "rank_exchange_bytes": x.rank_exchange_bytes,
                    "exchange_bytes_balanced": x.exchange_bytes_balanced,
                }
                for x in self.layers
            },
        }


def routing_plan(recipe, loads: ExpertLoads) -> RoutingPlan:
    """The trace's loads on the recipe's layout: its ep and its placement (the file, or contiguous), whatever
    ep recorded the trace. A rank's rows are its experts' share of the trace's tokens times what the layout
    sends its ep group per step (each rank routes its micro-batches' tokens, top_k slots each; etp ranks
    receive every row of their ep rank). Its all-to-all bytes are plan/comm_bytes.py's dispatch model (the
    counts exchange, the rows in the activation dtype and their fp32 weights, forward and backward, again in a
    recompute that reruns the layer) fed the trace's shares in place of measure's forced routing; the
    all-gather dispatcher's traffic does not depend on the routing, and the hierarchical one's needs each
    token's spread over nodes, which the trace does not hold: both stay the balanced model's."""
    from moe_train.config.placement import recipe_placement

    from .assumptions import Assumptions
    from .comm_bytes import _ModelComm
    from .estimate import _activation_layout
    from .rank_layout import PlanLayout

    m, layout = recipe.model, PlanLayout.from_recipe(recipe)
    if loads.num_experts != m.moe.num_experts:
        raise ValueError(f"the trace routes {loads.num_experts} experts, the recipe has {m.moe.num_experts}")
    missing = [i for i in range(m.num_layers + m.mtp_layers) if m.is_moe_layer(i) and i not in loads.tokens]
    if missing:
        raise ValueError(f"the trace has no MoE layers {missing} of the recipe")
    placement = recipe_placement(recipe)
    if placement is None:
        placement = contiguous(num_experts=m.moe.num_experts, ep=layout.ep, layers=sorted(loads.tokens))
    tokens_per_rank = layout.micro_batches * layout.micro_batch * layout.seq_length / layout.cp / layout.tp
    mean = tokens_per_rank * m.moe.top_k * layout.etp
    lay = _activation_layout(recipe, layout, Assumptions())
    policy = layout.recompute
    passes = layout.micro_batches * (2 if policy.granularity == "full" or "moe" in policy.modules else 1)

    def traffic(routing) -> tuple[float, float, float]:
        """(the all-to-all bytes one rank sends per step in one MoE layer under `routing`, the bytes that time
        them, of those the forwards'). An exchange lasts as long as the larger of what a rank sends and
        receives in it; every rank routing alike, what it receives in the dispatch is what it sends back in the
        combine and the reverse, so both row exchanges take its larger payload of the two (the counts and
        weights as sent). A recompute's exchanges run in the backward."""
        comm = _ModelComm(m, layout, lay, cp_comm=recipe.parallel.cp_exchange(m.family), routing=routing)
        sent = timed = forward = 0.0
        for direction, times in (("forward", passes), ("backward", layout.micro_batches)):
            payloads = sorted(c[2] for c in comm._dispatch(direction) if c[1] == "all_to_all")
            sent += times * sum(payloads)
            if len(payloads) >= 2:  # the two row exchanges are the two largest (a row outweighs its weight)
                payloads[-2] = payloads[-1]
            timed += times * sum(payloads)
            if direction == "forward":
                forward = layout.micro_batches * sum(payloads)
        return sent, timed, forward

    traced = m.moe.dispatcher == "alltoall"
    balanced = traffic(None)
    layers = []
    for layer in sorted(i for i in loads.tokens if m.is_moe_layer(i)):
        tokens = loads.tokens[layer]
        total = sum(tokens) or 1
        ranks = placement.ranks[layer]
        shares = rank_loads([t / total for t in tokens], ranks)
        rank_traffic = []
        for r in range(layout.ep):
            order = [e for rank in (*ranks[r:], *ranks[:r]) for e in rank]  # the slots, this rank's first
            routing = TracedRouting(tuple(tokens[e] / total for e in order), m.moe.top_k)
            rank_traffic.append(traffic(routing) if traced else balanced)
        layers.append(
            LayerRouting(
                layer,
                [s * layout.ep * mean for s in shares],
                mean,
                [sent for sent, _, _ in rank_traffic],
                balanced[0],
                [timed for _, timed, _ in rank_traffic],
                balanced[1],
                [forward for _, _, forward in rank_traffic],
                balanced[2],
            )
        )
    return RoutingPlan(ep=layout.ep, placement=recipe.model.moe.placement, steps=loads.steps, layers=layers)


def all_to_all_seconds(routing: RoutingPlan, recipe, hardware, assumptions, phases=None) -> float:
    """Seconds per step the traced all-to-alls add to the balanced plan's exposed communication: per layer its
    slowest rank's (every rank waits for it at the combine), on the plan's links (plan/comm_bytes.py
    `comm_time`), less the part the recipe's `parallel.ep_overlap` hides behind the paired micro-batch's
    compute (`phases`: the plan's `ep_phases`, plan/overlap.py; None or not overlapped: nothing hides), minus
    what the balanced routing's bytes already cost."""
    from .comm_bytes import CommBytes, comm_time
    from .rank_layout import PlanLayout

    layout = PlanLayout.from_recipe(recipe)

    def exposed(payload: float, forward: float) -> float:
        counter = CommBytes()
        counter.add("ep", "all_to_all", payload, layout.ep)
        seconds = sum(comm_time(counter, layout, hardware, assumptions)["total"].values())
        if phases is None or payload <= 0:
            return seconds
        forward_s = seconds * forward / payload
        return seconds - phases.hidden_s(forward_s, seconds - forward_s)

    return sum(
        max(exposed(b, f) for b, f in zip(layer.rank_exchange_bytes, layer.rank_exchange_forward_bytes, strict=True))
        - exposed(layer.exchange_bytes_balanced, layer.exchange_forward_bytes_balanced)
        for layer in routing.layers
    )
