"""The MoE layer: router -> (capacity) -> dispatch -> grouped experts -> combine, plus shared experts (started
before the dispatch; on CUDA on a side stream, so they run while the all-to-all waits on the network).

forward(hidden [b, s, h]) -> [b, s, h], and nothing else leaves the forward but through two channels that
cannot be overwritten by a later forward:
- balancing losses: their gradients are attached to the output (aux_loss.attach_loss /
  attach_score_gradient), so each forward's loss is differentiated by that forward's backward;
- telemetry: non-persistent buffers that accumulate over the forwards of a step (tokens per expert, dropped
  assignments, the weighted balancing-loss value, the router's entropy), which the trainer reads and resets
  once per step. A forward that runs again inside backward (activation recomputation) does not add to them.

Token sets of the balancing losses (`router.load_balancing`, docs/interfaces.md):
- aux_loss: per layer, over this forward's micro-batch (with its sequence/context shards: `token_group`);
- seq_aux_loss: per layer, per sequence (DeepSeek-V3), averaged over the micro-batch's sequences;
- global_aux_loss: per layer, loads over the micro-batches of the step so far, summed over the data-parallel
  group (`balance_group`), Megatron-Core's definition (the running loads: the model's `StepBalancing`, which
  the step resets);
- all_layers_aux_loss: transformers' Qwen3-MoE loss over every layer's tokens together; the model computes
  it from each layer's `records` entry once its forward ends (one pipeline stage only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe_train.config.routing_shapes import expert_capacity
from moe_train.config.schema import MoEConfig
from moe_train.models.autograd_phase import in_recomputation
from moe_train.models.layout_region import LayoutRegion
from moe_train.models.mlp import MLP
from moe_train.models.moe.aux_loss import (
    ScoreGradient,
    StepBalancing,
    attach_loss,
    attach_score_gradient,
    seq_aux_loss,
    z_loss,
)
from moe_train.models.moe.capacity import capacity_keep_mask
from moe_train.models.moe.dispatcher import LocalDispatcher
from moe_train.models.moe.experts import GroupedExperts
from moe_train.models.moe.router import Router, count_per_expert

SWITCH_LOSSES = ("aux_loss", "global_aux_loss", "all_layers_aux_loss")


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the shared experts run on, one per device (created on first use)."""
    return torch.cuda.Stream(device=device)


def router_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the entropy (nats) of each token's scores normalised to a distribution."""
    probs = scores.detach().float()
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    return -(probs * probs.clamp(min=1e-20).log()).sum()


@dataclass
class RoutingRecord:
    """What the all-layers loss needs of one layer's forward: its detached scores and counts, and the holder
    through which its gradient reaches the layer's router."""

    scores: torch.Tensor  # [T, E] detached
    tokens_per_expert: torch.Tensor  # [E]
    gradient: ScoreGradient


class RoutingRecords:
    """One model forward's RoutingRecord of each MoE layer. A plain class, not a list: FSDP's input casting
    rebuilds lists, tuples and dataclasses it passes to a module, which would hand each layer a copy."""

    def __init__(self) -> None:
        self.items: list[RoutingRecord] = []


class MoELayer(nn.Module):
    """A routed-expert FFN block (Qwen3-MoE, DeepSeek-V3) with the names of transformers' checkpoints.

    Extension points `parallelize` sets (each documented in docs/interfaces.md): `dispatcher` (the layer's token
    dispatcher, replaced by an expert-parallel one), `token_group` and `balance_group` (the ranks its balancing
    losses count over). `balancing` is the model's `StepBalancing`, shared by its MoE layers.

    Layouts (`layout_forward`): tensor parallelism without sequence parallelism routes this rank's slice of the
    replicated micro-batch (parallel/tensor.py); recomputation and offloading wrap it whole as the `moe`
    region; compile keeps it eager where a recomputation reruns it from Python (parallel/compile.py).
    """

    def __init__(self, *, hidden_size: int, cfg: MoEConfig, balancing: StepBalancing | None = None):
        super().__init__()
        self.cfg = cfg
        self.balancing = StepBalancing() if balancing is None else balancing
        self.router = Router(hidden_size=hidden_size, cfg=cfg)
        self.experts = GroupedExperts(
            num_experts=cfg.num_experts, hidden_size=hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
            biases=cfg.expert_biases, clamp=cfg.clamped_swiglu,
        )
        if cfg.shared_expert_ffn_hidden_size > 0:
            self.shared_experts = MLP(hidden_size=hidden_size, ffn_hidden_size=cfg.shared_expert_ffn_hidden_size)
        else:
            self.shared_experts = None
        # parallelize hands in a dispatcher over the expert-parallel group and the groups below.
        self.dispatcher = LocalDispatcher(num_experts=cfg.num_experts)
        self.token_group: dist.ProcessGroup | None = None  # ranks sharing one micro-batch's tokens (SP, CP)
        self.balance_group: dist.ProcessGroup | None = None  # global_aux_loss: the data-parallel group
        experts = cfg.num_experts
        self.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.int64), persistent=False)
        # Rows this rank's experts received (padding included), in its first num_local_experts entries: the
        # per-rank load the trainer logs (train/rank_load.py).
        self.register_buffer("rows_per_local_expert", torch.zeros(experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_assignments", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("assignments", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("aux_loss_value", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer("router_entropy_sum", torch.zeros((), dtype=torch.float64), persistent=False)
        self.layout_forward = LayoutRegion(MoELayer._forward)

    def reset_telemetry(self) -> None:
        """Zero the step's telemetry (the trainer: once per step)."""
        for buffer in (self.tokens_per_expert, self.rows_per_local_expert, self.dropped_assignments,
                       self.assignments, self.aux_loss_value, self.router_entropy_sum):
            buffer.zero_()

    def forward(self, hidden: torch.Tensor, records: RoutingRecords | None = None) -> torch.Tensor:
        """hidden [b, s, h] -> [b, s, h]. `records` collects this forward's routing for all_layers_aux_loss."""
        return self.layout_forward(self, hidden, records)

    def _forward(self, hidden: torch.Tensor, records: RoutingRecords | None) -> torch.Tensor:
        batch, seq, hidden_size = hidden.shape
        x = hidden.reshape(-1, hidden_size)
        routing = self.router(x)
        tokens, top_k = routing.topk_indices.shape

        keep, capacity = None, None
        if self.cfg.capacity_factor is not None:
            capacity = expert_capacity(
                num_tokens=tokens,
                top_k=top_k,
                num_experts=self.cfg.num_experts,
                capacity_factor=self.cfg.capacity_factor,
            )
            keep = capacity_keep_mask(
                routing.topk_indices,
                routing.topk_weights,
                num_experts=self.cfg.num_experts,
                capacity=capacity,
                policy=self.cfg.drop_policy,
            )
        # Forced routing (measure): every rank's counts follow from the shapes, no device read needed.
        even = self.router.even_routing and keep is None
        known = self.router.forced.counts(tokens) if even else None
        shared = self._start_shared_experts(x)  # before the dispatch: on CUDA it overlaps the all-to-all
        rows, row_probs, rows_per_expert, plan = self.dispatcher.dispatch(
            x, routing.topk_slots, routing.topk_weights, keep=keep,
            pad_to=capacity if self.cfg.pad_to_capacity else None, host_counts=known,
        )
        # The capacity bounds each expert's rows where this rank holds every expert (no expert parallelism: the
        # rows come from its own tokens alone), so the padded batched GEMM can size itself without a read.
        bound = capacity if self.dispatcher.num_local_experts == self.cfg.num_experts else None
        out = self.experts(rows, rows_per_expert, probs=row_probs, capacity=bound)
        out = self.dispatcher.combine(out, plan).to(hidden.dtype)
        if shared is not None:
            out = out + self._finish_shared_experts(shared)

        counts = count_per_expert(routing.topk_indices, self.cfg.num_experts)
        recomputing = in_recomputation()
        if not recomputing:
            with torch.no_grad():
                self.tokens_per_expert += counts
                self.rows_per_local_expert[: len(rows_per_expert)] += rows_per_expert
                self.assignments += tokens * top_k
                self.router_entropy_sum += router_entropy(routing.scores).double()
                if keep is not None:
                    self.dropped_assignments += keep.numel() - keep.sum()
        out = self._attach_balancing_losses(out, routing, counts, batch, seq, records, recomputing)
        return out.view(batch, seq, hidden_size)

    def _overlaps_shared_experts(self, x: torch.Tensor) -> bool:
        """Whether the shared experts run on a side stream: on CUDA, when the dispatch communicates (there is an
        all-to-all to hide them behind) and they hold no collective of their own (no token group: tensor,
        sequence or context parallelism would put an all-reduce or gather on the side stream, whose order
        against the dispatch's collectives would then be the streams' rather than the program's)."""
        return (x.device.type == "cuda" and self.token_group is None
                and self.dispatcher.num_local_experts < self.cfg.num_experts)

    def _start_shared_experts(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output, started before the routed experts' dispatch. On a side CUDA stream (see
        `_overlaps_shared_experts`) it runs while the main stream waits on the all-to-all: the side stream first
        waits for x (an event recorded on the main stream), and x is marked as used there (record_stream), so the
        allocator does not hand its memory out before the side stream is done with it. Autograd runs each
        backward op on its forward's stream, so their backward overlaps too. Elsewhere: the same order of ops,
        on the one stream."""
        if self.shared_experts is None:
            return None
        if not self._overlaps_shared_experts(x):
            return self.shared_experts(x)
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        ready = torch.cuda.Event()
        ready.record(main)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            x.record_stream(side)
            return self.shared_experts(x)

    def _finish_shared_experts(self, shared: torch.Tensor) -> torch.Tensor:
        """`shared` made usable on the current stream: the main stream waits for the side stream's work (an event)
        and the output, allocated on the side stream, is marked as used on the main one."""
        if shared.device.type != "cuda" or not self._overlaps_shared_experts(shared):
            return shared
        main = torch.cuda.current_stream(shared.device)
        done = torch.cuda.Event()
        done.record(_side_stream(shared.device))
        main.wait_event(done)
        shared.record_stream(main)
        return shared

    # Eager under train.compile: the switch-style losses' gradient is a holder's value, filled after the layer's
    # forward (by the layer, or the model for all_layers_aux_loss) and read by backward; a compiled backward
    # would read it at trace time. Attached eagerly, it is read when backward runs.
    @torch.compiler.disable
    def _attach_balancing_losses(self, out, routing, counts, batch, seq, records, recomputing) -> torch.Tensor:
        """Each loss over its token set. With a `token_group` (sequence parallelism) the set spans equal shards
        on several ranks: each rank's loss is its share (its tokens over the whole set), the shares sum to the
        single-device loss and each rank's gradient reaches its own router scores."""
        router = self.cfg.router
        experts = self.cfg.num_experts
        shards = 1 if self.token_group is None else dist.get_world_size(self.token_group)
        value = torch.zeros((), dtype=torch.float32, device=out.device)
        graph_loss = None  # losses that are functions of this forward alone: differentiated by autograd
        if router.load_balancing == "seq_aux_loss" and router.aux_loss_coeff > 0:
            scores = routing.scores.view(batch, seq, -1)
            graph_loss = router.aux_loss_coeff * seq_aux_loss(scores, routing.topk_indices.view(batch, seq, -1),
                                                              self.cfg.top_k, group=self.token_group)
        if router.z_loss_coeff > 0:
            z = router.z_loss_coeff * z_loss(routing.logits, token_shards=shards)
            graph_loss = z if graph_loss is None else graph_loss + z
        if graph_loss is not None:
            out = attach_loss(out, graph_loss, scale=self.balancing.scale)
            value = value + graph_loss.detach()
        # all_layers_aux_loss needs the model's forward to collect every layer (a layer run alone has none).
        collected = router.load_balancing != "all_layers_aux_loss" or records is not None
        if router.load_balancing in SWITCH_LOSSES and router.aux_loss_coeff > 0 and collected:
            holder = ScoreGradient()
            rows = routing.scores.shape[0] * shards  # of the token set (equal shards)
            if router.load_balancing == "all_layers_aux_loss":
                if not recomputing:
                    records.items.append(RoutingRecord(routing.scores.detach(), counts, holder))
            elif not recomputing:  # a recomputed forward's holder is never read: skip its collectives
                load = self._switch_load(counts, routing.scores.shape[0], router.load_balancing)
                holder.per_expert = router.aux_loss_coeff * experts * load / rows
                importance = routing.scores.detach().float().mean(dim=0)
                if shards > 1:  # this rank's share of the set's mean
                    importance = importance / shards
                value = value + router.aux_loss_coeff * experts * (load * importance).sum()
            out = attach_score_gradient(out, routing.scores, holder, scale=self.balancing.scale)
        if not recomputing:
            with torch.no_grad():
                self.aux_loss_value += value.double()
        return out

    @torch.no_grad()
    def _switch_load(self, counts: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
        """Fraction of the token set's rows assigned to each expert (sums to top_k)."""
        totals = torch.cat([counts, counts.new_full((1,), rows)])  # a fill on the device, not a host copy
        if self.token_group is not None:
            dist.all_reduce(totals, group=self.token_group)
        if kind == "global_aux_loss":
            if self.balance_group is not None:
                dist.all_reduce(totals, group=self.balance_group)
            totals = self.balancing.running_load(self, totals)
        return totals[:-1].float() / totals[-1].float()
