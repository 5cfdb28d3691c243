"""Multi-head latent attention (DeepSeek-V2/V3): keys and values pass through a low-rank latent.

q: hidden -> q_lora_rank -> RMSNorm -> heads x (nope + rope), or one plain projection when q_lora_rank is null.
kv: hidden -> kv_lora_rank + rope (kv_a_proj_with_mqa); the latent part is normed and expanded to
heads x (nope + v) by kv_b_proj; the rope part is one key shared by all heads. Rotary embeddings touch only the
rope dims, in DeepSeek's interleaved layout. With YaRN the softmax scale grows by mscale(factor,
mscale_all_dim)^2. Where the device's attention kernel needs one head size for q, k and v (the kernel table's
`mla_value`: the CPU's flash kernel), the smaller side is zero-padded (zeros change neither q.k nor the output
columns kept); on CUDA, cuDNN, the memory-efficient kernel and FlexAttention take v with its own head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_train.config.schema import ModelConfig
from moe_train.kernels import kernels_for
from moe_train.models.attention import CoreAttention, head_max_logits, track_max_logits
from moe_train.models.layout_region import LayoutRegion
from moe_train.models.linear import Linear
from moe_train.models.norm import RMSNorm
from moe_train.models.rope import apply_rotary, yarn_mscale

# DeepSeek-V3 (and transformers) build the two latent norms with the default eps, not the model's norm_eps.
LATENT_NORM_EPS = 1e-6


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        hidden = cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=False)

        self.core_attention = CoreAttention()
        self.measures_max_logits = False  # QK-clip (train/qk_clip.py) sets it: `max_logits` per head, in training
        self.max_logits: torch.Tensor | None = None
        # The shared rope key joins the heads here: as it is in one process; tensor parallelism wraps it with the
        # heads' region entry (a gather of the sequence, or a copy whose gradient is summed over ranks).
        self.rope_key_to_heads = LayoutRegion(MLA._shared_rope_key)
        # The mla_up_proj region of recomputation and offloading (up projections, rotary embeddings, attention).
        self.layout_up_attend = LayoutRegion(MLA.up_attend)

        self.scale = qk_dim**-0.5
        yarn = cfg.rope.scaling
        if yarn is not None and yarn.mscale_all_dim:
            self.scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # Under sequence parallelism x is this rank's slice of the sequence: the low-rank down projections and
        # their norms run on it, and the sequence is gathered where the heads begin (parallel/tensor.py).
        q_latent = x if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rot = self.rope_key_to_heads(self, k_rot)
        out = self.layout_up_attend(self, q_latent, self.kv_a_layernorm(latent), k_rot, cos, sin, mask)
        return self.o_proj(out)

    def _shared_rope_key(self, k_rot: torch.Tensor) -> torch.Tensor:
        return k_rot

    def up_attend(self, q_latent: torch.Tensor, kv_latent: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Up projections, rotary embeddings and attention: [b, s, heads * v_dim] (the mla_up_proj region)."""
        q = self.q_proj(q_latent) if self.q_lora_rank is None else self.q_b_proj(q_latent)
        # Batch, sequence and head counts come from the projections' outputs, so tensor parallelism can shard
        # heads and sequence parallelism can hand in a slice of the sequence.
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(kv_latent).view(b, s, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)

        q_rot = apply_rotary(q_rot, cos, sin, interleaved=True)
        k_rot = apply_rotary(k_rot.reshape(b, 1, s, self.rope_dim), cos, sin, interleaved=True)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)

        if self.measures_max_logits and self.training:
            track_max_logits(self, head_max_logits(q, k, mask, self.scale))
        pad = q.shape[-1] - self.v_dim if kernels_for(q.device.type).mla_value == "padded" else 0
        if pad > 0:
            v = F.pad(v, (0, pad))
        elif pad < 0:
            q, k = F.pad(q, (0, -pad)), F.pad(k, (0, -pad))
        out = self.core_attention(q, k, v, mask, scale=self.scale)[..., : self.v_dim]
        return out.transpose(1, 2).reshape(b, s, -1)
