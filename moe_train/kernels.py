"""The per-device kernel table: which kernel runs each hot op, by device kind, in one place.

The choices differ because the kernels differ: on the CPU, SDPA's flash kernel takes an additive mask (and keeps
only its output and log-sum-exp for backward), and FlexAttention has no backward; on CUDA, SDPA's flash and cuDNN
kernels take no mask at all, so a document mask would send packed sequences to the math kernel, which saves the
[b, h, s, s] scores: FlexAttention's block mask skips the masked blocks instead. Grouped GEMM
(`torch._grouped_mm`) runs on the CPU and on CUDA from compute capability 9.0 (Hopper) in bf16.

Readers: moe_train/models/attention.py (`documents`), moe_train/models/moe/experts.py (`grouped_mm_min_major`,
through `grouped_mm_supported`), `train.compile`'s default (`compile`: moe_train/parallel/compile.py).
Torch-free: plan and the login half may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """One device kind's choices."""

    documents: Literal["sdpa_additive_mask", "flex_block_mask"]  # attention over packed documents
    causal: Literal["sdpa"]  # attention without restarts: SDPA with is_causal (flash / cuDNN / the CPU's flash)
    grouped_mm_min_major: int | None  # compute capability major from which torch._grouped_mm runs; None: always
    compile: bool  # train.compile's default (null)


KERNELS: dict[str, Kernels] = {
    "cpu": Kernels(documents="sdpa_additive_mask", causal="sdpa", grouped_mm_min_major=None, compile=False),
    "cuda": Kernels(documents="flex_block_mask", causal="sdpa", grouped_mm_min_major=9, compile=True),
}


def kernels_for(device_type: str) -> Kernels:
    """The table row of a device kind; a kind without a row (meta, fake tensors' cpu semantics) is the CPU's."""
    return KERNELS.get(device_type, KERNELS["cpu"])
