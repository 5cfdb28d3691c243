"""Muon under every parallel layout equals the single-process run (fp32, 1e-5 relative after 4 steps), resumes
bit for bit and reshards on resume: the 2-rank cases in one job, the 4-rank ones (ETP folded onto tp, MLA,
QK-clip under dp x tp) in another (tests/workers/train_layouts.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SHRINK_LAYOUT, assert_same_run
from multirank import run_ranks
from workers.record import record_run

STEPS = 4
MUON = [*SHRINK_LAYOUT, "train.micro_batch_size=1", "train.precision=fp32", "train.optimizer=muon"]
SP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = {
    "dp2": ("qwen3-moe-tiny", []),  # FSDP2: every matrix gathered whole over dp
    "tp2-sp": ("qwen3-moe-tiny", SP2),  # column and row shards gathered over tp
    "ep2": ("qwen3-moe-tiny", ["parallel.ep=2"]),  # each rank's experts whole on it
    "pp2": ("qwen3-moe-tiny", ["parallel.pp=2"]),  # per stage
}


def _case(case_id: str, recipe: str, overrides: list[str], **extra) -> dict:
    return {"id": case_id, "recipe": recipe, "overrides": [*MUON, *overrides], "steps": STEPS, **extra}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_muon_layouts_equal_single_process_and_resume(tmp_path: Path) -> None:
    cases = [_case(name, recipe, overrides) for name, (recipe, overrides) in LAYOUTS.items()]
    cases.append(_case("dp2-resumed", "qwen3-moe-tiny", [], stop_at=2))
    # two steps at DP2 (matrices sharded over dp), two more at TP2+SP (sharded over tp): DCP reshards the momentum
    cases.append(_case("dp2-to-tp2", "qwen3-moe-tiny", [], stop_at=2, resume_overrides=SP2))
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "muon2")}, tmp_path, timeout=1100)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    want = {"qwen3-moe-tiny": record_run("qwen3-moe-tiny", MUON, world=1, run_dir=tmp_path / "ref", steps=STEPS)}
    for name, (recipe, _) in LAYOUTS.items():
        assert_same_run(records[name], want[recipe], loss=1e-5, rtol=1e-5, atol=1e-6)

    resumed, straight = records["dp2-resumed"], records["dp2"]
    assert resumed["started"] == 2
    for key, value in straight["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    logged = [json.loads(line) for line in (tmp_path / "muon2" / "dp2-resumed" / "metrics.jsonl").open()]
    assert [r["loss"] for r in logged if r["kind"] == "train"] == straight["losses"]

    resharded = records["dp2-to-tp2"]
    assert resharded["started"] == 2
    for key, value in want["qwen3-moe-tiny"]["state"].items():
        torch.testing.assert_close(
            resharded["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
        )


# 4 ranks, dp2 x tp2: the experts folded as ep2 x etp2 (each expert's matrices gathered over etp, its experts
# whole on their ep rank); MLA (deepseek-v3-tiny: q/kv up projections sharded by heads, the latent projections
# replicated, MTP); QK-clip on GQA and MLA, where the maxima are all-reduced over dp and gathered over tp
DP2_TP2 = ["parallel.tp=2"]
CLIPPED = {"qwen3-moe-tiny": ["model.qk_norm=false", "train.muon.qk_clip=0.2"],  # thresholds about the heads'
           "deepseek-v3-tiny": ["train.muon.qk_clip=0.12"]}  # median max logit: some clipped, some not
FOLDED = {
    "ep2-etp2": ("qwen3-moe-tiny", [*DP2_TP2, "parallel.ep=2", "parallel.etp=2", "model.moe.dispatcher=allgather"]),
    "mla-tp2-sp": ("deepseek-v3-tiny", [*DP2_TP2, "parallel.sequence_parallel=true"]),
    "qk-clip-gqa": ("qwen3-moe-tiny", [*DP2_TP2, *CLIPPED["qwen3-moe-tiny"]]),
    "qk-clip-mla": ("deepseek-v3-tiny", [*DP2_TP2, *CLIPPED["deepseek-v3-tiny"]]),
}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_muon_folded_experts_mla_and_qk_clip_equal_single_process(tmp_path: Path) -> None:
    cases = [_case(name, recipe, overrides) for name, (recipe, overrides) in FOLDED.items()]
    saved = run_ranks("train_layouts", 4, {"cases": cases, "run_root": str(tmp_path / "muon4")}, tmp_path, timeout=1100)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}

    def single(recipe: str, extra: list[str], tag: str) -> dict:
        return record_run(recipe, [*MUON, *extra], world=1, run_dir=tmp_path / f"ref-{tag}", steps=STEPS)

    want = {"ep2-etp2": single("qwen3-moe-tiny", [], "qwen"), "mla-tp2-sp": single("deepseek-v3-tiny", [], "mla")}
    unclipped = {"qk-clip-gqa": single("qwen3-moe-tiny", ["model.qk_norm=false"], "gqa"),
                 "qk-clip-mla": want["mla-tp2-sp"]}
    for name, recipe in (("qk-clip-gqa", "qwen3-moe-tiny"), ("qk-clip-mla", "deepseek-v3-tiny")):
        want[name] = single(recipe, CLIPPED[recipe], name)
        # the clip acted: the same run without it ends elsewhere, so the equality below holds the clipped heads'
        # scaling to the single process's, not a no-op
        assert any(not torch.allclose(unclipped[name]["state"][k], v, rtol=1e-3, atol=1e-6)
                   for k, v in want[name]["state"].items()), name
    for name in FOLDED:
        assert_same_run(records[name], want[name], loss=1e-5, rtol=1e-5, atol=1e-6)
