"""Bytes one rank communicates per step, by `<group>/<op>` (the keys `moe-train measure` reports).

Payload (DECISIONS.md): all-reduce and reduce-scatter count their input tensor, all-gather the local shard
sent, all-to-all the bytes sent to other ranks, pipeline `send` the bytes sent; forward, backward and
recompute together. Bus bytes, for the time model, use the usual collective-benchmark factors for a group of
n: all-reduce 2(n-1)/n of the input, reduce-scatter (n-1)/n of the input, all-gather (n-1) shards, all-to-all
and send as sent. Per micro-batch and layer (T tokens of the micro-batch, a bytes per activation, h hidden):
- tp without SP: 2 all-reduces of a*T*h forward (after attention and after the MLP), 2 backward.
- tp with SP: forward 2 all-gathers (shard a*T*h/tp) and 2 reduce-scatters (a*T*h); backward the mirror
  images, plus one all-gather per sequence-parallel GEMM input (the saved shard, gathered again): 6 shards
  gathered and 4 reduce-scatters per layer. The vocabulary-parallel head and loss add one of each and three
  fp32 all-reduces of T values (max, sum, target logit).
- ep (alltoall dispatcher): dispatch and combine forward and backward, each a*Tm*k*h*(ep-1)/ep sent at even
  routing (Tm = T/tp routed tokens). etp > 1 adds an all-gather of the received rows and a reduce-scatter of
  the expert outputs (and their backward mirror images). The allgather dispatcher gathers tokens and routing
  over ep*etp instead.
- dp / dp_cp and edp (FSDP2): all-gather of this rank's parameter shard in the parameter dtype for forward
  (and again for backward when resharding after forward), reduce-scatter of the full fp32 gradient, each
  micro-batch; under pipelining once per step (Assumptions).
- pp: activations forward and their gradients backward, a*T*h (/tp under SP) per crossing of a stage boundary.
A forward repeated by recompute (full, or selective `moe`) repeats that forward's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_train.config.hardware import Hardware
from moe_train.config.schema import Recipe

from .activations import ActivationLayout
from .assumptions import Assumptions
from .layout import Chunk, PlanLayout, crosses_network, ranks_within_domain


@dataclass
class CommCounter:
    payload: dict[str, float] = field(default_factory=dict)
    bus: dict[str, float] = field(default_factory=dict)

    def add(self, group: str, op: str, payload: float, size: int, times: float = 1.0) -> None:
        if size <= 1 or payload <= 0:
            return
        key = f"{group}/{op}"
        factor = {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size,
                  "all_gather": size - 1}.get(op, 1.0)
        self.payload[key] = self.payload.get(key, 0.0) + payload * times
        self.bus[key] = self.bus.get(key, 0.0) + payload * factor * times

    def links(self, layout: PlanLayout, hw: Hardware) -> dict[str, str]:
        return {key: ("network" if crosses_network(layout, key.split("/")[0], nvlink_domain=hw.nvlink_domain)
                      else "nvlink") for key in sorted(self.payload)}

    @classmethod
    def for_rank(cls, recipe: Recipe, layout: PlanLayout, lay: ActivationLayout, chunks: list[Chunk],
                 params, param_bytes: int, a: Assumptions) -> CommCounter:
        m = recipe.model
        out = cls()
        mb = layout.micro_batches
        t, h, act = lay.tokens, m.hidden_size, lay.act_bytes
        full = act * t * h
        tp = layout.tp
        policy = layout.recompute
        n_layers = sum(len(c.layers) + c.mtp for c in chunks)
        moe_layers = sum(c.moe_layers for c in chunks) + sum(c.mtp for c in chunks) * (m.moe is not None)
        # forward passes of a layer per micro-batch: 1, plus the recompute of full granularity
        forwards = 2 if policy.granularity == "full" else 1
        moe_forwards = 2 if policy.granularity == "full" or "moe" in policy.modules else 1

        # tensor (and sequence) parallel
        heads = sum(c.loss for c in chunks) + sum(c.mtp for c in chunks)
        if layout.sequence_parallel:
            out.add("tp", "all_gather", full / tp, tp, mb * n_layers * (2 * forwards + 4))
            out.add("tp", "reduce_scatter", full, tp, mb * n_layers * (2 * forwards + 2))
            out.add("tp", "all_gather", full / tp, tp, mb * heads * 2)
            out.add("tp", "reduce_scatter", full, tp, mb * (heads + sum(c.embedding for c in chunks)))
        else:
            out.add("tp", "all_reduce", full, tp, mb * n_layers * (2 * forwards + 2))
            out.add("tp", "all_reduce", full, tp, mb * (heads + sum(c.embedding for c in chunks)))
        out.add("tp", "all_reduce", 4 * t, tp, mb * heads * 3)

        # expert parallel
        if m.moe is not None and moe_layers:
            k = m.moe.top_k
            routed = t / tp
            rows = act * routed * k * h
            ep, etp = layout.ep, layout.etp
            if m.moe.dispatcher == "alltoall":
                out.add("ep", "all_to_all", rows * (ep - 1) / ep, ep, mb * moe_layers * (2 * moe_forwards + 2))
                out.add("etp", "all_gather", rows, etp, mb * moe_layers * (moe_forwards + 1))
                out.add("etp", "reduce_scatter", rows * etp, etp, mb * moe_layers * (moe_forwards + 1))
            else:
                group = "ep_etp" if etp > 1 else "ep"
                n = ep * etp
                tokens_and_routing = act * routed * h + routed * k * (8 + 4)
                out.add(group, "all_gather", tokens_and_routing, n, mb * moe_layers * moe_forwards)
                out.add(group, "all_gather", act * routed * h, n, mb * moe_layers)
                out.add(group, "reduce_scatter", act * routed * h * n, n, mb * moe_layers * (moe_forwards + 1))

        # FSDP2 over dp (dp_cp) for dense parameters and edp for experts
        if layout.pp > 1 or a.fsdp_once_per_step:
            gathers, reduces = 1, 1
        else:
            gathers = mb * (2 if a.fsdp_reshard_after_forward else 1)
            reduces = mb if a.fsdp_reduce_every_micro_batch else 1
        dense_group = "dp_cp" if layout.cp > 1 else "dp"
        for group, count, size in ((dense_group, params.dense, layout.dp * layout.cp),
                                   ("edp", params.experts, layout.edp)):
            out.add(group, "all_gather", param_bytes * count / size, size, gathers)
            out.add(group, "reduce_scatter", 4 * count, size, reduces)

        # pipeline: forward activations out of every chunk but the model's last, gradients back out of every
        # chunk but the first
        boundary = act * (t / tp if layout.sequence_parallel else t) * h
        last = layout.pp * layout.vpp - 1
        sends = sum((c.virtual_index != last) + (c.virtual_index != 0) for c in chunks)
        out.add("pp", "send", boundary, layout.pp, mb * sends)
        return out


def comm_time(counter: CommCounter, layout: PlanLayout, hw: Hardware, a: Assumptions) -> dict[str, dict]:
    """Seconds per key on its link (bus bytes over the achieved bandwidth), and the part that overlap could
    hide behind compute (the caller caps the hidden total at the compute there is to hide behind)."""
    overlap = {"tp": a.tp_overlap, "ep": a.ep_overlap, "etp": a.ep_overlap, "ep_etp": a.ep_overlap,
               "dp": a.dp_overlap, "dp_cp": a.dp_overlap, "edp": a.dp_overlap, "pp": a.pp_overlap}
    nvlink = hw.nvlink_bytes_per_s * a.nvlink_efficiency
    network = hw.network_bytes_per_s * a.network_efficiency
    total, hideable = {}, {}
    for key, bus in counter.bus.items():
        group, op = key.split("/")
        if not crosses_network(layout, group, nvlink_domain=hw.nvlink_domain):
            seconds = bus / nvlink
        elif op == "all_to_all":
            # the peers inside the NVLink domain are reached over NVLink, the rest over the network, at once
            size = {"ep": layout.ep, "ep_etp": layout.ep * layout.etp}.get(group, 2)
            near = ranks_within_domain(layout, group, nvlink_domain=hw.nvlink_domain) - 1
            far_share = (size - 1 - near) / (size - 1)
            seconds = max(bus * far_share / network, bus * (1 - far_share) / nvlink)
        else:
            seconds = bus / network  # ring/tree collectives run at the slowest hop's speed
        total[key] = seconds
        hideable[key] = seconds * overlap.get(group, 0.0)
    return {"total": total, "hideable": hideable}
