"""The per-device peak FLOP/s that MFU is measured against.

On a GPU the peak is the hardware table's dense figure for the training precision. A CPU has no such table
row worth trusting (core counts, clocks and vector units vary, and other processes share the cores), so the
peak is measured once at start: the best rate of a square matmul in the training dtype over about a second.
MFU on CPU therefore answers "how close to this machine's own matmul speed", which is what tuning needs.
"""

from __future__ import annotations

import functools
import time

import torch

_MATMUL_SIZE = 512
_MEASURE_SECONDS = 1.0


@functools.cache
def measured_matmul_flops(dtype: torch.dtype = torch.float32, *, seconds: float = _MEASURE_SECONDS) -> float:
    """Best observed FLOP/s of an n x n matmul on the CPU, sampled for `seconds`.

    Cached per process: a process that trains several times (tests, sweeps in-process) measures once."""
    n = _MATMUL_SIZE
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = torch.randn(n, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.mm(a, b)  # warm the kernels and allocator
    # Many one-matmul samples (about a millisecond each), keeping the fastest: on cores shared with other
    # processes some samples still run undisturbed, where a long average would measure the contention.
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    return best


def peak_flops(*, device: str, gpu: str, precision: str) -> float:
    """Peak FLOP/s of one device for `precision`: the hardware table on GPUs, a measurement on CPU."""
    if device == "cpu":
        return measured_matmul_flops(torch.bfloat16 if precision == "bf16" else torch.float32)
    from moe_train.config.hardware import HARDWARE

    # fp32 runs on a GPU compute in TF32 tensor cores at best; the dense bf16 figure is the honest ceiling.
    return HARDWARE[gpu].bf16_flops
