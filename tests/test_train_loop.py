"""The training loop: metrics.jsonl as docs/interfaces.md defines it, non-finite steps, the expert-bias update."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, trainer

from moe_train.checkpoint.layout import latest_checkpoint
from moe_train.config import RecipeError
from moe_train.train.errors import TrainingError
from moe_train.train.loop import Trainer

TRAIN_KEYS = {"kind", "step", "loss", "lm_loss", "aux_loss", "grad_norm", "lr", "tokens", "tokens_per_s",
              "tflops_per_device", "mfu", "memory_bytes", "skipped"}
BALANCE_KEYS = {"load_max_over_mean", "load_cv", "dropped_fraction", "load", "router_entropy", "tokens"}


def poison(t: Trainer, steps: set[int]) -> None:
    """Make the model's loss terms NaN during the given steps: a real non-finite loss and gradients."""

    def hook(module, args, output):
        if t.progress.step + 1 not in steps:
            return output
        return type(output)(*(term * float("nan") for term in output))

    t.chunks[0].register_forward_hook(hook)


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_metrics_jsonl_schema(name: str, tmp_path: Path) -> None:
    t = trainer(name, tmp_path, "train.steps=4", "train.eval_interval=2", "train.eval_steps=1")
    summary = t.train()
    lines = read_metrics(tmp_path)
    train = [r for r in lines if r["kind"] == "train"]
    evals = [r for r in lines if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [(r["step"], set(r)) for r in evals] == [(2, {"kind", "step", "loss"}), (4, {"kind", "step", "loss"})]
    moe = name == "qwen3-moe-tiny"
    for r in train:
        assert set(r) == TRAIN_KEYS | ({"moe", "moe_ranks"} if moe else set())
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["aux_loss"], rel=1e-12)
        assert r["tokens"] == r["step"] * 4 * 32
        assert r["skipped"] == 0 and r["grad_norm"] > 0 and r["memory_bytes"] > 0
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["tflops_per_device"] > 0
        if moe:
            assert r["aux_loss"] > 0
            assert set(r["moe"]) == {"0", "1"}
            for stats in r["moe"].values():
                assert set(stats) == BALANCE_KEYS and stats["load_max_over_mean"] >= 1.0
                assert sum(stats["load"]) == pytest.approx(1.0, abs=1e-5) and len(stats["load"]) == 8  # rounded shares
                assert 0 < stats["router_entropy"] <= math.log(8)
        else:
            assert r["aux_loss"] == 0.0
    assert train[0]["lr"] == pytest.approx(t.recipe.train.lr)  # warmup_steps=1: the peak at step 1
    assert summary.final_loss == train[-1]["loss"] and summary.first_loss == train[0]["loss"]
    assert (tmp_path / "COMPLETE").exists()


def test_deepseek_mtp_loss_and_expert_bias_update(tmp_path: Path) -> None:
    t = trainer("deepseek-v3-tiny", tmp_path, "train.steps=2")
    biases = {i: layer.router.expert_bias.clone() for i, layer in t.moe_layers.items()}
    assert biases, "deepseek-v3-tiny has MoE layers with an expert bias"
    t.train()
    for r in (r for r in read_metrics(tmp_path) if r["kind"] == "train"):
        assert r["mtp_loss"] > 0
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["aux_loss"] + r["mtp_loss"], rel=1e-12)
        assert set(r["moe"]) == {"1", "2"}  # layer 0 is dense (first_k_dense), 2 is the MTP block
    rate = t.recipe.model.moe.router.bias_update_rate
    for index, before in biases.items():
        moved = t.moe_layers[index].router.expert_bias - before
        assert moved.abs().max() > 0  # imbalanced routing moved the bias, by at most rate per step
        assert moved.abs().max() <= 2 * rate + 1e-9


def test_nonfinite_step_is_skipped_and_leaves_the_model_untouched(tmp_path: Path) -> None:
    t = trainer("qwen3-moe-tiny", tmp_path, "train.steps=2")
    poison(t, {1})
    before = {k: v.clone() for k, v in t.chunks[0].state_dict().items()}
    result = t.train_step(1)
    assert not result.finite
    for key, value in t.chunks[0].state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not t.optimizers[0].state  # Adam's moments never saw the poisoned gradients
    assert all(p.grad is None for p in t.chunks[0].parameters())


def test_skip_counts_and_continues(tmp_path: Path) -> None:
    t = trainer("qwen3-tiny", tmp_path, "train.steps=4", "train.max_skipped_steps=2")
    poison(t, {2, 3})
    summary = t.train()
    lines = {r["step"]: r for r in read_metrics(tmp_path) if r["kind"] == "train"}
    assert summary.status == "complete" and summary.step == 4
    assert [lines[s]["skipped"] for s in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert lines[2]["loss"] is None and lines[2]["grad_norm"] is None
    assert lines[4]["loss"] < lines[1]["loss"]  # steps 1 and 4 trained


def test_too_many_skips_stop_without_checkpointing(tmp_path: Path) -> None:
    t = trainer("qwen3-tiny", tmp_path, "train.steps=4", "train.max_skipped_steps=1", "checkpoint.interval=1")
    poison(t, {2, 3})
    with pytest.raises(TrainingError, match=r"rank 0: .*step 3: 2 steps skipped, over train.max_skipped_steps"):
        t.train()
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-0000002"  # clean: step 2 applied no update


def test_on_nonfinite_stop(tmp_path: Path) -> None:
    t = trainer("qwen3-tiny", tmp_path, "train.steps=4", "train.on_nonfinite=stop", "checkpoint.interval=1")
    poison(t, {2})
    with pytest.raises(TrainingError, match=r"rank 0: non-finite loss nan .* at step 2 \(train.on_nonfinite: stop\)"):
        t.train()
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-0000001"


def test_tensorboard_events_or_a_clear_error(tmp_path: Path) -> None:
    """Events when the tensorboard package is there; otherwise an input error naming the field, before training."""
    extra = ("train.steps=1", "logging.tensorboard=true")
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(RecipeError, match="logging.tensorboard: TensorBoard events need the tensorboard package"):
            trainer("qwen3-tiny", tmp_path, *extra)
        assert not (tmp_path / "metrics.jsonl").exists()
    else:
        trainer("qwen3-tiny", tmp_path, *extra).train()
        assert list(tmp_path.glob("events.out.tfevents.*"))


def test_bf16_autocast_keeps_fp32_master_weights(tmp_path: Path) -> None:
    t = trainer("qwen3-moe-tiny", tmp_path / "bf16", "train.steps=3", "train.precision=bf16")
    t.train()
    lines = [r for r in read_metrics(tmp_path / "bf16") if r["kind"] == "train"]
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert all(p.dtype == torch.float32 for p in t.chunks[0].parameters())
    assert all(v.dtype == torch.float32 for s in t.optimizers[0].state.values() for k, v in s.items() if k != "step")
    # The same first step in fp32: close, but not equal (the forward really ran in bf16).
    fp32 = trainer("qwen3-moe-tiny", tmp_path / "fp32", "train.steps=3").train_step(1)
    assert fp32.loss != lines[0]["loss"] and abs(fp32.loss - lines[0]["loss"]) < 0.02 * fp32.loss


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path: Path) -> None:
    """4 micro-batches of 1 accumulate to the same step as 1 micro-batch of 4: CE is averaged over all tokens."""
    steps, models = {}, {}
    for mbs in (1, 4):
        t = trainer("qwen3-tiny", tmp_path / str(mbs), "train.steps=2", f"train.micro_batch_size={mbs}")
        steps[mbs] = (t.train_step(1), t.train_step(2))
        models[mbs] = t.chunks[0].state_dict()
    for small, big in zip(steps[1], steps[4], strict=True):
        assert small.loss == pytest.approx(big.loss, rel=1e-6)
        assert small.grad_norm == pytest.approx(big.grad_norm, rel=1e-4)
    # And the parameters after both updates (lr 3e-3: a wrong accumulation moves weights by ~lr; fp32 order ~1e-5).
    for name, value in models[1].items():
        torch.testing.assert_close(value, models[4][name], rtol=0, atol=1e-4, msg=name)


def test_expert_counts_and_bias_do_not_depend_on_micro_batching(tmp_path: Path) -> None:
    """deepseek-v3-tiny (expert bias, seq_aux_loss, MTP): 4 micro-batches of 1 and 1 of 4 route the same tokens,
    so each step's per-expert loads, the bias after each update and the losses agree; the bias moves once per
    optimizer step (by at most bias_update_rate per expert), not once per micro-batch."""
    runs = {}
    for mbs in (1, 4):
        t = trainer("deepseek-v3-tiny", tmp_path / str(mbs), "train.steps=3", f"train.micro_batch_size={mbs}")
        steps, biases = [], []
        for step in (1, 2, 3):
            before = {i: layer.router.expert_bias.clone() for i, layer in t.moe_layers.items()}
            steps.append(t.train_step(step))
            biases.append({i: layer.router.expert_bias.clone() for i, layer in t.moe_layers.items()})
            rate = t.recipe.model.moe.router.bias_update_rate
            moved = [(bias - before[i]).abs().max().item() for i, bias in biases[-1].items()]
            assert 0 < max(moved) <= rate + 1e-9  # one update per optimizer step, not one per micro-batch
        runs[mbs] = (steps, biases)
    for small, big in zip(runs[1][0], runs[4][0], strict=True):
        assert small.loss == pytest.approx(big.loss, rel=1e-5)
        assert small.moe.keys() == big.moe.keys() == {"1", "2"}
        for layer in small.moe:
            assert small.moe[layer]["load"] == pytest.approx(big.moe[layer]["load"], abs=1e-6)
    for small, big in zip(runs[1][1], runs[4][1], strict=True):
        for i in small:
            assert torch.equal(small[i], big[i]), i
