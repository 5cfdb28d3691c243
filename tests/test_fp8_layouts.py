"""FP8 under the parallel layouts against the single-process fp8 run of the same recipe (issue 22).

One 2-rank gloo job (tests/workers/train_layouts.py) trains qwen3-moe-tiny in fp8 tensorwise at TP2 with sequence
parallelism, EP2 and FSDP2 DP2, and a DP2 run stopped and resumed (with bf16 Adam moments too). fp8 quantises each
GEMM operand with scales taken over what the rank holds (a tensor-parallel shard's own amax, a micro-batch's own
tokens), so layouts are not bit-equal: the losses agree within 2e-2 relative. The fp8 GEMMs a TP2 rank runs are as
many as the single process runs (every GEMM of the model reaches the fp8 site on its shard: a module swap would
have been bypassed by the tensor-parallel styles), and the resumed run equals the uninterrupted one bit for bit.

FSDP2's fp8 all-gather (`train.fp8.fp8_all_gather`, models/fp8/all_gather.py) quantises each shard with the whole
weight's scale, so the gathered fp8 weight is the quantised gathered bf16 weight: DP2, TP2+SP, and DP2 with the
head in fp8 (chunked loss, per-step gathers) each equal the same layout without it bit for bit, HSDP (2 replicas)
the single process within the layout tolerance; the resumed pair runs with it (the checkpoint holds the plain
fp32 shards, and the resumed run gathers in fp8 again).

With `train.fp8.saved_inputs: fp8` (the GEMMs keep fp8 inputs for backward) TP2+SP equals the same layout
keeping bf16 inputs bit for bit: losses, first-step gradients, final parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import shrink
from multirank import run_ranks
from workers.record import record_run

# The layout tests' recipe in fp8 (tensorwise), 2 sequences a micro-batch, AdamW's own eps.
SHRINK = shrink("train.global_batch_size=8", "train.lr=1e-3", "train.min_lr=1e-4", "train.precision=fp8",
                "train.fp8.recipe=tensorwise")
STEPS = 3
GATHER = "train.fp8.fp8_all_gather=true"
HEAD = ["train.fp8.modules=[attention,mlp,shared_experts,experts,head]", "train.loss_chunk_tokens=16",
        "parallel.param_gather=per_step"]
LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.ep=2"],
    "dp2": [],
    "hsdp-fp8ag": ["parallel.dp_replicate=2", GATHER],
}
SAME_WITHOUT_GATHER = {  # fp8-gathered case: the case without the fp8 gather, bit for bit
    "dp2-fp8ag": ("dp2", [GATHER]),
    "tp2-sp-fp8ag": ("tp2-sp", [*LAYOUTS["tp2-sp"], GATHER]),
    "dp2-head-fp8ag": ("dp2-head", [*HEAD, GATHER]),
}
FP8_WEIGHTS = 2 * 4  # per rank: 2 layers' q, k, v, o (qwen3-moe's routed experts stay bf16 in the gather)
# also run keeping fp8 inputs: its row-parallel GEMMs and experts keep them in fp8, its column GEMMs bf16 shards
KEPT_FP8 = ("tp2-sp",)


@pytest.mark.slow
def test_fp8_layouts_equal_the_single_process_run(tmp_path: Path) -> None:
    layouts = {**LAYOUTS, "dp2-head": HEAD, **{key: sets for key, (_, sets) in SAME_WITHOUT_GATHER.items()}}
    cases = [{"id": key, "recipe": "qwen3-moe-tiny", "overrides": [*SHRINK, *sets], "steps": STEPS}
             for key, sets in layouts.items()]
    moments = [*SHRINK, "train.adam_moment_dtype=bf16", GATHER]  # bf16 moments: a checkpoint load casts to fp32
    cases += [{"id": f"{key}-fp8-kept", "recipe": "qwen3-moe-tiny", "steps": STEPS,
               "overrides": [*SHRINK, *LAYOUTS[key], "train.fp8.saved_inputs=fp8"]} for key in KEPT_FP8]
    cases += [{"id": "resumed", "recipe": "qwen3-moe-tiny", "overrides": moments, "steps": 4, "stop_at": 2},
              {"id": "straight", "recipe": "qwen3-moe-tiny", "overrides": moments, "steps": 4}]
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "fp8")}, tmp_path, timeout=480)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    want = record_run("qwen3-moe-tiny", SHRINK, world=1, run_dir=tmp_path / "ref", steps=STEPS)
    assert sum(want["fp8_gemms"].values()) > 0
    for key in LAYOUTS:
        assert records[key]["losses"] == pytest.approx(want["losses"], rel=2e-2), key
    assert records["tp2-sp"]["fp8_gemms"] == want["fp8_gemms"]  # on each rank: its shards, all its GEMMs
    assert all(sum(records[key]["fp8_gemms"].values()) > 0 for key in layouts)

    for key, (plain, _) in SAME_WITHOUT_GATHER.items():
        got, base = records[key], records[plain]
        assert got["fp8_gathering"] == {"gathered": FP8_WEIGHTS + ("head" in key), "not_plain": 0}, key
        assert base["fp8_gathering"]["gathered"] == 0, plain
        assert got["losses"] == base["losses"], key
        assert got["fp8_gemms"] == base["fp8_gemms"], key  # the gathered fp8 weights reach the same fp8 GEMMs
        for name, value in base["state"].items():
            assert torch.equal(got["state"][name], value), (key, name)
    head_gemms = records["dp2-head"]["fp8_gemms"]["linear/forward/real"] - records["dp2"]["fp8_gemms"][
        "linear/forward/real"]
    # 3 steps of 2 micro-batches x 64 tokens in chunks of 16: each chunk's logits forward and again in backward
    assert head_gemms == STEPS * 2 * 4 * 2
    assert records["hsdp-fp8ag"]["fp8_gathering"]["gathered"] == FP8_WEIGHTS

    for key in KEPT_FP8:
        kept, plain = records[f"{key}-fp8-kept"], records[key]
        assert kept["losses"] == plain["losses"], key
        for kind in ("grads", "state"):
            assert kept[kind].keys() == plain[kind].keys()
            assert [name for name, value in plain[kind].items() if not torch.equal(kept[kind][name], value)] == []

    resumed, straight = records["resumed"], records["straight"]
    assert resumed["started"] == 2
    assert resumed["fp8_gathering"] == straight["fp8_gathering"] == {"gathered": FP8_WEIGHTS, "not_plain": 0}
    for key, value in straight["state"].items():
        assert torch.equal(resumed["state"][key], value), key
