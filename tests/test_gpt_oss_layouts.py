"""gpt-oss (gpt-oss-tiny) under the layouts built for it against the single-process run of the same recipe.

One 2-rank gloo job (tests/workers/train_layouts.py) trains the family's tiny recipe, cut to 4 layers (two
sliding-window and two full-attention layers), under TP2 with and without sequence parallelism (the sinks sharded
with the heads, o_proj's bias added once after the reduce), PP2 (two layers a stage), EP2 (the experts and their
gate/up/down biases sharded over the two ranks), DP2 (FSDP2 over the sinks, the q/k/v/o biases and the router bias)
and CP2 over the ring and over the all-gather (the sinks once in each query's normaliser, the 32-token windows by
global position over 32-token chunks, whole blocks outside them skipped); each is held to the single process as
every layout test is (helpers.assert_same_run): the loss of every step, every gradient of step 1 (the sinks' and
every bias's among them), every parameter and buffer after the last step, the expert balance figures of every step.
The biases start at 0 (models/init.py) and move at step 1, so steps 2 and 3 run each layout's sharded bias adds on
values that differ per element. ETP is refused for gpt_oss by validate (tests/test_config_errors.py), not built.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import GPT_OSS_LAYOUT, assert_same_run, case, reference
from multirank import run_ranks

# GPT_OSS_LAYOUT: four layers (sliding, full, sliding, full); fp32 micro-batches of 2 (2 per rank at dp 2, 4 at
# dp 1).
# The family's all_layers_aux_loss is refused with tp, pp or cp > 1 (its token set is the whole micro-batch's):
# those cases and their reference take the per-layer aux_loss instead.
PER_LAYER = ["model.moe.router.load_balancing=aux_loss"]
LAYOUTS = {
    "tp2-sp": [*PER_LAYER, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2": [*PER_LAYER, "parallel.tp=2"],
    "ep2": ["parallel.ep=2"],
    "pp2": [*PER_LAYER, "parallel.pp=2"],
    "dp2": [],
    # the sinks' logit in each query's normaliser once, the windows by global position (whole blocks outside them
    # skipped: 32-token windows over 32-token chunks), over the ring and the all-gather
    "cp2-p2p": [*PER_LAYER, "parallel.cp=2", "parallel.cp_comm=p2p"],
    "cp2-allgather": [*PER_LAYER, "parallel.cp=2", "parallel.cp_comm=allgather"],
    # expert TP: gate/up and their biases by columns, down by rows, its bias added by etp rank 0 only
    "etp2": ["parallel.etp=2", "model.moe.dispatcher=allgather"],
}


@pytest.mark.slow
def test_gpt_oss_layouts_equal_single_process(tmp_path: Path) -> None:
    cases = [case(f"gptoss-{name}", "gpt-oss-tiny", [*GPT_OSS_LAYOUT, *layout]) for name, layout in LAYOUTS.items()]
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "gptoss2")}, tmp_path,
                      timeout=300)
    references = {}
    for name, layout in LAYOUTS.items():
        key = "per-layer" if PER_LAYER[0] in layout else "all-layers"
        if key not in references:
            loss = PER_LAYER if key == "per-layer" else []
            references[key] = reference(tmp_path / key, "gpt-oss-tiny", [*GPT_OSS_LAYOUT, *loss])
            for suffix in ("self_attn.sinks", "o_proj.bias", "router.bias", "experts.down_proj_bias"):
                assert any(n.endswith(suffix) for n in references[key]["grads"]), suffix  # among what is compared
        assert_same_run(torch.load(saved[f"gptoss-{name}"], weights_only=True), references[key])
