"""DeepSeek-V3 multi-token prediction (MTP): module k predicts the token k+1 positions ahead of the main head.

At position i, module k combines the previous depth's hidden state h_i (the main model's final-normed output for
k = 1) with the embedding of token i+k: eh_proj(cat(enorm(emb), hnorm(h))), runs one decoder block over the
sequence, normalises, and scores with the shared output head. The embedding and head are the main model's
(shared, not copied), as in the paper, Megatron-Core and DeepSeek's checkpoints (whose per-module copies
`embed_tokens` / `shared_head.head` import_hf ignores and export_hf leaves out).

The depth-k inputs and targets are the sequence shifted k (k+1) tokens left (`mtp_shifts`). The shift needs the
whole sequence: under context parallelism the data shifts it before cutting the shards (train/batch.py), so no
target at a shard's edge is dropped or taken from the wrong chunk.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_train.config.schema import ModelConfig
from moe_train.models.attention import document_ids
from moe_train.models.decoder import DecoderBlock
from moe_train.models.linear import Linear
from moe_train.models.loss import IGNORE_INDEX
from moe_train.models.moe.aux_loss import StepBalancing
from moe_train.models.moe.layer import RoutingRecords
from moe_train.models.norm import RMSNorm


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, *, layer_index: int, balancing: StepBalancing | None = None) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderBlock(cfg, layer_index=layer_index, balancing=balancing)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        records: RoutingRecords | None = None,
    ) -> torch.Tensor:
        """hidden [b, s, h] from the previous depth, next_embeds [b, s, h] of the tokens k ahead -> [b, s, h]."""
        x = self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))
        return self.norm(self.block(x, cos, sin, mask, records))


def shift_left(x: torch.Tensor, *, fill: int) -> torch.Tensor:
    """x[:, i] <- x[:, i + 1]; the last column takes `fill`."""
    return torch.cat((x[:, 1:], torch.full_like(x[:, :1], fill)), dim=1)


def mtp_shifts(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, *, depth: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP's inputs and targets [b, depth, s] of whole sequences: at depth k (from 1), position i reads token
    i+k and predicts label i+k (token i+k+1), a target that counts only inside position i's document."""
    docs = document_ids(position_ids).expand_as(labels)
    target_docs = shift_left(docs, fill=-1)
    inputs, targets = [], []
    for _ in range(depth):
        input_ids = shift_left(input_ids, fill=0)
        labels = shift_left(labels, fill=IGNORE_INDEX)
        target_docs = shift_left(target_docs, fill=-1)
        inputs.append(input_ids)
        targets.append(labels.masked_fill(target_docs != docs, IGNORE_INDEX))
    return torch.stack(inputs, dim=1), torch.stack(targets, dim=1)
