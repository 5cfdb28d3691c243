"""Bytes one rank communicates per step, by `<group>/<op>` (the keys `moe-train measure` reports).

Payload (docs/decisions.md): all-reduce and reduce-scatter count their input tensor, all-gather the local shard
sent, all-to-all the bytes sent to other ranks, pipeline `send` and `recv` the bytes sent and received;
forward, backward and recompute together. Bus bytes, for the time model, use the usual collective-benchmark
factors for a group of n: all-reduce 2(n-1)/n of the input, reduce-scatter (n-1)/n of the input, all-gather
(n-1) shards, all-to-all and send as sent, recv nothing (the peer's send is its time). Every collective
the engine issues is listed, read from the code (parallel/tensor.py, parallel/collectives.py, models/moe/,
train/grad_norm.py, FSDP2), per micro-batch (T tokens of the
micro-batch on this rank, Ts of them in the sequence region, Tm routed; a bytes per activation, h hidden):

- tp without SP, per block: an all-reduce of a T h after attention and after the MLP, and in backward one per
  region entry (GQA: q/k/v share one; MLA: the q and kv latents and the rope key each enter); with SP the
  entries are all-gathers of the shard (backward: reduce-scatters of a T width) and the exits reduce-scatters
  (backward: all-gathers), and every column-parallel GEMM reading a gathered input gathers its saved shard
  again in backward (GQA's q, k, v: 3; MLP gate, up: 2; MLA's q_b and kv_b: 1 each). MoE layers route their
  slice (without SP: cut from the replicated input, whose backward all-gathers, and gathered again); a shared
  expert is a sequence-parallel MLP over the slices. The embedding (each call: the main one and one per MTP
  depth) all-reduces (SP: reduce-scatters) its output; each head enters a region; each loss all-reduces three
  fp32 values per token. Switch-style balancing losses all-reduce E + 1 int64 counts over tp (and, for
  global_aux_loss, over dp) in forward only, seq_aux_loss b x E fp32 counts in every forward (recompute too).
- ep, alltoall: per MoE forward, the counts exchange ((ep - 1) x E/ep int64) and the rows a x h each, with
  their fp32 routing weight: to other ranks Tm k minus this rank's share, back the rows it received (without
  weights: the experts applied them); backward the mirror image (the weights' gradients). Exact at
  even routing (expert e gets floor or ceil of Tm k / E). allgather over ep (ep x etp: `ep_etp`): token
  counts, routing ids, hidden states and weights gathered, fp32 per-token sums reduce-scattered, and their
  backward (docs/plan.md lists each).
- dp (dp_cp) and edp, FSDP2: per unit (a block, its experts, an MTP module, the root) an all-gather of this
  rank's padded shard in the parameter dtype (`train.fp8.fp8_all_gather`: the fp8-marked Linear weights at one
  byte, each after an all-reduce of its fp32 amax over the same group) in each micro-batch's forward and again
  in its backward (when resharding after forward), and one reduce-scatter of the fp32 gradient (padded, all
  shards) per step (the trainer syncs gradients in the last micro-batch only); under pipelining once per step
  (Assumptions).
  HSDP (dpr > 1): the same over dps (dps_cp) and edps, and each reduced fp32 shard all-reduced over dpr.
- train.optimizer muon, per step: each sharded Muon update gathered whole in fp32 over its FSDP2 group and tp
  (etp), in DTensor's order (plan/muon_cost.py `muon_gathers`).
- per step: the sum over tp of replicated parameters' partial gradients (one fp32 all-reduce of their local
  shards) and the gradient norm: one fp32 value per parameter tensor, all-reduced over each dimension of its
  mesh (plain tensors: dp; tensor-parallel ones: dp and tp; experts: edp, and ep, or ep x etp at once over
  the flattened group the all-gather dispatcher made, which DTensor then uses).
- cp (issue 23), per attention layer: the K/V exchange of parallel/ring_attention.py (`_ModelComm._context`:
  p2p cp-1 sends and receives of this rank's K and V forward, backward cp-1 more and cp of their fp32
  gradients; allgather one all-gather forward, another and a reduce-scatter of cp x the fp32 gradients
  backward), again wherever recompute reruns attention; the MoE token group is cp (cp_tp with tp > 1) for the
  balancing losses' counts; MTP's valid-target count (one int64 per depth and micro-batch) over cp; the
  gradient norm over dp_cp (FSDP2's dense mesh; cp_tp at dp 1, where DTensor finds that flattened group).
- pp: activations forward and their gradients backward, a Ts h per crossing of a stage boundary, sent by
  one side and received by the other; when the last stage keeps a copy of the embedding (MTP, tied head),
  an fp32 all-reduce of the embedding's gradient shard per step between it and the first stage (`embedding`;
  none in dualpipev's V, whose rank 0 holds both stages).
Recompute repeats a region's forward collectives up to its last saved tensor (recompute_policy.py): not the exit of a
dense MLP (or of a shared expert with nothing saved after it, or else the all-gather dispatcher's final
reduce-scatter when nothing follows it), nor a MoE layer's final gather; a full-recompute group skips its last
layer's only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_train.config.hardware import Hardware
from moe_train.config.routing_shapes import ForcedRouting
from moe_train.config.schema import ModelConfig, Recipe
from moe_train.kernels import kernels_for
from moe_train.models.declarations import embedding as ends
from moe_train.models.declarations import mlp, moe_layer, router, shared_experts
from moe_train.models.declarations.layer import attention_module
from moe_train.models.declarations.parts import Module

from .assumptions import Assumptions
from .muon_cost import muon_gathers
from .params import RankParams, Unit, fp8_gathered_kinds, fsdp_rows
from .rank_layout import Chunk, PlanLayout, crosses_network, ranks_within_domain
from .recompute_policy import recompute_groups, saves_after_combine
from .saved_tensors import ActivationLayout, padded_capacity

INT64, FP32 = 8, 4

# One collective: (group, op, payload bytes). A pass is the list of collectives one forward (or backward)
# of some piece of the model issues.
Collective = tuple[str, str, float]


@dataclass
class CommBytes:
    """The bytes one rank communicates per step by `<group>/<op>`: `payload` as measure counts it, `bus` for the
    time model (the collective-benchmark factors above)."""

    payload: dict[str, float] = field(default_factory=dict)
    bus: dict[str, float] = field(default_factory=dict)

    def add(self, group: str, op: str, payload: float, size: int, times: float = 1.0) -> None:
        if size <= 1 or payload <= 0 or times <= 0:
            return
        key = f"{group}/{op}"
        factor = {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size,
                  "all_gather": size - 1, "recv": 0.0}.get(op, 1.0)  # a recv is a peer's send, timed there
        self.payload[key] = self.payload.get(key, 0.0) + payload * times
        self.bus[key] = self.bus.get(key, 0.0) + payload * factor * times

    def links(self, layout: PlanLayout, hw: Hardware) -> dict[str, str]:
        return {key: ("network" if crosses_network(layout, key.split("/")[0], nvlink_domain=hw.nvlink_domain)
                      else "nvlink") for key in sorted(self.payload)}

    def add_pass(self, collectives: list[Collective], sizes: dict[str, int], times: float) -> None:
        if times <= 0:
            return
        for group, op, payload in collectives:
            self.add(group, op, payload, sizes[group], times)

    @classmethod
    def for_rank(cls, recipe: Recipe, layout: PlanLayout, lay: ActivationLayout, chunks: list[Chunk],
                 params: RankParams, param_bytes: int, a: Assumptions) -> CommBytes:
        out = cls()
        m = recipe.model
        model = _CachedComm(_ModelComm(m, layout, lay, cp_comm=recipe.parallel.cp_exchange(m.family)))
        sizes = {"pp": layout.pp, "dp": layout.dp, "dp_cp": layout.dp * layout.cp, "tp": layout.tp,
                 "cp": layout.cp, "cp_tp": layout.cp * layout.tp,
                 "edp": layout.edp, "ep": layout.ep, "etp": layout.etp, "ep_etp": layout.ep * layout.etp,
                 "dpr": layout.dpr, "dps": layout.dps, "edps": layout.edps,
                 "epnode": layout.ep_split[0], "eplocal": layout.ep_split[1]}
        mb = layout.micro_batches
        policy = layout.recompute
        modules = set(policy.modules) if policy.granularity == "selective" else set()

        def layers(moe: bool, count: int) -> None:
            """`count` layers of one kind: each the same forward, backward and selective recompute."""
            if count:
                out.add_pass(model.block(moe, "forward"), sizes, mb * count)
                out.add_pass(model.block(moe, "backward"), sizes, mb * count)
                if modules:
                    out.add_pass(model.selective_recompute(moe, modules), sizes, mb * count)

        groups: dict[tuple[bool, ...], int] = {}  # full recompute: each group's layer kinds, how many such groups
        for chunk in chunks:
            layers(True, chunk.moe_layers)
            layers(False, len(chunk.layers) - chunk.moe_layers)
            if policy.granularity == "full":
                for group in recompute_groups(chunk.layers, policy):
                    kinds = tuple(m.is_moe_layer(i) for i in group)
                    groups[kinds] = groups.get(kinds, 0) + 1
            embeddings = int(chunk.embedding) + chunk.mtp  # each MTP depth looks its tokens up again
            out.add_pass(model.embedding(), sizes, mb * embeddings)
            heads = int(chunk.loss) + chunk.mtp
            out.add_pass(model.head(), sizes, mb * heads)
            out.add("cp", "all_reduce", INT64, layout.cp, mb * chunk.mtp)  # MTP's valid targets over the shards
            layers(m.moe is not None, chunk.mtp)
        for kinds, count in groups.items():
            out.add_pass(model.group_recompute(list(kinds)), sizes, mb * count)

        # the last stage's embedding copy (MTP, tied head), which the norm counts once (on the first stage)
        copies = sum(c.loss and not c.embedding for c in chunks) if m.mtp_layers > 0 or m.tie_embeddings else 0
        _per_step(out, layout, params, copies=copies)
        _fsdp(out, recipe, layout, params, param_bytes, a)
        if recipe.train.optimizer == "muon":  # each sharded Muon update gathered whole (plan/muon_cost.py)
            for group, payload, size, times in muon_gathers(params, layout, lambda unit: fsdp_group(layout, unit)):
                out.add(group, "all_gather", payload, size, times)

        # pipeline: forward activations out of every chunk but the model's last, gradients back out of every
        # chunk but the first; each chunk receives what it does not send (the other direction, same size). A
        # neighbour on this rank (a V's tip: stages pp - 1 and pp) is handed its tensors locally, unsent.
        boundary = lay.act_bytes * lay.seq_tokens * m.hidden_size
        last = layout.pp * layout.vpp - 1
        held = {c.virtual_index for c in chunks}
        sends = sum((c.virtual_index != last and c.virtual_index + 1 not in held)
                    + (c.virtual_index != 0 and c.virtual_index - 1 not in held) for c in chunks)
        out.add("pp", "send", boundary, layout.pp, mb * sends)
        out.add("pp", "recv", boundary, layout.pp, mb * sends)
        # the last stage's copy of the embedding (MTP, tied head) and the first stage's sum their gradient
        # shards once per step over a group of the two (parallel/pipeline.py: sync_shared_gradients); a rank
        # holding both (rank 0 in a V) sums them in place
        holders = sum(c.virtual_index in (0, last) for c in chunks)
        if layout.pp > 1 and (m.mtp_layers > 0 or m.tie_embeddings) and holders == 1:
            vocab = ends.embedding(m).params[0].shape[0]  # the embedding's rows, cut by tp
            rows = fsdp_rows(vocab // layout.tp, layout.dps * layout.cp)[0]
            out.add("embedding", "all_reduce", FP32 * rows * m.hidden_size, 2, 1)
        return out


def dispatch_forward(recipe: Recipe, layout: PlanLayout, lay: ActivationLayout, chunks: list[Chunk]) -> CommBytes:
    """The dispatchers' collectives of the rank's MoE layers (MTP's MoE blocks too) in the micro-batches'
    forwards, not recomputed: what ep_overlap's pairs hide behind a backward (plan/overlap.py); the rest of
    those keys' bytes ran in the backwards."""
    out, m = CommBytes(), recipe.model
    if m.moe is None:
        return out
    model = _ModelComm(m, layout, lay, cp_comm=recipe.parallel.cp_exchange(m.family))
    sizes = {"ep": layout.ep, "ep_etp": layout.ep * layout.etp, "epnode": layout.ep_split[0],
             "eplocal": layout.ep_split[1]}
    layers = sum(chunk.moe_layers + chunk.mtp for chunk in chunks)
    out.add_pass(model._dispatch("forward"), sizes, layout.micro_batches * layers)
    return out


class _CachedComm:
    """`_ModelComm`'s passes, each summed by `(group, op)` (bus bytes are linear in the payload) and kept across
    plans: `plan --search` plans hundreds of layouts whose layers are alike."""

    _cache: dict[tuple, tuple[tuple[Collective, ...], ModelConfig]] = {}

    def __init__(self, model: _ModelComm) -> None:
        self.model = model
        self.key = (id(model.m), model.tp, model.sp, model.a, model.t, model.ts, model.tm, model.batch,
                    model.layout.ep, model.layout.etp, model.layout.dp > 1, model.cp, model.cp_comm,
                    model.layout.device, model.chunked_loss)

    def _get(self, name: str, *args) -> list[Collective]:
        key = (*self.key, name, args)
        hit = self._cache.get(key)
        if hit is None or hit[1] is not self.model.m:  # the entry keeps the model section alive (its id)
            sums: dict[tuple[str, str], float] = {}
            for group, op, payload in getattr(self.model, name)(*args):
                sums[group, op] = sums.get((group, op), 0.0) + payload
            if len(self._cache) > 65536:
                self._cache.clear()
            hit = self._cache[key] = (tuple((g, o, v) for (g, o), v in sums.items()), self.model.m)
        return list(hit[0])

    def block(self, moe: bool, direction: str) -> list[Collective]:
        return self._get("block", moe, direction)

    def selective_recompute(self, moe: bool, modules: set[str]) -> list[Collective]:
        return self._get("selective_recompute", moe, frozenset(modules))

    def group_recompute(self, kinds: list[bool]) -> list[Collective]:
        return self._get("group_recompute", tuple(kinds))

    def embedding(self) -> list[Collective]:
        return self._get("embedding")

    def head(self) -> list[Collective]:
        return self._get("head")


class _ModelComm:
    """The collectives of each piece of the model for one micro-batch on this rank (see the module docstring)."""

    def __init__(self, m: ModelConfig, layout: PlanLayout, lay: ActivationLayout, *, cp_comm: str,
                 routing=None) -> None:
        """`routing`: what gives the all-to-all dispatcher's slots per expert slot, this rank's own first
        (`counts(tokens)`); measure's forced routing unless `plan --routing` passes a trace's (plan/routing.py)."""
        self.m, self.layout, self.lay, self.routing = m, layout, lay, routing
        self.tp, self.cp, self.cp_comm = layout.tp, layout.cp, cp_comm
        self.sp = layout.sequence_parallel and layout.tp > 1
        self.a, self.h = lay.act_bytes, m.hidden_size
        self.t, self.ts, self.tm = lay.tokens, lay.seq_tokens, lay.moe_tokens
        self.batch = lay.micro_batch
        self.chunked_loss = lay.loss_chunk_tokens > 0
        self.capacity = padded_capacity(m, lay) if m.moe is not None else None  # rows per expert, when padded

    # ---- tensor parallelism: one region entered with `width` features, one row-parallel exit of h
    def _enter(self, width: float, direction: str, *, gemms: int, sp: bool | None = None,
               rows: float | None = None) -> list[Collective]:
        """A region's entry for `gemms` column-parallel GEMMs reading an input of `width` features (`rows` of
        them on this rank: the sequence region's by default). `direction`: forward, backward or recompute (a
        forward run again)."""
        sp = self.sp if sp is None else sp
        rows = self.ts if rows is None else rows
        a = self.a
        if self.tp == 1:
            return []
        if not sp:  # a copy whose gradient is all-reduced
            return [("tp", "all_reduce", a * self.t * width)] if direction == "backward" else []
        if direction != "backward":
            return [("tp", "all_gather", a * rows * width)]
        gathers = [("tp", "all_gather", a * rows * width)] * gemms  # the saved shard, gathered again
        return [("tp", "reduce_scatter", a * rows * self.tp * width), *gathers]

    def _exit(self, direction: str, *, sp: bool | None = None, rows: float | None = None) -> list[Collective]:
        """A row-parallel GEMM's partial sums to the replicated value (all-reduce) or this rank's shard (SP)."""
        sp = self.sp if sp is None else sp
        if self.tp == 1:
            return []
        full = self.a * (rows if rows is not None else self.t) * self.h
        if not sp:
            return [("tp", "all_reduce", full)] if direction != "backward" else []
        return [("tp", "reduce_scatter", full)] if direction != "backward" else [("tp", "all_gather", full / self.tp)]

    def _entries(self, module: Module, direction: str, *, rerun_by: str | None = None, **rows) -> list[Collective]:
        """The entries of `module`'s tensor-parallel regions (those `rerun_by` runs again, when given)."""
        return [c for e in module.tp_entries if rerun_by is None or e.rerun_by == rerun_by
                for c in self._enter(e.width, direction, gemms=e.gemms, **rows)]

    def attention(self, direction: str) -> list[Collective]:
        entries = self._entries(attention_module(self.m), direction)
        return entries + self._context(direction) + self._exit(direction)

    def _context(self, direction: str) -> list[Collective]:
        """Context-parallel attention's K/V exchange (parallel/ring_attention.py): this rank's K and V (the
        heads of its tp rank; MLA's V zero-padded to the q/k head width where the device's kernel row pads it)
        and their fp32 gradients. p2p: cp-1
        sends and receives of K/V forward; backward cp-1 of K/V and cp of the gradients. allgather: one
        all-gather forward; backward another and a reduce-scatter of every rank's gradients."""
        cp, core = self.cp, attention_module(self.m).core
        if cp == 1:
            return []
        padded = kernels_for(self.layout.device).mla_value == "padded"  # one head width where the kernel needs it
        width = 2 * core.padded_dim if padded else core.qk_dim + core.v_dim
        kv_heads = core.key_heads / self.tp
        elements = self.t * kv_heads * width
        kv, grads = self.a * elements, FP32 * elements
        backward = direction == "backward"
        if self.cp_comm == "p2p":
            sent = [kv] * (cp - 1) + ([grads] * cp if backward else [])
            return [("cp", op, size) for op in ("send", "recv") for size in sent]
        return [("cp", "all_gather", kv)] + ([("cp", "reduce_scatter", cp * grads)] if backward else [])

    def mlp(self, direction: str) -> list[Collective]:
        return self._entries(mlp.declare(self.m), direction) + self._exit(direction)

    def moe(self, direction: str, *, recompute: bool = False) -> list[Collective]:
        """A MoE layer's tensor- and expert-parallel collectives (forward includes its recompute when asked)."""
        a, h, tp = self.a, self.h, self.tp
        out: list[Collective] = []
        forward = direction == "forward"
        if tp > 1 and not self.sp and not forward:
            out.append(("tp", "all_gather", a * self.tm * h))  # the slice's backward
        # the balancing losses' token set: the micro-batch's tokens on every tp and cp rank (`token_group`)
        shared = tp * self.cp > 1
        tokens = "tp" if self.cp == 1 else "cp" if tp == 1 else "cp_tp"
        for scope, size, rerun in router.balancing_exchanges(self.m, self.lay) if forward else ():
            if recompute and not rerun:
                continue
            if scope == "data":
                out.append(("dp", "all_reduce", size))
            elif shared:
                out.append((tokens, "all_reduce", size))
        out += self._dispatch(direction)
        shared_mlp = shared_experts.declare(self.m)
        if shared_mlp is not None:  # a sequence-parallel MLP over the layer's token slices
            out += self._entries(shared_mlp, direction, sp=True, rows=self.tm)
            out += self._exit(direction, sp=True, rows=self.tm * tp)
        if tp > 1 and not self.sp and forward:
            out.append(("tp", "all_gather", a * self.tm * h))  # the outputs gathered again
        return out

    def _dispatch(self, direction: str) -> list[Collective]:
        moe, lay, a, h = self.m.moe, self.layout, self.a, self.h
        ep, etp, k, tm = lay.ep, lay.etp, moe.top_k, self.tm
        forward = direction == "forward"
        if moe.dispatcher == "alltoall":
            if ep == 1:
                return []
            slots, local = tm * k, moe.num_experts // ep
            routing = self.routing or ForcedRouting.of(moe)
            mine = sum(routing.counts(int(tm))[:local])  # this rank's slots on its own experts
            if self.capacity is not None:  # padded: every expert's capacity rows, whatever was kept
                slots, mine = moe.num_experts * self.capacity, local * self.capacity
            # the rows go with their fp32 routing weights (forward), and the weights' gradients come back
            # (backward): the received rows' (dispatch_alltoall.py)
            probs = (slots - mine) * FP32 if forward else (ep - 1) * mine * FP32
            out = [("ep", "all_to_all", (ep - 1) * local * INT64)] if forward else []
            return out + [("ep", "all_to_all", (slots - mine) * h * a), ("ep", "all_to_all", probs),
                          ("ep", "all_to_all", (ep - 1) * mine * h * a)]
        if moe.dispatcher == "hierarchical":
            return self._hierarchical(forward)
        group, n = ("ep_etp" if etp > 1 else "ep"), ep * etp
        if n == 1:
            return []
        if forward:
            # sizes: [tokens, padding, slots per expert holder (ep rank)] per rank (dispatch_allgather._sizes)
            return [(group, "all_gather", (2 + ep) * INT64), (group, "all_gather", tm * k * INT64),
                    (group, "all_gather", a * tm * h), (group, "all_gather", tm * k * FP32),
                    (group, "reduce_scatter", n * tm * h * FP32)]
        return [(group, "reduce_scatter", n * tm * h * a), (group, "reduce_scatter", n * tm * k * FP32),
                (group, "all_gather", tm * h * FP32)]

    def _hierarchical(self, forward: bool) -> list[Collective]:
        """dispatch_hierarchical.py under measure's forced routing (config/routing_shapes.py `ForcedRouting`:
        each token over as many nodes as the model's router reaches in expectation), on node 0's local rank 0:
        over epnode each token once per other node it needs (with its K expert ids and
        its K fp32 weights) and each node's partial sums back; over eplocal the all-to-all dispatcher's traffic
        for the (token, expert) pairs the node's rank of each node sends here (each with its fp32 weight). Padded to
        capacity c: min(T, E/N c) rows to every node (no counts exchanged across nodes) and inside the node
        the all-to-all dispatcher padded to N c."""
        moe, a, h = self.m.moe, self.a, self.h
        nodes, local = self.layout.ep_split
        k, e, tm = moe.top_k, moe.num_experts, int(self.tm)
        per_node, mine_experts = e // nodes, e // (nodes * local)
        if self.capacity is None:
            forced = ForcedRouting.of(moe, nodes)  # measure's routing: the model's router's spread over nodes
            need, slots = forced.domain_tokens(tm), forced.counts(tm)
            sent, received = sum(need) - need[0], (nodes - 1) * need[0]  # rows to / from the other nodes
            counts = [("epnode", "all_to_all", (nodes - 1) * INT64)]
            node_pairs = nodes * sum(slots[:per_node])  # pairs this rank sends inside its node
            mine = nodes * sum(slots[:mine_experts])  # of them for its own experts
        else:
            sent = received = (nodes - 1) * min(tm, per_node * self.capacity)
            counts = []
            node_pairs, mine = per_node * nodes * self.capacity, mine_experts * nodes * self.capacity
        out: list[Collective] = []
        if nodes > 1:
            if forward:
                out += [*counts, ("epnode", "all_to_all", sent * k * INT64),
                        ("epnode", "all_to_all", sent * h * a), ("epnode", "all_to_all", sent * k * FP32),
                        ("epnode", "all_to_all", received * h * a)]
            else:
                out += [("epnode", "all_to_all", received * h * a), ("epnode", "all_to_all", received * k * FP32),
                        ("epnode", "all_to_all", sent * h * a)]
        if local > 1:
            # pairs the node receives for each of its experts: every node's rank of this local index sends its
            # tokens' slots on those experts (even: expert x gets its share of each source's T K slots)
            to_others, from_others = node_pairs - mine, (local - 1) * mine
            # with their fp32 weights forward, the weights' gradients back
            if forward:
                out += [("eplocal", "all_to_all", (local - 1) * mine_experts * INT64),
                        ("eplocal", "all_to_all", to_others * h * a), ("eplocal", "all_to_all", to_others * FP32),
                        ("eplocal", "all_to_all", from_others * h * a)]
            else:
                out += [("eplocal", "all_to_all", from_others * h * a), ("eplocal", "all_to_all", from_others * FP32),
                        ("eplocal", "all_to_all", to_others * h * a)]
        return out

    def block(self, moe: bool, direction: str) -> list[Collective]:
        return self.attention(direction) + (self.moe(direction) if moe else self.mlp(direction))

    def _tail(self, moe: bool) -> list[Collective]:
        """What a recomputation that ends with this layer does not re-run (everything after its last save)."""
        if not moe:
            return self._exit("forward")
        out = []  # the shared experts ran before the dispatch: their collectives are recomputed with them
        if not saves_after_combine(self.m) and self.m.moe.dispatcher == "allgather":
            out += [c for c in self._dispatch("forward") if c[1] == "reduce_scatter"]  # the combine's
        if self.tp > 1 and not self.sp:
            out.append(("tp", "all_gather", self.a * self.tm * self.h))
        return out

    def selective_recompute(self, moe: bool, modules: set[str]) -> list[Collective]:
        """What the recomputed `modules` run again of a layer's collectives: attention across the cp shards where
        a region holding it runs again, and each rerun region's tensor-parallel entries (the whole MoE layer's
        forward, less what runs after its last save)."""
        attn = attention_module(self.m)
        out: list[Collective] = []
        if modules & set(attn.core.rerun_by):
            out += self._context("recompute")
        out += [c for region in sorted(modules) for c in self._entries(attn, "recompute", rerun_by=region)]
        if not moe:
            return out + [c for region in sorted(modules)
                          for c in self._entries(mlp.declare(self.m), "recompute", rerun_by=region)]
        if moe_layer.REGION in modules:
            return out + _minus(self.moe("forward", recompute=True), self._tail(True))
        shared_mlp = shared_experts.declare(self.m)
        if shared_mlp is not None:
            out += [c for region in sorted(modules) for c in self._entries(shared_mlp, "recompute", rerun_by=region,
                                                                           sp=True, rows=self.tm)]
        return out

    def group_recompute(self, kinds: list[bool]) -> list[Collective]:
        """A full-recompute group (its layers' kinds in order): every forward collective but the last tail."""
        out: list[Collective] = []
        for moe in kinds:
            out += self.attention("forward") + (self.moe("forward", recompute=True) if moe else self.mlp("forward"))
        return _minus(out, self._tail(kinds[-1]))

    def embedding(self) -> list[Collective]:
        """The vocabulary-parallel lookup's reduction (forward), and under SP its backward all-gather."""
        if self.tp == 1:
            return []
        full = self.a * self.t * self.h
        if not self.sp:
            return [("tp", "all_reduce", full)]
        return [("tp", "reduce_scatter", full), ("tp", "all_gather", full / self.tp)]

    def head(self) -> list[Collective]:
        """A head's region (its column-parallel GEMM over the vocabulary) and the vocabulary-parallel loss. The
        chunked loss keeps the gathered input whole: no gather again in backward."""
        if self.tp == 1:
            return []
        gemms = 0 if self.chunked_loss else 1
        region = self._enter(self.h, "forward", gemms=1) + self._enter(self.h, "backward", gemms=gemms)
        return region + [("tp", "all_reduce", FP32 * self.t)] * 3


def _minus(collectives: list[Collective], removed: list[Collective]) -> list[Collective]:
    """`collectives` without one occurrence of each of `removed` (the latest first)."""
    out = list(collectives)
    for item in removed:
        for index in range(len(out) - 1, -1, -1):
            if out[index] == item:
                del out[index]
                break
    return out


def _per_step(out: CommBytes, layout: PlanLayout, params: RankParams, *, copies: int = 0) -> None:
    """Once per step: the replicated parameters' partial gradients summed over tp, and the gradient norm, one
    fp32 partial per tensor but the `copies` of the embedding this rank holds for its last stage (vocabulary
    rows over tp: train/grad_norm.py counts them once, on the first stage)."""
    partial = sum(unit.count * fsdp_rows(t.shape[0], unit.shards)[0] * (t.numel // t.shape[0])
                  for unit in params.units for t in unit.tensors if t.partial)
    out.add("tp", "all_reduce", FP32 * partial, layout.tp)
    tensors = {"dense": 0, "tp": 0, "experts": 0}
    for tensor, count in params.tensors:
        tensors[tensor.mesh] += count
    tensors["tp" if layout.tp > 1 else "dense"] -= copies
    # Under HSDP a norm is Partial over the shard dimension only (replicas hold the same shard): dps, edps.
    dense, dense_size = ("dps", layout.dps) if layout.dpr > 1 else ("dp", layout.dp)
    if layout.cp > 1 and layout.dpr == 1:  # FSDP2's dense mesh is dp x cp (HSDP with cp is refused)
        dense, dense_size = "dp_cp", layout.dp * layout.cp
    out.add(dense, "all_reduce", FP32 * tensors["dense"], dense_size)
    if layout.cp > 1 and layout.tp > 1 and layout.dp == 1:
        # their mesh (dp_cp, tp) is the cp x tp ranks, for which context parallelism made a flattened group
        # (the MoE token group): DTensor reduces over both dimensions at once there
        out.add("cp_tp", "all_reduce", FP32 * tensors["tp"], layout.cp * layout.tp)
    else:
        out.add(dense, "all_reduce", FP32 * tensors["tp"], dense_size)
        out.add("tp", "all_reduce", FP32 * tensors["tp"], layout.tp)
    # Experts: over edp, and as DTensors over ep and etp too; DTensor reduces over several dimensions at once
    # when a flattened group of exactly those exists (ep_etp, made for the all-gather dispatcher). Gathered
    # with their block (not experts_apart), they are DTensors of dp like the block's.
    shard = ("edps", layout.edps) if layout.dpr > 1 else ("edp", layout.edp)
    expert_dims = [(d, n) for d, n in (shard, ("ep", layout.ep), ("etp", layout.etp)) if n > 1]
    if [d for d, _ in expert_dims] == ["ep", "etp"]:
        expert_dims = [("ep_etp", layout.ep * layout.etp)]
    for group, size in expert_dims if layout.experts_apart else [(dense, dense_size)]:
        out.add(group, "all_reduce", FP32 * tensors["experts"], size)
    out.add("pp", "all_reduce", FP32, layout.pp)  # the stages' squared norms


def fsdp_group(layout: PlanLayout, unit: Unit) -> str:
    """The group FSDP2 shards `unit` over: dp (dp_cp), or edp for routed experts in a unit of their own; under
    HSDP (dpr > 1) the shard groups dps (dps_cp) and edps, each reduced shard then all-reduced over dpr."""
    hsdp = layout.dpr > 1
    if all(t.unit == "experts" for t in unit.tensors):
        return "edps" if hsdp else "edp"
    return ("dps" if hsdp else "dp") + ("_cp" if layout.cp > 1 else "")


def _fsdp(out: CommBytes, recipe: Recipe, layout: PlanLayout, params: RankParams, param_bytes: int,
          a: Assumptions) -> None:
    """FSDP2 over dp (dp_cp) for dense units and edp for experts, at `parallel.param_gather` and
    `parallel.grad_reduce`'s cadences: each unit's padded shard gathered once per step or per micro-batch
    (forward, and backward when resharding), its fp32 gradient reduce-scattered once per step or after every
    micro-batch's backward."""
    mb, parallel = layout.micro_batches, recipe.parallel
    reshard = parallel.reshards_after_forward and a.fsdp_reshard_after_forward
    reduces = mb if parallel.grad_reduce == "per_microbatch" else 1  # pipelined stages too (pipeline.py)
    if layout.pp > 1:
        # torch's schedules keep a stage gathered after its first backward: resharding after forward gathers in
        # each micro-batch's forward and once more for the backwards
        gathers = mb + 1 if reshard else 1
    else:
        gathers = 1 if parallel.gathers_per_step else mb * (2 if reshard else 1)
    fp8 = fp8_gathered_kinds(recipe)
    for unit in params.units:
        group = fsdp_group(layout, unit)
        shard = unit.padded_shard
        out.add(group, "all_gather", unit.shard_bytes(param_bytes, fp8), unit.shards, gathers * unit.count)
        # fp8 all-gather: each fp8 weight's amax (one fp32) all-reduced over the shard group before each gather
        out.add(group, "all_reduce", FP32 * unit.fp8_weights(fp8), unit.shards, gathers * unit.count)
        out.add(group, "reduce_scatter", FP32 * shard * unit.shards, unit.shards, reduces * unit.count)
        out.add("dpr", "all_reduce", FP32 * shard, layout.dpr, reduces * unit.count)


def comm_time(counter: CommBytes, layout: PlanLayout, hw: Hardware, a: Assumptions) -> dict[str, dict]:
    """Seconds per key on its link (bus bytes over the achieved bandwidth), and the part that the assumed
    overlap fractions could hide behind compute (the caller caps the hidden total at the compute there is to
    hide behind). The expert-parallel groups have none here: what `parallel.ep_overlap` hides follows from the
    schedule (plan/overlap.py)."""
    overlap = {"tp": a.tp_overlap, "dp": a.dp_overlap, "dp_cp": a.dp_overlap, "edp": a.dp_overlap,
               "pp": a.pp_overlap, "dpr": a.dp_overlap, "dps": a.dp_overlap, "dps_cp": a.dp_overlap,
               "edps": a.dp_overlap}
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
