"""One pre-norm decoder block: x + attention(norm(x)), then x + mlp(norm(x)), the MLP dense or MoE."""

from __future__ import annotations

import torch
from torch import nn

from moe_train.config.schema import ModelConfig
from moe_train.models.attention import Attention
from moe_train.models.mla import MLA
from moe_train.models.mlp import MLP
from moe_train.models.moe import MoELayer
from moe_train.models.moe.aux_loss import StepBalancing
from moe_train.models.moe.layer import RoutingRecords
from moe_train.models.norm import RMSNorm


class DecoderBlock(nn.Module):
    """Attention is MLA for deepseek_v3, GQA otherwise; the MLP is MoE where `cfg.is_moe_layer(layer_index)`.

    Submodule names are transformers' (self_attn, mlp, input_layernorm, post_attention_layernorm), so HF
    checkpoint keys map onto ours by prefix alone, except inside the MoE layer.
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
            self.mlp = MoELayer(hidden_size=cfg.hidden_size, moe=cfg.moe, balancing=balancing)
        else:
            self.mlp = MLP(hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        records: RoutingRecords | None = None,
    ) -> torch.Tensor:
        """records: the model's collection of routings for all_layers_aux_loss (MoE layers only)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, records) if self.is_moe else self.mlp(h))
