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
class LayerRouting:
    """One MoE layer of the planned layout under the trace's loads, per expert-parallel rank and step."""

    layer: int
    straggler_rank: int
    rows_max: float  # expert GEMM rows of the most loaded rank
    rows_mean: float  # the even share (what forced even routing gives every rank)
    all_to_all_bytes_max: float  # token bytes the most loaded rank sends to other ranks
    all_to_all_bytes_mean: float

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
                    "all_to_all_bytes_max": x.all_to_all_bytes_max,
                    "all_to_all_bytes_mean": x.all_to_all_bytes_mean,
                }
                for x in self.layers
            },
        }


def routing_plan(recipe, loads: ExpertLoads) -> RoutingPlan:
    """The trace's loads on the recipe's layout: its ep and its placement (the file, or contiguous), whatever
    ep recorded the trace. A rank's rows are its experts' share of the trace's tokens times what the layout
    sends its ep group per step (each rank routes its micro-batches' tokens, top_k slots each; etp ranks
    receive every row of their ep rank). The all-to-all bytes count the rows as the dispatcher moves them, the
    hidden state in the activation dtype, forward and backward: a rank sends its own tokens' slots (the even
    share: every rank routes as many tokens) and returns its experts' rows, and of either (ep - 1) / ep cross
    to another rank (tokens come from every rank alike: the trace holds no sources)."""
    from moe_train.config.placement import recipe_placement

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
    row_bytes = m.hidden_size * (4 if recipe.train.precision == "fp32" else 2)
    crossing = (layout.ep - 1) / layout.ep
    layers = []
    for layer in sorted(i for i in loads.tokens if m.is_moe_layer(i)):
        tokens = loads.tokens[layer]
        total = sum(tokens) or 1
        shares = rank_loads([t / total for t in tokens], placement.ranks[layer])
        straggler = max(range(layout.ep), key=lambda r: (shares[r], -r))
        rows_max = shares[straggler] * layout.ep * mean
        layers.append(
            LayerRouting(
                layer,
                straggler,
                rows_max,
                mean,
                2 * (mean + rows_max) * crossing * row_bytes,
                4 * mean * crossing * row_bytes,
            )
        )
    return RoutingPlan(ep=layout.ep, placement=recipe.model.moe.placement, steps=loads.steps, layers=layers)
