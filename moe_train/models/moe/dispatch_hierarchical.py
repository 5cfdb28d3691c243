"""The hierarchical (node-aware) dispatcher: a token crosses the network once per destination node, not once per
(token, expert) pair, and fans out to that node's expert ranks inside the node (DeepEP's internode kernels,
Megatron-Core's HybridEP, with collectives instead of fused kernels).

The expert-parallel group is `epnode` x `eplocal` (eplocal fastest: ep rank = node x L + local): experts
[b x E/N, (b + 1) x E/N) live on node b, spread over its L ranks as the all-to-all dispatcher spreads them.
dispatch: (1) every token goes, once, to the rank of each node it needs that has this rank's local index (an
all-to-all over `epnode`, the network), with its top-k expert ids relative to that node (-1 for experts
elsewhere) and its K routing weights; (2) on that rank the all-to-all dispatcher over `eplocal` (NVLink) sends
each (token, expert) pair with its weight to the rank holding the expert (whose activation applies it).
combine, in reverse: (2) the pairs' (weighted) outputs come back inside the node and are summed per token
there, in fp32 (the node's partial sum); (1) one row per (token, node) returns
over the network, in the activation dtype (DeepEP's bf16 combine), and the source sums its nodes' partials in
fp32. So in fp32 and fp64 it equals the all-to-all dispatcher up to the order of a token's terms; in bf16 each
node's partial is rounded once more before the final sum.

Split sizes are host values read once per stage (one device-to-host read each), or, under forced even routing
(`host_counts`: what `moe-train measure --fake` routes, on tensors without values), computed on the host from
the shapes (config/routing_shapes.py, which the planner counts with too), or padded to capacity, fixed by the
capacity alone (static sizes across nodes and inside one, what CUDA graphs and DeepEP-style kernels need).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_train.config.routing_shapes import ForcedRouting
from moe_train.models.moe.deferred_wgrad import DeferredWeightGrads
from moe_train.models.moe.dispatch_alltoall import AllToAllDispatcher, AllToAllPlan
from moe_train.models.moe.dispatch_collectives import all_to_all_rows, all_to_all_together
from moe_train.models.moe.permute import scatter_sum


@dataclass
class HierarchicalPlan:
    """What `combine` needs: which token each network row carried, the network splits and the node's plan."""

    token_ids: torch.Tensor  # [S] int64 source token of each row sent over the network (destination-node major)
    send_splits: list[int]  # rows sent to each node (to the rank with this rank's local index)
    recv_splits: list[int]  # rows received from each node
    inner: AllToAllPlan  # the pairs' dispatch inside this node
    num_tokens: int


class HierarchicalDispatcher:
    """Expert-parallel dispatch over `node_group` (epnode: the ranks with this rank's local index, one per node)
    and `local_group` (eplocal: this node's ranks of the expert group); either None where it has one rank.

    Over the network, dispatch sends each token once per other node it needs and combine sends each node's
    partial sums back (with the row counts, expert ids and routing weights beside them); inside the node the
    all-to-all dispatcher sends the pairs. `measure` counts both, by group (docs/measure.md).
    """

    def __init__(self, *, num_experts: int, node_group: dist.ProcessGroup | None,
                 local_group: dist.ProcessGroup | None):
        self.nodes = 1 if node_group is None else dist.get_world_size(node_group)
        if num_experts % self.nodes:
            raise ValueError(f"model.moe.num_experts ({num_experts}) must divide over {self.nodes} nodes")
        self.node_group = node_group
        self.node = 0 if node_group is None else dist.get_rank(node_group)
        self.experts_per_node = num_experts // self.nodes
        self.inner = AllToAllDispatcher(num_experts=self.experts_per_node, group=local_group)
        self.num_experts = num_experts
        self.num_local_experts = self.inner.num_local_experts
        self.forced: ForcedRouting | None = None  # measure's forced routing over the nodes (set_even_routing)

    @property
    def deferred_wgrad(self) -> DeferredWeightGrads | None:
        """parallel.split_wgrad's queue: run by the first dispatch collective of the backward, the node's (or,
        with one rank a node, the network's)."""
        return self.inner.deferred_wgrad

    @deferred_wgrad.setter
    def deferred_wgrad(self, queue: DeferredWeightGrads | None) -> None:
        self.inner.deferred_wgrad = queue

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_indices: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        pad_to: int | None = None,
        host_counts: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HierarchicalPlan]:
        """hidden [T, H], topk_indices [T, K] (global expert ids), topk_weights [T, K] -> (rows [N, H] sorted by
        local expert, their routing weights [N] (0 for padding), rows per local expert [E_local] int64, plan).
        keep [T, K] drops slots on the source rank.

        Every split is a host value: read from the device once (the network counts), or without a read, from
        forced routing's `host_counts` (the router's `forced.counts`, no keep-mask: `forced.domain_tokens`
        across nodes, each node's share of the counts inside it), or padded to capacity (`pad_to`, the same on
        every rank of the group: the engine's ranks route equal token counts), static whatever the routing:
        to each node the most tokens that can need it, min(T, E/N x pad_to) rows (each of its experts keeps at
        most pad_to of this rank's slots; rows of tokens that do not need it carry no expert), and inside the
        node the all-to-all dispatcher padded to N x pad_to (the N ranks' rows meet there), so each local
        expert gets ep x pad_to rows, as the all-to-all dispatcher padded gives it."""
        tokens, top_k = topk_indices.shape
        node_of = topk_indices // self.experts_per_node
        if keep is not None:
            node_of = node_of.masked_fill(~keep, self.nodes)  # a dropped slot needs no node
        needed = torch.zeros(tokens, self.nodes + 1, dtype=torch.bool, device=hidden.device)
        needed = needed.scatter_(1, node_of, True)[:, : self.nodes]
        if pad_to is not None:
            per_node = min(tokens, self.experts_per_node * pad_to)
            # each node's tokens that need it first (a stable sort), cut to the static count
            chosen = torch.argsort((~needed).t().to(torch.int8), dim=1, stable=True)[:, :per_node]
            token_ids = chosen.reshape(-1)
            row_node = torch.arange(self.nodes, device=hidden.device).repeat_interleave(per_node)
            send_splits = recv_splits = [per_node] * self.nodes
            inner = {"pad_to": self.nodes * pad_to}
        else:
            send_splits, recv_splits, inner = self._splits(needed, tokens, top_k, host_counts, keep)
            flat = torch.nonzero_static(needed.t().reshape(-1), size=sum(send_splits)).squeeze(1)
            token_ids, row_node = flat % tokens, flat // tokens
        # each row's experts relative to its destination node; -1 where an expert is elsewhere (or dropped)
        ids = topk_indices.index_select(0, token_ids) - (row_node * self.experts_per_node).unsqueeze(1)
        ids = ids.masked_fill(node_of.index_select(0, token_ids) != row_node.unsqueeze(1), -1)
        rows = hidden.index_select(0, token_ids)
        weights = topk_weights.index_select(0, token_ids)  # the rows' index: one storage
        if self.node_group is not None:
            rows, ids, weights = all_to_all_together(  # one wait for the three, forward and backward (ep_overlap)
                [rows, ids, weights], send_splits=send_splits, recv_splits=recv_splits, group=self.node_group,
                beside=self.deferred_wgrad,
            )
        out, probs, counts, plan = self.inner.dispatch(rows, ids.clamp(min=0), weights, keep=ids >= 0, **inner)
        return out, probs, counts, HierarchicalPlan(token_ids, send_splits, recv_splits, plan, tokens)

    def _splits(self, needed: torch.Tensor, tokens: int, top_k: int, host_counts: Sequence[int] | None,
                keep: torch.Tensor | None) -> tuple[list[int], list[int], dict]:
        """(rows sent to each node, rows received from each, the node's dispatch options) of an unpadded
        dispatch: the network counts are exchanged (their one read), or under forced even routing computed."""
        send_counts = needed.sum(dim=0)
        inner: dict = {}
        if host_counts is not None:
            forced = self.forced
            if keep is not None or forced is None or list(host_counts) != forced.counts(tokens):
                raise ValueError("host_counts: the hierarchical dispatcher takes only its forced routing's counts")
            send_splits = forced.domain_tokens(tokens)
            recv_splits = [send_splits[self.node]] * self.nodes  # every rank routes its T tokens the same way
            mine = host_counts[self.node * self.experts_per_node: (self.node + 1) * self.experts_per_node]
            inner["host_counts"] = [self.nodes * count for count in mine]  # every node's rank's slots here
        if self.node_group is not None:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.node_group)
            if host_counts is None:
                send_splits, recv_splits = torch.stack([send_counts, recv_counts]).tolist()  # the one read here
        elif host_counts is None:
            send_splits = recv_splits = [int(send_counts.sum())] if tokens else [0]
        return send_splits, recv_splits, inner

    def combine(self, expert_out: torch.Tensor, plan: HierarchicalPlan) -> torch.Tensor:
        """expert_out [N, H] (rows as dispatch returned them, weighted by the experts) -> [T, H] fp32 on the
        tokens' own rank."""
        partial = self._node_sums(expert_out, plan.inner, sum(plan.recv_splits))  # per network row, in fp32
        if self.node_group is not None:
            partial = all_to_all_rows(partial.to(expert_out.dtype), send_splits=plan.recv_splits,
                                      recv_splits=plan.send_splits, group=self.node_group)
        return scatter_sum(partial, plan.token_ids, plan.num_tokens)

    def _node_sums(self, expert_out: torch.Tensor, inner: AllToAllPlan, network_rows: int) -> torch.Tensor:
        """The all-to-all dispatcher's combine inside the node, summing only the kept (on-node) slots of each
        received row: a row carries all K expert ids, most of them elsewhere, and the plain combine would read a
        zero row for each of those (K rows a token, not its on-node experts'). Padded, the buffer's rows (padding
        included) are summed as they came back: their number is static."""
        rows = self.inner.return_rows(expert_out, inner)  # [kept slots, H], expert-major as sent
        perm = inner.permutation
        if perm.row_slots is not None:  # padded: each buffer row's slot, padding into a spare row cut off after
            return scatter_sum(rows, perm.row_slots // perm.top_k, network_rows + 1)[:-1]
        kept = torch.nonzero_static(perm.slot_rows < perm.num_rows, size=perm.num_rows).squeeze(1)
        return scatter_sum(rows.index_select(0, perm.slot_rows.index_select(0, kept)), kept // perm.top_k,
                           network_rows)
