"""The per-device peak FLOP/s that MFU is measured against.

On a GPU the peak is the hardware table's dense bf16 figure. A CPU has no such table row worth trusting (core
counts, clocks and vector units vary), so the peak is measured once at start: the fastest of a quarter second
(~80 samples) of single 512x512 matmuls in the training dtype, on one thread, times the threads torch uses. One
thread, because a multi-threaded matmul on cores shared with other processes waits for its slowest thread, so no
sample escapes the contention; single-threaded samples do, and matmul throughput scales linearly with threads
at this size (measured: 113 GFLOP/s on 1 thread, 215 on 2). MFU on CPU therefore answers "how close to this
machine's own matmul speed", which is what tuning needs.
"""

from __future__ import annotations

import functools
import time

import torch

_MATMUL_SIZE = 512
_MEASURE_SECONDS = 0.25  # of a default run that lasts about a minute


@functools.cache
def _one_thread_matmul_flops(dtype: torch.dtype, seconds: float) -> float:
    n = _MATMUL_SIZE
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = torch.randn(n, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # warm the kernels and allocator
        best = 0.0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(threads)
    return best


def measured_matmul_flops(dtype: torch.dtype = torch.float32, *, seconds: float = _MEASURE_SECONDS) -> float:
    """This process's CPU matmul peak in `dtype`: the best one-thread rate times torch's thread count.

    The one-thread measurement is cached per process: a process that trains several times (tests, benchmarks)
    measures once."""
    return _one_thread_matmul_flops(dtype, seconds) * torch.get_num_threads()


def peak_flops(*, device: str, gpu: str, precision: str) -> float:
    """Peak FLOP/s of one device for `precision`: the hardware table on GPUs, a measurement on CPU."""
    if device == "cpu":
        return measured_matmul_flops(torch.bfloat16 if precision == "bf16" else torch.float32)
    from moe_train.config.hardware import hardware_table

    # fp32 runs on a GPU compute in TF32 tensor cores at best; the dense bf16 figure is the honest ceiling.
    return hardware_table()[gpu].bf16_flops
