"""The SwiGLU feed-forward block of dense layers (and of DeepSeek-V3's shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_train.models.layout_region import LayoutRegion
from moe_train.models.linear import Linear


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); names match transformers' checkpoints (gate_proj, up_proj, down_proj).

    Layouts (`layout_forward`): tensor parallelism enters its region with the input (gate and up column-, down
    row-parallel: each Linear's `parallel`); recomputation and offloading wrap it whole as the `mlp` region (a
    dense layer's feed-forward) or `shared_experts` (a MoE layer's)."""

    def __init__(self, *, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = Linear(ffn_hidden_size, hidden_size, bias=False)
        self.layout_forward = LayoutRegion(MLP._forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout_forward(self, x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
