"""Grouped-query attention (Qwen3, GLM-4.5, gpt-oss), and the document mask shared with MLA.

Attention runs through F.scaled_dot_product_attention, which on CPU and GPU picks a fused kernel. Packed
sequences (data.reset_at_eod) restart their position ids at 0 at each document start; attention restarts
there too, through a block-diagonal causal mask, built whenever position ids are given (the trainer gives them
only with data.reset_at_eod); without them `is_causal=True` keeps the fastest kernel.

The mask every layer receives is in the form the device's kernel takes (moe_train/kernels.py), built once per
forward: on the CPU an additive fp32 mask, which SDPA's flash kernel uses as it is (a boolean one it converts
to float in every layer, one [b, s, s] copy saved per layer); on CUDA a FlexAttention block mask, since SDPA's
fast CUDA kernels take no mask and the math kernel would save the [b, h, s, s] scores. SDPA tries the table's
backends in its order (`sdpa_backends`: cuDNN, then flash, on CUDA), never torch's default order. gpt-oss's
sinks and sliding windows take no SDPA kernel that keeps only its output: they run attention written out through
its log-sum-exp (models/blockwise_attention.py), which keeps what a fused kernel keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from moe_train.config.schema import ModelConfig
from moe_train.kernels import kernels_for
from moe_train.models.blockwise_attention import sink_window_attention
from moe_train.models.layout_region import LayoutRegion
from moe_train.models.linear import Linear, attention_product
from moe_train.models.norm import RMSNorm
from moe_train.models.rope import apply_rotary


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Index of the document each token belongs to: a new document starts wherever the position is 0."""
    return (position_ids == 0).cumsum(dim=-1)


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether a document starts after token 0. On the meta device the values are unknown and plain causal
    attention is assumed; fake tensors (measure --fake, which feeds positions only for packed documents) are
    taken to restart, so the packed step's shapes are measured."""
    if position_ids.device.type == "meta":
        return False
    return is_fake(position_ids) or bool((position_ids[..., 1:] == 0).any())


def document_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Block-diagonal causal mask [b, 1, s, s] (True: attend), or None when no document starts after token 0."""
    if not _restarts(position_ids):
        return None
    docs = document_ids(position_ids)
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return ((docs[..., :, None] == docs[..., None, :]) & causal).unsqueeze(-3)


def attention_mask(position_ids: torch.Tensor) -> torch.Tensor | BlockMask | None:
    """The document mask of given position ids in the form the device's attention kernel takes (the kernel
    table's `documents`): an additive fp32 mask [b, 1, s, s] (0 or -inf) or a FlexAttention block mask; None
    (plain causal) only on the meta device. Built without reading the positions (no device-to-host read per
    forward): positions without a restart give the causal mask, which SDPA's CPU kernel applies bit for bit as
    `is_causal` does; callers without restarts pass no positions (the trainer: only with data.reset_at_eod)."""
    if position_ids.device.type == "meta":
        return None
    docs = document_ids(position_ids)
    if kernels_for(position_ids.device.type).documents == "flex_block_mask":
        return _block_mask(docs)
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    allowed = ((docs[..., :, None] == docs[..., None, :]) & causal).unsqueeze(-3)
    additive = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
    return additive.masked_fill_(~allowed, float("-inf"))


def _block_mask(docs: torch.Tensor) -> BlockMask:
    """FlexAttention's block mask of causal attention within each document (CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_index, kv_index):
        return (docs[b, q_index] == docs[b, kv_index]) & (q_index >= kv_index)

    seq = docs.shape[-1]
    return create_block_mask(same_document_causal, docs.shape[0], None, seq, seq, device=docs.device)


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once: uncompiled it materialises the scores (and warns)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def sdpa_backends(device_type: str) -> list[SDPBackend]:
    """The kernel table's SDPA backends of a device kind, in the order SDPA tries them."""
    return [getattr(SDPBackend, name) for name in kernels_for(device_type).sdpa_backends]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None, *,
           window: int | None = None, sinks: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Attention over [b, heads, s, d]: causal SDPA, SDPA restricted by an additive document mask, or
    FlexAttention under a block mask (what `attention_mask` built for this device). A sliding `window` or
    attention `sinks` (gpt-oss) run `sink_window_attention` on every device (the kernel table's
    `sinks_and_windows`): written out through its log-sum-exp, it keeps what a fused kernel keeps, where SDPA
    would take the sinks only as a mask column with a gradient, on its MATH kernel, which keeps the scores."""
    if window is not None or sinks is not None:
        if isinstance(mask, BlockMask):
            raise NotImplementedError("attention sinks and sliding windows under a FlexAttention block mask")
        return sink_window_attention(q, k, v, mask, window=window, sinks=sinks, scale=kwargs.get("scale"))
    if isinstance(mask, BlockMask):
        return _compiled_flex_attention()(q, k, v, block_mask=mask, **kwargs)
    if mask is not None and mask.is_floating_point() and q.dtype == torch.float64:
        mask = mask.to(q.dtype)  # torch 2.13's CPU SDPA misreads an fp32 additive mask on fp64 q (fp64: tests)
    with sdpa_kernel(sdpa_backends(q.device.type), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **kwargs)


# Elements of the score block one step of `head_max_logits` materialises (fp32: 256 MiB).
MAX_LOGIT_BLOCK = 1 << 26


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | BlockMask | None,
                    scale: float) -> torch.Tensor:
    """The largest pre-softmax logit scale * q.k of each query head over the allowed (causal, same-document)
    pairs: [heads] fp32, for QK-clip (train/qk_clip.py). The attention kernel does not return its scores, so this
    forms them again beside it: one more QK^T product per layer (2 b h s^2 d FLOPs, a third of the forward
    attention's 6 b h s^2 d with PV, no backward), a block of heads at a time so that at most MAX_LOGIT_BLOCK
    scores are live, nothing saved. Under a FlexAttention block mask (CUDA, packed documents) the causal mask is
    taken: pairs across documents count too, a larger maximum, so clipping errs on the safe side."""
    heads, seq = q.shape[1], q.shape[-2]
    if k.shape[1] != heads:  # grouped keys: each serves heads / kv_heads query heads
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    if isinstance(mask, torch.Tensor):
        additive = mask.float()
    else:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        additive = torch.zeros(seq, seq, device=q.device).masked_fill_(~causal, float("-inf"))
    block = max(1, MAX_LOGIT_BLOCK // (q.shape[0] * seq * k.shape[-2]))
    maxima = []
    for start in range(0, heads, block):
        scores = attention_product(q[:, start: start + block].float(), k[:, start: start + block].float().mT)
        maxima.append((scores * scale + additive).amax(dim=(0, 2, 3)))
    return torch.cat(maxima)


def track_max_logits(module: nn.Module, logits: torch.Tensor) -> None:
    """Keep the step's running maximum per head on an attention module (`max_logits`, reset by QK-clip)."""
    module.max_logits = logits if module.max_logits is None else torch.maximum(module.max_logits, logits)


class CoreAttention(nn.Module):
    """`attend` as a module (no parameters). Layouts: `layout_forward` is the `core_attn` region of
    recomputation and offloading; `parallel` (a class default of None) is context parallelism's attention
    across the cp ranks (parallel/context_parallel.py), called with the same arguments."""

    parallel: Callable[..., torch.Tensor] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.layout_forward = LayoutRegion(CoreAttention._forward)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, **kwargs) -> torch.Tensor:
        return self.layout_forward(self, q, k, v, mask, **kwargs)

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None,
                 **kwargs) -> torch.Tensor:
        if self.parallel is not None:
            return self.parallel(q, k, v, mask, **kwargs)
        return attend(q, k, v, mask, **kwargs)


class Attention(nn.Module):
    """Multi-head attention with num_query_groups key/value heads, optional RMSNorm over head_dim on q and k
    (qk_norm), optional q/k/v biases (attention_bias, GLM-4.5), an o_proj bias, sinks and a sliding window
    (gpt-oss) and rotary embeddings over the first `rotary_dim` features of each head (the angles' width
    decides: models/rope.py).

    Layouts (`layout_forward`): tensor parallelism enters its region with the input, q/k/v column- and o_proj
    row-parallel (each Linear's `parallel`), the heads (and sinks) sharded."""

    def __init__(self, cfg: ModelConfig, *, layer_index: int = 0) -> None:
        """`layer_index`: which of `cfg.layer_types` this layer is (its sliding window, gpt-oss)."""
        super().__init__()
        heads, kv_heads, self.head_dim = cfg.num_attention_heads, cfg.kv_heads, cfg.attention_head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_output_bias)
        self.window = cfg.attention_window(layer_index)
        self.sinks = nn.Parameter(torch.empty(heads)) if cfg.attention_sinks else None
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.core_attention = CoreAttention()
        self.measures_max_logits = False  # QK-clip (train/qk_clip.py) sets it: `max_logits` per head, in training
        self.max_logits: torch.Tensor | None = None
        self.layout_forward = LayoutRegion(Attention._forward)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.layout_forward(self, x, cos, sin, mask)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
                 ) -> torch.Tensor:
        # Head counts come from the projections' outputs (-1), so tensor parallelism can shard heads.
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        if self.measures_max_logits and self.training:
            track_max_logits(self, head_max_logits(q, k, mask, self.head_dim**-0.5))
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks  # tp: this rank's heads
        extra = {} if self.window is None and sinks is None else {"window": self.window, "sinks": sinks}
        out = self.core_attention(q, k, v, mask, enable_gqa=q.shape[1] != k.shape[1], **extra)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
