"""Muon under every parallel layout equals the single-process run (fp32, 1e-5 relative after 4 steps), resumes
bit for bit and reshards on resume: every case in one 2-rank job (tests/workers/train_layouts.py)."""

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
