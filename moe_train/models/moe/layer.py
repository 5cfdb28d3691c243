"""The MoE layer: router -> (capacity) -> dispatch -> grouped experts -> combine, plus shared experts.

forward(hidden [b, s, h]) -> [b, s, h]. Beside the output, each forward leaves a `MoEStats` in `layer.stats`:
the model collects them into its side channel (aux losses and expert loads for the trainer), so the logits stay
the only return value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_train.config.schema import MoEConfig
from moe_train.models.mlp import MLP
from moe_train.models.moe.aux_loss import seq_aux_loss, z_loss
from moe_train.models.moe.capacity import capacity_keep_mask, expert_capacity
from moe_train.models.moe.dispatcher import LocalDispatcher
from moe_train.models.moe.experts import GroupedExperts
from moe_train.models.moe.router import Router, count_per_expert


@dataclass
class MoEStats:
    """What one MoE forward reports (T = b*s tokens, E experts, K = top_k)."""

    router_logits: torch.Tensor  # [T, E] fp32, with grad
    router_probs: torch.Tensor  # [T, E] fp32 softmax probabilities or sigmoid scores, with grad
    topk_indices: torch.Tensor  # [T, K] int64
    topk_weights: torch.Tensor  # [T, K] fp32, with grad (before any capacity drop)
    tokens_per_expert: torch.Tensor  # [E] int64, detached: assignments routed to each expert, before drops
    dropped_fraction: float  # share of the T*K assignments dropped by the capacity (0.0 when dropless)
    aux_loss: torch.Tensor  # scalar: this layer's weighted seq-aux and z losses (0 when none apply)
    capacity: int | None  # rows per expert, None when dropless


class MoELayer(nn.Module):
    """A routed-expert FFN block (Qwen3-MoE, DeepSeek-V3) with the names of transformers' checkpoints.

    The model-wide aux loss of `load_balancing: aux_loss` (transformers' Qwen3-MoE) couples all layers, so the
    model computes it from every layer's `stats` with `switch_aux_loss`; likewise `global_aux_loss` needs counts
    over the whole batch. Only the per-layer losses (seq_aux_loss, z-loss) are in `stats.aux_loss`.
    """

    def __init__(self, *, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.router = Router(hidden_size=hidden_size, moe=moe)
        self.experts = GroupedExperts(
            num_experts=moe.num_experts, hidden_size=hidden_size, ffn_hidden_size=moe.ffn_hidden_size
        )
        if moe.shared_expert_ffn_hidden_size > 0:
            self.shared_experts = MLP(hidden_size=hidden_size, ffn_hidden_size=moe.shared_expert_ffn_hidden_size)
        else:
            self.shared_experts = None
        # Expert parallelism swaps this for a dispatcher over the expert-parallel group.
        self.dispatcher = LocalDispatcher(num_experts=moe.num_experts)
        self.stats: MoEStats | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden_size = hidden.shape
        x = hidden.reshape(-1, hidden_size)
        routing = self.router(x)
        tokens, top_k = routing.topk_indices.shape

        keep, capacity = None, None
        if self.moe.capacity_factor is not None:
            capacity = expert_capacity(
                num_tokens=tokens,
                top_k=top_k,
                num_experts=self.moe.num_experts,
                capacity_factor=self.moe.capacity_factor,
            )
            keep = capacity_keep_mask(
                routing.topk_indices,
                routing.topk_weights,
                num_experts=self.moe.num_experts,
                capacity=capacity,
                policy=self.moe.drop_policy,
            )
        rows, rows_per_expert, plan = self.dispatcher.dispatch(
            x, routing.topk_indices, keep=keep, pad_to=capacity if self.moe.pad_to_capacity else None
        )
        out = self.experts(rows, rows_per_expert)
        out = self.dispatcher.combine(out, routing.topk_weights, plan).to(hidden.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)

        self.stats = MoEStats(
            router_logits=routing.logits,
            router_probs=routing.scores,
            topk_indices=routing.topk_indices,
            topk_weights=routing.topk_weights,
            tokens_per_expert=count_per_expert(routing.topk_indices, self.moe.num_experts),
            dropped_fraction=0.0 if keep is None else 1.0 - int(keep.sum()) / keep.numel(),
            aux_loss=self._aux_loss(routing.logits, routing.scores, routing.topk_indices, batch, seq),
            capacity=capacity,
        )
        return out.view(batch, seq, hidden_size)

    def _aux_loss(
        self, logits: torch.Tensor, scores: torch.Tensor, topk_indices: torch.Tensor, batch: int, seq: int
    ) -> torch.Tensor:
        cfg = self.moe.router
        loss = torch.zeros((), dtype=torch.float32, device=logits.device)
        if cfg.load_balancing == "seq_aux_loss" and cfg.aux_loss_coeff > 0:
            per_seq = seq_aux_loss(scores.view(batch, seq, -1), topk_indices.view(batch, seq, -1), self.moe.top_k)
            loss = loss + cfg.aux_loss_coeff * per_seq
        if cfg.z_loss_coeff > 0:
            loss = loss + cfg.z_loss_coeff * z_loss(logits)
        return loss
