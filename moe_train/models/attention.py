"""Grouped-query attention with QK-norm (Qwen3), and the document mask shared with MLA.

Attention runs through F.scaled_dot_product_attention, which on CPU and GPU picks a fused kernel. Packed
sequences (data.reset_at_eod) restart their position ids at 0 at each document start; attention restarts
there too, through a block-diagonal causal mask. The mask is only built when a restart exists: without one,
`is_causal=True` keeps the fastest kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from moe_train.config.schema import ModelConfig
from moe_train.models.linear import Linear
from moe_train.models.norm import RMSNorm
from moe_train.models.rope import apply_rotary


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Index of the document each token belongs to: a new document starts wherever the position is 0."""
    return (position_ids == 0).cumsum(dim=-1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Block-diagonal causal mask [b, 1, s, s] (True: attend), or None when no document starts after token 0.

    On the meta device or as fake tensors (shape-only runs: `moe-train measure --fake`) the values are unknown:
    plain causal attention is assumed.
    """
    if position_ids.device.type == "meta" or is_fake(position_ids) or not bool((position_ids[..., 1:] == 0).any()):
        return None
    docs = document_ids(position_ids)
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return ((docs[..., :, None] == docs[..., None, :]) & causal).unsqueeze(-3)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, **kwargs) -> torch.Tensor:
    """SDPA over [b, heads, s, d]: causal, or restricted by a document mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **kwargs)


class CoreAttention(nn.Module):
    """`attend` as a module (no parameters): the region `parallel.recompute`'s core_attn policy recomputes."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                **kwargs) -> torch.Tensor:
        return attend(q, k, v, mask, **kwargs)


class Attention(nn.Module):
    """Multi-head attention with num_query_groups key/value heads and RMSNorm over head_dim on q and k."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        heads, kv_heads, self.head_dim = cfg.num_attention_heads, cfg.kv_heads, cfg.attention_head_dim
        self.q_proj = Linear(cfg.hidden_size, heads * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.core_attention = CoreAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # Head counts come from the projections' outputs (-1), so tensor parallelism can shard heads.
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        out = self.core_attention(q, k, v, mask, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
