"""Stopping and resuming must not change training: N steps straight == N/2 + resume + N/2, bit for bit in fp32.

DeepSeek-V3 adds what lives outside the optimizer: the expert-bias buffers (updated after each step) and MTP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import shrink, train_losses

from moe_train.checkpoint.layout import latest_checkpoint
from moe_train.config import load_recipe
from moe_train.train.loop import Trainer

STEPS = 6

# Shrunk for speed; everything that matters to resume (MoE routing, aux loss, accumulation) is kept.
# Two warm-up steps: the resumed half (from step STEPS // 2) runs on the decaying schedule.
SHRINK = shrink("train.warmup_steps=2", f"train.steps={STEPS}")


def recipe(name: str, run_dir: Path, *extra: str):
    return load_recipe(name, [*SHRINK, f"run_dir={run_dir}", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_resume_is_bitwise_identical(name: str, tmp_path: Path) -> None:
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight = Trainer(recipe(name, straight_dir))
    summary = straight.train()
    assert summary.status == "complete" and summary.step == STEPS

    first = Trainer(recipe(name, split_dir, f"train.exit_at_step={STEPS // 2}")).train()
    assert first.status == "exited" and first.step == STEPS // 2
    assert latest_checkpoint(split_dir / "checkpoints").name == f"step-{STEPS // 2:07d}"
    assert not (split_dir / "COMPLETE").exists()

    resumed = Trainer(recipe(name, split_dir, "checkpoint.resume=required"))
    assert resumed.progress.step == STEPS // 2
    assert resumed.progress.consumed_samples == STEPS // 2 * 4
    second = resumed.train()
    assert second.status == "complete" and second.steps_run == STEPS - STEPS // 2
    assert (split_dir / "COMPLETE").exists()

    expected = train_losses(straight_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert train_losses(split_dir) == expected  # exact float equality, loss by loss
    assert expected[STEPS] < expected[1]  # it trained
    straight_sd, resumed_sd = straight.chunks[0].state_dict(), resumed.chunks[0].state_dict()
    for (key, a), b in zip(straight_sd.items(), resumed_sd.values(), strict=True):
        assert torch.equal(a, b), key


def test_a_stop_before_the_first_step_saves_step_0_and_resumes_as_if_uninterrupted(tmp_path: Path) -> None:
    """A notice during start-up: the job stops at step 0 and still saves (its requeued job resumes with
    `resume: required`). The optimizer has not stepped, so none of its state is saved or restored: creating it
    would count a step and change the first real update's bias correction."""
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    Trainer(recipe("qwen3-moe-tiny", straight_dir, "train.steps=2")).train()
    stopped = Trainer(recipe("qwen3-moe-tiny", split_dir, "train.steps=2"))
    split_dir.mkdir()
    (split_dir / "PREEMPT").write_text("preempt")
    summary = stopped.train()
    assert summary.status == "preempted" and summary.step == 0 and summary.checkpoint.name == "step-0000000"
    assert not stopped.optimizers[0].state
    (split_dir / "PREEMPT").unlink()
    resumed = Trainer(recipe("qwen3-moe-tiny", split_dir, "train.steps=2", "checkpoint.resume=required"))
    assert resumed.started_from == summary.checkpoint and not resumed.optimizers[0].state
    resumed.train()
    assert train_losses(split_dir) == train_losses(straight_dir)
