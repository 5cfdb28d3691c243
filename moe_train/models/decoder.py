"""One pre-norm decoder block: x + attention(norm(x)), then x + ffn(norm(x)), the feed-forward dense or MoE."""

from __future__ import annotations

import torch
from torch import nn

from moe_train.config.schema import ModelConfig
from moe_train.models.attention import Attention
from moe_train.models.layout_region import LayoutRegion
from moe_train.models.mla import MLA
from moe_train.models.mlp import MLP
from moe_train.models.moe import MoELayer
from moe_train.models.moe.aux_loss import StepBalancing
from moe_train.models.moe.layer import RoutingRecords
from moe_train.models.norm import RMSNorm


class DecoderBlock(nn.Module):
    """Attention is MLA for deepseek_v3, GQA otherwise; the feed-forward `ffn` is a MoELayer where
    `cfg.is_moe_layer(layer_index)`, a dense MLP otherwise.

    Submodule names are transformers' (self_attn, input_layernorm, post_attention_layernorm) but for `ffn`,
    transformers' `mlp` (which names a MoE layer too): checkpoint/hf.py maps the two.

    Layouts (`layout_forward`): offloading runs the whole block as one pass of its pool (parallel/offload.py).
    """

    def __init__(self, cfg: ModelConfig, *, layer_index: int, balancing: StepBalancing | None = None) -> None:
        """balancing: the model's StepBalancing, shared by its MoE layers (a block alone has its own)."""
        super().__init__()
        self.layer_index = layer_index
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = MLA(cfg) if cfg.family == "deepseek_v3" else Attention(cfg, layer_index=layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_index)
        if self.is_moe:
            self.ffn = MoELayer(hidden_size=cfg.hidden_size, cfg=cfg.moe, balancing=balancing)
        else:
            self.ffn = MLP(hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size)
        self.layout_forward = LayoutRegion(DecoderBlock._forward)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        records: RoutingRecords | None = None,
    ) -> torch.Tensor:
        """records: the model's collection of routings for all_layers_aux_loss (MoE layers only)."""
        return self.layout_forward(self, x, cos, sin, mask, records)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                 records: RoutingRecords | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + (self.ffn(h, records) if self.is_moe else self.ffn(h))
