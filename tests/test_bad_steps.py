"""Loss spikes (train.loss_spike_threshold): rejected before any update, skipped and counted or stopped per
train.on_loss_spike; the window of recent losses survives a resume. Non-finite steps: tests/test_train_loop.py,
and one rank's NaN on 4 ranks: tests/test_resilience.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SHRINK, read_metrics, train_losses, trainer

from moe_train.checkpoint.layout import latest_checkpoint
from moe_train.config import RecipeError, load_recipe
from moe_train.train.bad_steps import BadSteps
from moe_train.train.errors import TrainingError
from moe_train.train.loop import Trainer

SPIKE = ["train.loss_spike_threshold=3", "train.loss_spike_window=2"]


def spike(t: Trainer, step: int, factor: float = 10.0) -> None:
    """Scale the model's summed token loss (and so its gradients) by `factor` during `step`: what a bad batch
    does to the loss, through the trainer's real forward, loss and detection."""

    def hook(module, args, output):
        if t.progress.step + 1 != step:
            return output
        return type(output)(output.lm_sum * factor, output.mtp)

    t.chunks[0].register_forward_hook(hook)


def test_the_window_judges_against_applied_steps_only() -> None:
    train = load_recipe("qwen3-tiny", [*SHRINK, "train.steps=9", *SPIKE]).train
    guard = BadSteps(train)
    assert guard.admit(loss=100.0, grad_norm=1.0) is None  # the window is not full yet: no judgement
    assert guard.admit(loss=2.0, grad_norm=1.0) is None
    assert guard.admit(loss=2.0, grad_norm=1.0) is None  # mean of (100, 2) is 51
    rejected = guard.admit(loss=6.5, grad_norm=1.0)  # over 3 x mean(2, 2)
    assert rejected.kind == "loss_spike" and "6.5 is over 3 x 2" in rejected.reason
    assert guard.recent_losses == (2.0, 2.0)  # a rejected loss never joins the window
    assert guard.admit(loss=5.9, grad_norm=1.0) is None and guard.recent_losses == (2.0, 5.9)
    assert guard.admit(loss=1.0, grad_norm=float("nan")).kind == "nonfinite"
    assert BadSteps(train, recent_losses=(9.0, 1.0, 2.0)).recent_losses == (1.0, 2.0)  # the newest `window`
    off = BadSteps(load_recipe("qwen3-tiny", [*SHRINK, "train.steps=9"]).train, recent_losses=(1.0,) * 20)
    assert off.admit(loss=1e9, grad_norm=1.0) is None


def test_a_spike_is_skipped_and_counted_and_applies_nothing(tmp_path: Path) -> None:
    t = trainer("qwen3-tiny", tmp_path, "train.steps=5", *SPIKE)
    spike(t, 4)
    states = {}

    def keep(optimizer, args, kwargs) -> None:  # after step N's update: what step N+1 starts from
        states[t.progress.step] = {k: v.clone() for k, v in t.chunks[0].state_dict().items()}

    t.optimizers[0].register_step_post_hook(keep)
    summary = t.train()
    lines = {r["step"]: r for r in read_metrics(tmp_path, "train")}
    assert summary.status == "complete" and [lines[s]["skipped"] for s in range(1, 6)] == [0, 0, 0, 1, 1]
    assert lines[4]["loss"] > 3 * (lines[2]["loss"] + lines[3]["loss"]) / 2  # logged as it was: finite
    assert sorted(states) == [0, 1, 2, 4]  # the optimizer stepped at steps 1, 2, 3 and 5, never at step 4
    assert lines[5]["loss"] < lines[3]["loss"] * 1.5  # step 5 trained on from step 3's model


@pytest.mark.slow
def test_on_loss_spike_stop_raises_without_checkpointing_the_spike(tmp_path: Path) -> None:
    t = trainer("qwen3-tiny", tmp_path, "train.steps=5", *SPIKE, "train.on_loss_spike=stop", "checkpoint.interval=1")
    spike(t, 4)
    with pytest.raises(TrainingError, match=r"rank 0: loss spike: .* at step 4 \(train.on_loss_spike: stop\)"):
        t.train()
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-0000003"


def test_the_window_is_checkpointed_so_a_resumed_run_judges_the_same(tmp_path: Path) -> None:
    straight = trainer("qwen3-tiny", tmp_path / "straight", "train.steps=4", *SPIKE)
    straight.train()
    trainer("qwen3-tiny", tmp_path / "split", "train.steps=4", *SPIKE, "train.exit_at_step=3").train()
    resumed = trainer("qwen3-tiny", tmp_path / "split", "train.steps=4", *SPIKE, "checkpoint.resume=required")
    assert len(resumed.progress.recent_losses) == 2
    assert resumed.bad_steps.recent_losses == tuple(train_losses(tmp_path / "straight")[s] for s in (2, 3))
    resumed.train()
    assert resumed.progress == straight.progress


def test_spike_fields_are_validated() -> None:
    with pytest.raises(RecipeError, match="train.loss_spike_threshold"):
        load_recipe("qwen3-tiny", ["train.loss_spike_threshold=0.5"])
    with pytest.raises(RecipeError, match="train.on_loss_spike"):
        load_recipe("qwen3-tiny", ["train.on_loss_spike=ignore"])
