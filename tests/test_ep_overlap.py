"""Overlapped micro-batches (`parallel.ep_overlap`, parallel/overlap.py) against the plain step of the same
layout: the same losses, every gradient of step 1 and every parameter after the last step, bit for bit.

The pairs run the plain step's ops on the same values in the same order within each micro-batch, and each
parameter's gradient accumulates over the micro-batches in the plain order, so nothing may part by a bit
(tolerance 0). One gloo job per world size runs every case, overlapped and plain.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, case
from multirank import run_ranks

EXACT = {"loss": 0.0, "rtol": 0.0, "atol": 0.0}
FP32 = ["train.micro_batch_size=1", "train.precision=fp32"]  # 4 micro-batches a rank at DP2: 3 pairs a step
OVERLAP = "parallel.ep_overlap=true"
LAYOUTS_2 = {
    "ep2-alltoall": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2"]),
    "ep2-deepseek": ("deepseek-v3-tiny", [*FP32, "parallel.ep=2"]),  # shared expert, expert bias, MTP's MoE block
    "ep2-allgather": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2", "model.moe.dispatcher=allgather"]),
    "ep2-recompute": (
        "qwen3-moe-tiny",
        [*FP32, "parallel.ep=2", "parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe]"],
    ),
    "ep2-fp8-rowwise": (
        "qwen3-moe-tiny",
        ["train.micro_batch_size=1", "train.precision=fp8", "train.fp8.recipe=rowwise", "parallel.ep=2"],
    ),
}
LAYOUTS_4 = {
    "ep2-tp2-sp": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ep4-hierarchical": (
        "qwen3-moe-tiny",
        [*FP32, "parallel.ep=4", "launch.nodes=2", "model.moe.dispatcher=hierarchical"],
    ),
    "ep2-edp2": ("qwen3-moe-tiny", [*FP32, "parallel.ep=2"]),  # FSDP2 over the experts' edp too
}


def _run_layouts(tmp_path: Path, world: int, layouts: dict) -> None:
    cases = []
    for name, (recipe, overrides) in layouts.items():
        cases.append(case(f"{name}-plain", recipe, overrides))
        cases.append(case(f"{name}-overlap", recipe, [*overrides, OVERLAP]))
    saved = run_ranks(
        "train_layouts", world, {"cases": cases, "run_root": str(tmp_path / f"w{world}")}, tmp_path, timeout=400
    )
    for name in layouts:
        plain = torch.load(saved[f"{name}-plain"], weights_only=True)
        overlapped = torch.load(saved[f"{name}-overlap"], weights_only=True)
        assert_same_run(overlapped, plain, **EXACT)


@pytest.mark.slow
def test_overlapped_pairs_equal_the_plain_step_on_two_ranks(tmp_path: Path) -> None:
    _run_layouts(tmp_path, 2, LAYOUTS_2)


@pytest.mark.slow
def test_overlapped_pairs_equal_the_plain_step_on_four_ranks(tmp_path: Path) -> None:
    _run_layouts(tmp_path, 4, LAYOUTS_4)
