"""GLM-4.5 (glm4-moe-tiny) under every parallel layout kind against the single-process run of the same recipe.

One 2-rank gloo job (tests/workers/train_layouts.py) trains the family's tiny recipe, cut to 4 layers (a dense
first layer, three MoE layers, the MTP module), under TP2 + SP, EP2, PP2 (the embedding and the dense layer on
stage 0, the MoE layers, MTP and the loss on stage 1) and CP2; each is held to the single process as every
layout test is (helpers.assert_same_run): the loss of every step, every gradient of step 1 (the q/k/v biases,
column-sharded under TP, among them), every parameter and buffer after the last step (the expert bias too), the
expert balance figures of every step. The biases start at 0 (models/init.py) and move at step 1, so steps 2 and
3 run every layout's sharded bias adds on values that differ per element.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, case, reference
from multirank import run_ranks

# Four layers; fp32 micro-batches of 2 (2 per rank at dp 2, 4 at dp 1). Adam eps 1e-5 for every case and the
# reference: TP sums a gradient's per-head parts in another order (test_tensor_parallel.py explains the eps).
GLM = ["model.num_layers=4", "train.micro_batch_size=2", "train.precision=fp32", "train.adam_eps=1e-5"]
LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.ep=2"],
    "pp2": ["parallel.pp=2", "parallel.pp_layout=Et|tttmL"],
    "cp2": ["parallel.cp=2"],
}


@pytest.mark.slow
def test_glm4_moe_layouts_equal_single_process(tmp_path: Path) -> None:
    cases = [case(f"glm-{name}", "glm4-moe-tiny", [*GLM, *layout]) for name, layout in LAYOUTS.items()]
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "glm2")}, tmp_path,
                      timeout=400)
    want = reference(tmp_path, "glm4-moe-tiny", GLM)
    assert any(name.endswith("q_proj.bias") for name in want["grads"])  # the biases are among what is compared
    for name in LAYOUTS:
        assert_same_run(torch.load(saved[f"glm-{name}"], weights_only=True), want)
