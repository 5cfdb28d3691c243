"""Activation offloading (`parallel.offload`) on multi-rank layouts: each layout trains with and without
offloading in one two-rank gloo job (tests/workers/train_layouts.py, every case in the one job), and the two are
held equal bit for bit: the loss of every step, every gradient of step 1, every parameter and buffer after the
last step. Offloading copies a layer's saves out and back byte for byte and changes no computation, so any
difference is a save that came back wrong (another micro-batch's, a stale prefetch, a shard of another rank).

The layouts: PP2 under 1F1B (two micro-batches in flight on stage 0) and interleaved 1F1B (two chunks, each its
own pool), TP2 with sequence parallelism (DTensor saves), EP2 (dispatched rows, all-to-all), FSDP2 at DP2 (the
gathered weights are parameters and never copied) with recompute of other regions beside. tests/test_offload.py
holds every region name in one process; tests/test_plan_measure.py the bytes the plan says move.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, case
from multirank import run_ranks

EXACT = {"loss": 0.0, "rtol": 0.0, "atol": 0.0, "balance_rel": 0.0}
PP = ["train.micro_batch_size=1", "train.precision=fp32"]
# (id, recipe, layout and model overrides, regions offloaded)
LAYOUTS = [
    ("pp2-1f1b", "qwen3-moe-tiny", ["parallel.pp=2", *PP], "moe_act,core_attn,layernorm"),
    ("pp2-interleaved", "qwen3-tiny",
     ["model.num_layers=4", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b", *PP],
     "mlp,core_attn"),
    ("tp2-sp", "deepseek-v3-tiny",
     ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2", "train.precision=fp32"],
     "mla_up_proj,moe,mlp"),
    ("ep2", "qwen3-moe-tiny", ["parallel.ep=2", "train.micro_batch_size=1", "train.precision=fp32"], "moe"),
    ("fsdp2-recompute", "deepseek-v3-tiny",
     ["train.micro_batch_size=2", "train.precision=bf16", "parallel.recompute.granularity=selective",
      "parallel.recompute.modules=[moe_act,layernorm]"], "core_attn,shared_experts,mlp"),
]
STEPS = 2


@pytest.mark.slow
def test_offloading_equals_the_plain_step_on_every_layout(tmp_path: Path) -> None:
    cases = []
    for case_id, recipe, overrides, regions in LAYOUTS:
        cases.append(case(f"{case_id}-plain", recipe, overrides, steps=STEPS))
        cases.append(case(f"{case_id}-offload", recipe, [*overrides, f"parallel.offload.modules=[{regions}]"],
                          steps=STEPS))
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "offload")}, tmp_path,
                      timeout=420)
    for case_id, *_ in LAYOUTS:
        got, want = (torch.load(saved[f"{case_id}-{kind}"], weights_only=True) for kind in ("offload", "plain"))
        assert got["grads"], case_id
        assert_same_run(got, want, **EXACT)
