"""`train.deterministic`: the same inputs give the same bits, on CUDA too.

Bitwise resume and layout equality (the single-process run of a recipe equals its TP/EP/PP layouts) hold on the
CPU as is, but CUDA by default picks kernels that add in a run-dependent order: atomics in index_add/scatter_add
(the MoE combine, the vocabulary-parallel loss), flash attention's backward, cuBLAS's split-K reductions. With
`train.deterministic` torch is told to use its deterministic kernels (and to raise where an op has none) and
cuBLAS gets a fixed workspace, which it reads only when CUDA starts: so this runs before the first CUDA call,
and the rendered job exports the variable too (moe_train/runtime.py: DETERMINISTIC_ENV).

What it costs: on CUDA the deterministic kernels are slower (sorted instead of atomic accumulation, cuDNN's
non-deterministic attention backends excluded); on the CPU the same kernels run either way and the numbers do
not change (tests/test_gpu_path.py), so the field does not name a different run (launch/rundir.py).
"""

from __future__ import annotations

import os

import torch

from moe_train.runtime import DETERMINISTIC_ENV


class DeterminismTooLate(RuntimeError):
    """CUDA started before the cuBLAS workspace was fixed: its matmuls would not be deterministic."""


def apply_determinism(deterministic: bool) -> None:
    """Switch torch to deterministic kernels (or back: tests run both in one process). Call before CUDA starts."""
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    if not deterministic:
        return
    for name, value in DETERMINISTIC_ENV.items():
        if name not in os.environ:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                raise DeterminismTooLate(f"train.deterministic: CUDA started before {name} was set; export "
                                         f"{name}={value} before the process starts (the rendered job does)")
            os.environ[name] = value
    torch.backends.cudnn.benchmark = False
