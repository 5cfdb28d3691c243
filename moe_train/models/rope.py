"""Rotary position embeddings: plain and YaRN frequencies, half-split and interleaved (DeepSeek-V3) layouts,
over the whole head or its first part (partial rotary, GLM-4.5).

The angles, cos and sin are computed in fp32 from the position ids on every forward (no buffers: nothing to
materialise after building on the meta device, nothing to checkpoint); only the finished cos/sin are cast to
the activation dtype for the rotation, as transformers and Megatron-Core do (rotating in fp32 would add four
dtype conversions per layer for no measurable gain). Frequencies and the YaRN attention factor follow
transformers' formulas to the bit, which is what lets our logits match Hugging Face models within 1e-4.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_train.config.schema import RopeConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inverse_frequencies(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies [dim/2] and the factor cos/sin are multiplied by (1 without YaRN)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    yarn = rope.scaling
    if yarn is None:
        return 1.0 / (rope.theta**exponents), 1.0

    if yarn.mscale and yarn.mscale_all_dim:
        attention_factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(yarn.factor)

    # Dimensions rotating fast within the original context keep their frequency (extrapolation), slow ones are
    # divided by the factor (interpolation), with a linear ramp between the two correction dimensions.
    def correction_dim(rotations: float) -> float:
        wavelengths = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:  # transformers' default; gpt-oss keeps the unrounded dimensions
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    base = rope.theta**exponents
    inv_freq = 1.0 / (yarn.factor * base) * (1 - keep) + 1.0 / base * keep
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Maps position ids [b, s] to fp32 (cos, sin) [b, s, dim/2], shared by every layer of one forward."""

    def __init__(self, *, dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.dim = dim
        self.rope = rope
        # The frequencies on the device of the last forward (a cache, not a buffer: never checkpointed). Copying
        # a CPU tensor to the GPU on every forward would synchronise the host with the stream each step.
        self._inv_freq: torch.Tensor | None = None

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != position_ids.device:
            inv_freq, self._attention_factor = inverse_frequencies(self.dim, self.rope)
            self._inv_freq = inv_freq.to(position_ids.device)
        angles = position_ids[..., None].float() * self._inv_freq
        return angles.cos() * self._attention_factor, angles.sin() * self._attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [b, heads, s, d] by the angles (cos, sin) [b, s, d/2].

    Half-split layout (Qwen3): pairs are (x[i], x[i + d/2]). Interleaved layout (DeepSeek-V3): pairs are
    (x[2i], x[2i+1]); the result is written half-split, as transformers does: q and k get the same permutation,
    so their dot products, the only thing attention uses, are unchanged. Partial rotary (GLM-4.5), angles for
    fewer than d/2 pairs: the first 2 x cos.shape[-1] features rotate (half-split among themselves, as
    transformers' apply_rotary_pos_emb) and the rest pass through unchanged.
    """
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        turned = apply_rotary(x[..., :rotary], cos, sin, interleaved=interleaved)
        return torch.cat((turned, x[..., rotary:]), dim=-1)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
