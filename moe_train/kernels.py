"""The per-device kernel table: which kernel runs each hot op, by device kind, in one place.

The choices differ because the kernels differ: on the CPU, SDPA's flash kernel takes an additive mask (and keeps
only its output and log-sum-exp for backward), and FlexAttention has no backward; on CUDA, SDPA's flash and cuDNN
kernels take no mask at all, so a document mask would send packed sequences to the math kernel, which saves the
[b, h, s, s] scores: FlexAttention's block mask skips the masked blocks instead. Grouped GEMM
(`torch._grouped_mm`) runs on the CPU and on CUDA from compute capability 9.0 (Hopper) in bf16. FP8 GEMMs
(models/fp8/gemm.py): `torch._scaled_mm` takes tensorwise and rowwise scales on both (the CPU kernel checked with torch
2.13; CUDA from sm89, and `validate` refuses a GPU without fp8 tensor cores); the other recipes and the routed
experts' grouped fp8 GEMMs are emulated (quantise, dequantise, bf16 GEMM) on both until their kernels are built.

SDPA's backends, in the order tried (`torch.nn.attention.sdpa_kernel(..., set_priority=True)`): on CUDA cuDNN
first (on Hopper with cuDNN >= 9.10 it takes head dims up to 256, and a value head dim other than q/k's), then
flash (one head dim for q, k and v, at most 256), then the memory-efficient kernel (q/k's dim and v's may
differ), the math kernel last (it saves the scores: only for what no fused kernel takes, fp32 on old parts).
The CPU has its flash kernel and math. The value dim decides MLA's padding (`mla_value`): the CPU's flash
kernel refuses a v head dim other than q/k's (torch 2.13: "Flash attention requires q,k,v to have the same last
dimension"), so MLA zero-pads v to it there; on CUDA cuDNN, the memory-efficient kernel and FlexAttention take
v as it is (torch's sdp_utils and flex_attention's checks), so the padding's extra bytes and FLOPs are not spent.

Readers: moe_train/models/attention.py (`documents`, `sdpa_backends`), moe_train/models/fp8/gemm.py
(`fp8_scaled_mm`), moe_train/models/mla.py and plan/saved_tensors.py (`mla_value`), moe_train/models/moe/experts.py
(`grouped_mm_min_major`, `experts_fallback`, through `expert_kernel`), `train.compile`'s default (`compile`:
moe_train/parallel/compile.py).
Torch-free: plan and the login half may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SdpaBackend = Literal["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """One device kind's choices."""

    documents: Literal["sdpa_additive_mask", "flex_block_mask"]  # attention over packed documents
    causal: Literal["sdpa"]  # attention without restarts: SDPA with is_causal (flash / cuDNN / the CPU's flash)
    sdpa_backends: tuple[SdpaBackend, ...]  # SDPA's backends in the order tried (torch's SDPBackend names)
    mla_value: Literal["padded", "own"]  # MLA's v: zero-padded to q/k's head dim, or its own (v_head_dim)
    grouped_mm_min_major: int | None  # compute capability major from which torch._grouped_mm runs; None: always
    experts_fallback: Literal["loop", "padded_bmm"]  # experts where torch._grouped_mm cannot run (dtype, strides)
    compile: bool  # train.compile's default (null)
    fp8_scaled_mm: frozenset[str]  # train.fp8.recipe values whose linear GEMMs run torch._scaled_mm; others emulated


_SCALED_MM = frozenset({"tensorwise", "rowwise"})

KERNELS: dict[str, Kernels] = {
    "cpu": Kernels(documents="sdpa_additive_mask", causal="sdpa", sdpa_backends=("FLASH_ATTENTION", "MATH"),
                   mla_value="padded", grouped_mm_min_major=None, experts_fallback="loop", compile=False,
                   fp8_scaled_mm=_SCALED_MM),
    "cuda": Kernels(documents="flex_block_mask", causal="sdpa",
                    sdpa_backends=("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
                    mla_value="own", grouped_mm_min_major=9, experts_fallback="padded_bmm", compile=True,
                    fp8_scaled_mm=_SCALED_MM),
}


def kernels_for(device_type: str) -> Kernels:
    """The table row of a device kind; a kind without a row (meta, fake tensors' cpu semantics) is the CPU's."""
    return KERNELS.get(device_type, KERNELS["cpu"])
