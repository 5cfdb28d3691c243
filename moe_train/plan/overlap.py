"""What `parallel.ep_overlap` hides of the expert-parallel communication, from the schedule's structure.

The engine's overlapped step (parallel/overlap.py, pp = 1) runs M micro-batches as F0 alone (warm-up), the pairs
(B_i, F_i+1) for i = 0 .. M-2, then B_M-1 alone (cool-down). Inside a pair the two halves take turns at every
dispatcher collective: a collective one half issues runs while the other half computes up to its own next
collective, so a layer's dispatch and combine of F_i+1 run beside B_i's compute of a layer and the reverse.

The model: each MoE layer's EP communication of one phase (a micro-batch's forward, or its backward with what
recomputation reruns in it) hides behind the paired micro-batch's compute of the same kind of layer, at most
that compute: min(comm of the phase, the partner's compute). F0 and B_M-1 have no partner and hide nothing, so
at most (M - 1) / M of the EP communication hides; nothing hides at M = 1 or without ep_overlap. It is an upper
bound of what the baton achieves: the engine cuts a layer at its collectives, so a dispatch hides behind one
segment of the partner's layer (its attention and router, or its experts) and a combine behind another, and a
half that ends first leaves the other's last collectives exposed; the model does not split the layer into
those segments. All MoE layers of a rank are alike (forced even routing), so one layer's figures stand for all.

With pipelines (`parallel.pp_schedule` dualpipev, parallel/dual_pipe.py) the pairs are the schedule's
OVERLAP_F_B actions: pipeline rank r runs 2M forward and 2M backward passes (M on each of its two stages) and
`dualpipev_order` lists them as torch's DualPipeV orders them, with full backwards; its pairs (2 (M - 2 pp + r + 1)
+ pp - r - 1, one fewer on the last rank) hide, its ramps hide nothing. Both stages of a rank hold alike MoE
layers, so a layer's passes are paired in the rank's proportion, pairs / 2M: `PairedPhases.paired_passes`.

`parallel.split_wgrad` (models/moe/deferred_wgrad.py) runs the routed experts' weight gradients (their forward's
grouped-GEMM FLOPs again) while the layer's dispatch-backward all-to-all is in flight, in every backward, paired
or not (the cool-down's, and without ep_overlap every one). That collective is taken as half of the layer's
backward EP communication (the combine's backward moves the same rows the other way; the dispatch's also carries
the routing weights' 4 bytes a row): each backward phase hides min(its dispatch half, the delayed weight
gradients' seconds) behind them, and in a pair at most the whole phase behind those and the partner's compute.

No torch: the planner runs on the login node.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The groups the dispatchers' collectives run over (plan/comm_bytes.py's and measure's `<group>/<op>` keys):
# all-to-all and all-gather over ep, the all-gather dispatcher's over ep x etp, the hierarchical one's two stages
EP_GROUPS = ("ep", "ep_etp", "epnode", "eplocal")


@dataclass(frozen=True)
class ExposedComm:
    """One collective kind's EP communication per step: its own time and the part the pairs hide (the plan's
    counterpart of measure's `exposed_comm` entry, where the exposed part is measured as `waited_s`)."""

    own_s: float
    hidden_s: float

    @property
    def exposed_fraction(self) -> float:
        """(own - hidden) / own: 1 for the plain step, at least 1 / M under ep_overlap."""
        return 1.0 - self.hidden_s / self.own_s if self.own_s > 0 else 1.0

    def to_json(self) -> dict[str, float]:
        return {"own_s": self.own_s, "hidden_s": self.hidden_s, "exposed_fraction": self.exposed_fraction}


def dualpipev_order(*, pp: int, rank: int, micro_batches: int) -> list[tuple[str, ...]]:
    """The compute passes pipeline rank `rank` runs in a dualpipev step, in order: ("F0",) or ("B1",) alone (the
    pass and which of the rank's two stages: 0 on the way down the V, 1 on the way back), ("F0", "B1") for an
    overlapped pair. torch's ScheduleDualPipeV's steps, each input-gradient pass a full backward and the weight
    passes dropped, as parallel/dual_pipe.py runs it (tests/test_pipeline_overlap.py holds the two equal)."""
    down, up = pp - rank - 1, rank + 1  # the ranks below this one, and this one with those above
    order: list[tuple[str, ...]] = [("F0",)] * (2 * down) + [("F0",), ("F1",)] * up + [("B1",), ("F1",)] * down
    for i in range(micro_batches - 2 * pp + up):
        # torch keeps the last rank's first steady-state forward and backward apart, to shorten the bubble
        order += [("F0",), ("B1",)] if i == 0 and rank == pp - 1 else [("F0", "B1")]
        order.append(("F1", "B0"))
    order += [("B1",), ("F1", "B0")] * down + [("B1",), ("B0",)] * up + [("B0",)] * down
    return order


def dualpipev_bubble(*, pp: int, micro_batches: int) -> float:
    """plan's dualpipev bubble as a share of a rank's busy time: `dualpipev_idle` with a backward twice its
    forward (the FLOPs' ratio), over the rank's 2M forwards and 2M backwards."""
    return dualpipev_idle(pp=pp, micro_batches=micro_batches) / (2 * micro_batches * 3.0)


@functools.lru_cache(maxsize=1024)
def dualpipev_idle(*, pp: int, micro_batches: int, backward_ratio: float = 2.0) -> float:
    """A dualpipev step's idle time on each rank, in forward passes: every rank runs its `dualpipev_order` with
    each pass as soon as its inputs are there (a forward after the previous stage's forward of its micro-batch,
    a backward after its own forward and the next stage's backward), a forward taking 1, a backward
    `backward_ratio`, an overlapped pair both (it hides communication, not compute), stages alike and hand-offs
    free. The step ends with the last pass anywhere (the optimizer waits on every stage's gradient norm), so a
    rank idles the step's length less its own passes: 2M (1 + ratio) on every rank."""
    stages = {rank: (rank, 2 * pp - 1 - rank) for rank in range(pp)}  # the V: stage of passes "X0" and "X1"
    orders = {rank: dualpipev_order(pp=pp, rank=rank, micro_batches=micro_batches) for rank in range(pp)}
    done: dict[tuple[str, int, int], float] = {}  # (F | B, stage, micro-batch) -> finish time
    counts: dict[tuple[str, int], int] = {}
    free, position = dict.fromkeys(orders, 0.0), dict.fromkeys(orders, 0)

    def inputs(kind: str, stage: int, micro: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [] if stage == 0 else [("F", stage - 1, micro)]
        return [("F", stage, micro)] + ([] if stage == 2 * pp - 1 else [("B", stage + 1, micro)])

    while any(position[rank] < len(order) for rank, order in orders.items()):
        progressed = False
        for rank, order in orders.items():
            if position[rank] == len(order):
                continue
            passes = [(name[0], stages[rank][int(name[1])]) for name in order[position[rank]]]
            micro = [counts.get(key, 0) for key in passes]
            needs = [need for (kind, stage), mb in zip(passes, micro, strict=True) for need in inputs(kind, stage, mb)]
            if any(need not in done for need in needs):
                continue
            start = max([free[rank], *(done[need] for need in needs)])
            free[rank] = start + sum(1.0 if kind == "F" else backward_ratio for kind, _ in passes)
            for (kind, stage), mb in zip(passes, micro, strict=True):
                done[(kind, stage, mb)] = free[rank]
                counts[(kind, stage)] = mb + 1
            position[rank] += 1
            progressed = True
        if not progressed:
            raise ValueError(f"dualpipev order of pp {pp}, {micro_batches} micro-batches waits on itself")
    return max(free.values()) - 2 * micro_batches * (1 + backward_ratio)


def overlapped_pairs(*, pp: int, rank: int, micro_batches: int) -> tuple[int, int]:
    """(overlapped pairs, forward passes) of pipeline rank `rank` in a step under ep_overlap: M - 1 of M at
    pp = 1 (F0 and B_M-1 alone), dualpipev's OVERLAP_F_B actions of its 2M passes with pipelines."""
    if pp == 1:
        return max(micro_batches - 1, 0), micro_batches
    order = dualpipev_order(pp=pp, rank=rank, micro_batches=micro_batches)
    return sum(1 for passes in order if len(passes) == 2), 2 * micro_batches


@dataclass(frozen=True)
class PairedPhases:
    """What one MoE layer's EP communication can hide behind in a step: the micro-batches, whether they run in
    overlapped pairs, and one MoE layer's compute seconds for one micro-batch forward and backward (the
    backward with what recomputation reruns in it)."""

    micro_batches: int
    overlapped: bool
    forward_compute_s: float
    backward_compute_s: float
    delayed_wgrad_s: float = 0.0  # split_wgrad: one MoE layer's expert weight gradients in one backward; 0 off
    # (pairs, passes) of the rank's schedule (`overlapped_pairs`) where it is not pp = 1's M - 1 of M
    paired_passes: tuple[int, int] | None = None

    @property
    def pairs(self) -> float:
        """A layer's paired forwards in the step (as many backwards): M - 1 at pp = 1 (F1 .. F_M-1 with B0 ..
        B_M-2); with a pipeline its M passes in the rank's proportion of pairs to passes."""
        if not self.overlapped:
            return 0
        if self.paired_passes is None:
            return self.micro_batches - 1
        pairs, passes = self.paired_passes
        return self.micro_batches * pairs / passes if passes else 0.0

    def hidden_shares(self, forward_s: float, backward_s: float) -> tuple[float, float]:
        """(share of `forward_s`, share of `backward_s` hidden): one layer's EP seconds per step in the forward
        phases and in the backward phases, over all M micro-batches. A forward's communication hides behind the
        partner's backward compute and the reverse, at most that compute, in the pairs only; with split_wgrad a
        backward's dispatch half also behind its own delayed weight gradients, in every backward."""
        m = self.micro_batches
        if self.pairs == 0 and self.delayed_wgrad_s == 0:
            return 0.0, 0.0

        def share(comm: float, partner: float, own: float) -> float:
            """Of `comm` (over the M phases): each phase's part behind `own` (every phase) and, paired, behind
            the partner's compute too."""
            if comm <= 0:
                return 0.0
            per_phase = comm / m
            paired = min(per_phase, partner + own)
            return (self.pairs * paired + (m - self.pairs) * own) / comm

        fill = min(backward_s / m / 2, self.delayed_wgrad_s)  # a backward's dispatch half behind its weight grads
        return (share(forward_s, self.backward_compute_s, 0.0),
                share(backward_s, self.forward_compute_s, fill))

    def hidden_s(self, forward_s: float, backward_s: float) -> float:
        """Seconds hidden of one layer's EP communication per step (forward and backward phases' seconds)."""
        f, b = self.hidden_shares(forward_s, backward_s)
        return f * forward_s + b * backward_s


def exposed_comm(own_s: dict[str, float], forward_s: dict[str, float], phases: PairedPhases, *,
                 layers: int) -> dict[str, ExposedComm]:
    """Per `<group>/<op>` of the dispatchers' collectives: the step's own seconds (`own_s`, forward and backward
    phases together), of which `forward_s` ran in the forwards, over `layers` alike MoE layers. Each phase's
    hidden share applies to every collective kind of the phase in proportion to its seconds."""
    forward = sum(forward_s.get(k, 0.0) for k in own_s)
    backward = sum(own_s.values()) - forward
    f, b = phases.hidden_shares(forward / max(layers, 1), backward / max(layers, 1))
    return {key: ExposedComm(own, f * forward_s.get(key, 0.0) + b * (own - forward_s.get(key, 0.0)))
            for key, own in sorted(own_s.items())}
