"""The decoder-only Transformer of every family: embedding, blocks, final norm, output head, optional MTP.

forward(input_ids, position_ids=None, *, labels=None) returns logits [b, s, vocab_size] only. What a trainer
needs besides the logits travels through a side channel read after the forward:
- `moe_stats()`: {layer index: MoEStats} of every MoE layer that ran (MTP blocks use indices num_layers + k);
- `aux_loss()`: the weighted load-balancing (+ z-) loss, a scalar with grad, 0 for dense models;
- `mtp_loss()`: mtp_loss_weight * mean over MTP depths of the cross-entropy on tokens shifted one more
  position per depth; computed by forward when labels are given (inside forward so that FSDP's unshard
  hooks cover the shared embedding and head), 0 otherwise.
The optimised loss is CE(logits, labels) + aux_loss() + mtp_loss().
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_train.config.schema import ModelConfig
from moe_train.models.attention import document_ids, document_mask
from moe_train.models.decoder import DecoderBlock
from moe_train.models.moe import MoEStats
from moe_train.models.moe.aux_loss import global_aux_loss, switch_aux_loss
from moe_train.models.mtp import MTPModule
from moe_train.models.norm import RMSNorm
from moe_train.models.rope import RotaryEmbedding

IGNORE_INDEX = -100


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        padded_vocab = cfg.padded_vocab_size()
        rope_dim = cfg.qk_rope_head_dim if cfg.family == "deepseek_v3" else cfg.attention_head_dim
        self.embed_tokens = nn.Embedding(padded_vocab, cfg.hidden_size)
        self.rope = RotaryEmbedding(dim=rope_dim, rope=cfg.rope)
        # A dict keyed by layer index keeps parameter names stable when a pipeline stage drops other layers.
        self.layers = nn.ModuleDict({str(i): DecoderBlock(cfg, layer_index=i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, padded_vocab, bias=False)
        self.mtp = nn.ModuleDict(
            {str(k): MTPModule(cfg, layer_index=cfg.num_layers + k) for k in range(cfg.mtp_layers)}
        )
        self.tie_weights()
        self._mtp_loss: torch.Tensor | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the head (tie_embeddings); re-run after materialising, which unties."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, vocab_size]. position_ids [b, s] or [1, s]: default 0..s-1;
        attention restarts wherever they fall back to 0. labels [b, s] (-100: ignored) only feed the MTP loss."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        mask = document_mask(position_ids)
        cos, sin = self.rope(position_ids)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers.values():
            hidden = layer(hidden, cos, sin, mask)
        hidden = self.norm(hidden)
        self._mtp_loss = None
        if labels is not None and len(self.mtp) > 0:
            self._mtp_loss = self._forward_mtp(hidden, input_ids, position_ids, labels, cos, sin, mask)
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over the real vocabulary only: padded rows never produce logits (nor receive gradient)."""
        return F.linear(hidden, self.lm_head.weight[: self.cfg.vocab_size])

    def _forward_mtp(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # The depth-k target at position i is token i+k+1: it counts only inside position i's document.
        docs = document_ids(position_ids).expand_as(labels)
        target_docs = shift_left(docs, fill=-1)
        losses = []
        for module in self.mtp.values():
            input_ids = shift_left(input_ids, fill=0)
            labels = shift_left(labels, fill=IGNORE_INDEX)
            target_docs = shift_left(target_docs, fill=-1)
            targets = labels.masked_fill(target_docs != docs, IGNORE_INDEX)
            hidden = module(hidden, self.embed_tokens(input_ids), cos, sin, mask)
            losses.append(cross_entropy(self.logits(hidden), targets))
        return self.cfg.mtp_loss_weight * torch.stack(losses).mean()

    def mtp_loss(self) -> torch.Tensor:
        """Weighted MTP loss of the last forward that had labels (a scalar with grad); 0 without MTP."""
        if self._mtp_loss is None:
            return torch.zeros((), device=self.embed_tokens.weight.device)
        return self._mtp_loss

    def moe_stats(self) -> dict[int, MoEStats]:
        """{layer index: MoEStats} of the MoE layers that ran in the last forward."""
        blocks = list(self.layers.values())
        if self._mtp_loss is not None:
            blocks += [module.block for module in self.mtp.values()]
        return {b.layer_index: b.mlp.stats for b in blocks if self.cfg.is_moe_layer(b.layer_index)}

    def aux_loss(self) -> torch.Tensor:
        """Weighted auxiliary loss of the last forward, as the recipe's router.load_balancing says.

        aux_loss: transformers' Qwen3-MoE loss over all layers' tokens together, E * sum_e f_e * P_e, times
        aux_loss_coeff. global_aux_loss: the same per layer, with the loads counted over this forward's tokens
        (a trainer that wants loads over the global batch all-reduces `moe_stats()` counts itself), summed over
        layers. seq_aux_loss and z-loss are per layer and come weighted in each layer's stats.
        """
        stats = list(self.moe_stats().values())
        total = torch.zeros((), device=self.embed_tokens.weight.device)
        for layer_stats in stats:
            total = total + layer_stats.aux_loss
        if not stats:
            return total
        router, num_experts = self.cfg.moe.router, self.cfg.moe.num_experts
        if router.load_balancing == "aux_loss":
            probs = torch.cat([s.router_probs for s in stats])
            indices = torch.cat([s.topk_indices for s in stats])
            total = total + router.aux_loss_coeff * switch_aux_loss(probs, indices, num_experts)
        elif router.load_balancing == "global_aux_loss":
            for s in stats:
                loss = global_aux_loss(s.router_probs, s.tokens_per_expert, s.router_probs.shape[0])
                total = total + router.aux_loss_coeff * loss
        return total


def shift_left(x: torch.Tensor, *, fill: int) -> torch.Tensor:
    """x[:, i] <- x[:, i + 1]; the last column takes `fill`."""
    return torch.cat((x[:, 1:], torch.full_like(x[:, :1], fill)), dim=1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy over the targets that are not IGNORE_INDEX (0 when there are none)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)
