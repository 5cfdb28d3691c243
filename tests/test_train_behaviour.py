"""What the trainer does to its state, checked against hand computations rather than the functions it calls.

The optimizer's step is observed through torch's public step hooks: the pre-hook sees the gradients and the
learning rate AdamW is about to use, the post-hook sees the parameters it produced. A hand-written AdamW
replays those gradients with the schedule's values written out by hand, so removing the schedule, the clip, the
weight-decay split or the update itself makes these tests fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import shrink, trainer

from moe_train.config import TrainConfig, load_recipe
from moe_train.data import global_batch
from moe_train.models.moe import update_expert_bias
from moe_train.train.loop import Trainer
from moe_train.train.optimizer import build_optimizer, param_groups
from moe_train.train.schedule import lr_at

# 16-token sequences (the expert-load figures count a batch's 4 x 16 tokens) and the recipe's own warm-up
# (a test that needs another sets it).
SHORT = shrink("train.seq_length=16", without=("train.warmup_steps",))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter or gradient, sharded (DTensor) or not, as an fp64 copy."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().to(torch.float64).clone()


@dataclass
class StepRecord:
    lrs: list[float]
    before: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    after: list[torch.Tensor] = field(default_factory=list)


def watch_optimizer(t: Trainer) -> list[StepRecord]:
    """Record, for every optimizer step, the groups' learning rates, the gradients and the parameters around it."""
    records: list[StepRecord] = []
    params = [p for group in t.optimizers[0].param_groups for p in group["params"]]

    def pre(optimizer, args, kwargs):
        records.append(StepRecord(
            lrs=[group["lr"] for group in optimizer.param_groups],
            before=[whole(p) for p in params],
            grads=[None if p.grad is None else whole(p.grad) for p in params],
        ))

    def post(optimizer, args, kwargs):
        records[-1].after = [whole(p) for p in params]

    t.optimizers[0].register_step_pre_hook(pre)
    t.optimizers[0].register_step_post_hook(post)
    return records


def hand_adamw(t: Trainer, records: list[StepRecord], lrs: list[float]) -> None:
    """Replay AdamW (decoupled decay on >= 2-D parameters only) and compare with what the optimizer produced."""
    train = t.recipe.train
    b1, b2, eps = train.adam_beta1, train.adam_beta2, train.adam_eps
    params = [p for group in t.optimizers[0].param_groups for p in group["params"]]
    moments = [(torch.zeros_like(whole(p)), torch.zeros_like(whole(p))) for p in params]
    for step, (record, lr) in enumerate(zip(records, lrs, strict=True), start=1):
        for i, p in enumerate(params):
            g, (m, v) = record.grads[i], moments[i]
            if g is None:
                continue
            decay = train.weight_decay if p.ndim >= 2 else 0.0
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            m_hat, v_hat = m / (1 - b1**step), v / (1 - b2**step)
            expected = record.before[i] * (1 - lr * decay) - lr * m_hat / (v_hat.sqrt() + eps)
            torch.testing.assert_close(record.after[i], expected, rtol=0, atol=2e-7 + 1e-6 * lr,
                                       msg=lambda m, step=step, i=i: f"step {step}, parameter {i}: {m}")


# ------------------------------------------------------------------------------------------- learning rate


def test_schedule_reaches_adamw_step_by_step(tmp_path: Path) -> None:
    """Cosine with 2 warmup steps over 4: 5e-4, 1e-3, 1e-4 + 9e-4 * (1 + cos(pi/2)) / 2, 1e-4, worked out by hand."""
    t = trainer("qwen3-tiny", tmp_path, "train.steps=4", "train.warmup_steps=2", "train.lr=1e-3",
                "train.min_lr=1e-4", "train.lr_schedule=cosine", "train.weight_decay=0.1", "model.num_layers=1",
                "train.adam_eps=1e-3", "train.adam_beta1=0.8", "train.adam_beta2=0.9",  # none of them torch's default
                base=SHORT)
    records = watch_optimizer(t)
    assert all(t.train_step(step).finite for step in (1, 2, 3, 4))
    expected = [5e-4, 1e-3, 5.5e-4, 1e-4]
    assert len(records) == 4
    for record, lr in zip(records, expected, strict=True):
        assert record.lrs == pytest.approx([lr] * len(record.lrs), rel=1e-12)
    hand_adamw(t, records, expected)  # the rate really used: the parameters moved by exactly that much


def test_first_update_moves_each_weight_by_the_learning_rate(tmp_path: Path) -> None:
    """Adam's first step is lr * sign(g) (|g| >> eps): the rate is visible in the parameters themselves."""
    t = trainer("qwen3-tiny", tmp_path, "train.steps=4", "train.warmup_steps=4", "train.lr=2e-3",
                "train.weight_decay=0.0", "model.num_layers=1", base=SHORT)
    records = watch_optimizer(t)
    t.train_step(1)
    [record] = records
    moved = torch.cat([(a - b).abs().flatten() for a, b, g in zip(record.after, record.before, record.grads,
                                                                    strict=True) if g is not None])
    grads = torch.cat([g.abs().flatten() for g in record.grads if g is not None])
    clear = grads > 1e-5  # far above eps = 1e-8
    assert clear.float().mean() > 0.5
    torch.testing.assert_close(moved[clear], torch.full_like(moved[clear], 2e-3 / 4), rtol=0, atol=1e-6)


def test_schedule_edges_by_hand() -> None:
    """The shortest decays: one cosine step after warmup ends at min_lr; WSD's first and only decay steps."""
    def config(**fields) -> TrainConfig:
        return TrainConfig(**{"seq_length": 8, "global_batch_size": 1, "lr": 1.0, "min_lr": 0.1, **fields})

    cosine = config(steps=5, warmup_steps=4, lr_schedule="cosine")
    assert [lr_at(s, train=cosine) for s in (4, 5)] == pytest.approx([1.0, 0.1])
    wsd = config(steps=10, warmup_steps=0, lr_schedule="wsd", wsd_decay_fraction=0.1)  # one decay step
    assert [lr_at(s, train=wsd) for s in (8, 9, 10)] == pytest.approx([1.0, 1.0, 0.1])
    long = config(steps=100, warmup_steps=10, lr_schedule="wsd", wsd_decay_fraction=0.2)  # decays over 83..100
    assert [lr_at(s, train=long) for s in (82, 83, 84)] == pytest.approx([1.0, 1.0 - 0.9 / 18, 1.0 - 0.9 * 2 / 18])


def test_param_groups_skip_frozen_parameters_and_keep_the_rest() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    decayed, undecayed = param_groups(model, weight_decay=0.1)
    assert [id(p) for p in decayed["params"]] == [id(model[2].weight)]
    assert [id(p) for p in undecayed["params"]] == [id(p) for p in (model[0].bias, model[1].weight, model[1].bias,
                                                                     model[2].bias)]


def test_optimizer_refuses_low_precision_master_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"parameter 1.weight is torch.bfloat16: master weights must be fp32"):
        build_optimizer(model, train=load_recipe("qwen3-tiny").train)


# ---------------------------------------------------------------------------------------------- clipping


def test_clipping_binds_scales_gradients_and_logs_the_norm_before_clipping(tmp_path: Path) -> None:
    runs = {}
    for name, clip in (("none", "null"), ("loose", "1e9"), ("tight", "0.05")):
        t = trainer("qwen3-tiny", tmp_path / name, "train.steps=2", "train.warmup_steps=0", "train.lr=1e-3",
                    "train.lr_schedule=constant", "model.num_layers=1", f"train.grad_clip={clip}", base=SHORT)
        records = watch_optimizer(t)
        results = [t.train_step(step) for step in (1, 2)]
        runs[name] = (t, records, results)
    none_t, none_records, none_results = runs["none"]
    tight_t, tight_records, tight_results = runs["tight"]

    # The first step starts from the same model and batch: the raw gradient is the unclipped run's.
    raw = [g for g in none_records[0].grads if g is not None]
    norm = math.sqrt(sum(float(g.square().sum()) for g in raw))
    assert none_results[0].grad_norm == pytest.approx(norm, rel=1e-5)
    assert tight_results[0].grad_norm == pytest.approx(norm, rel=1e-5)  # logged before clipping
    assert norm > 0.05 * 4  # the clip binds by a clear margin
    clipped = [g for g in tight_records[0].grads if g is not None]
    for r, c in zip(raw, clipped, strict=True):
        torch.testing.assert_close(c, r * (0.05 / norm), rtol=1e-4, atol=1e-12)
    clipped_norm = math.sqrt(sum(float(g.square().sum()) for g in clipped))
    assert clipped_norm == pytest.approx(0.05, rel=1e-4)

    # The update is AdamW of the clipped gradient, and it changes training (the clip ratio differs per step).
    hand_adamw(tight_t, tight_records, [1e-3] * 2)
    drift = max((a - b).abs().max().item() for a, b in zip(tight_records[-1].after, none_records[-1].after,
                                                           strict=True))
    assert drift > 1e-5
    assert [r.loss for r in tight_results][:1] == [r.loss for r in none_results][:1]
    assert tight_results[1].loss != none_results[1].loss

    # A clip that does not bind changes nothing, bit for bit.
    _, loose_records, loose_results = runs["loose"]
    assert [(r.loss, r.grad_norm) for r in loose_results] == [(r.loss, r.grad_norm) for r in none_results]
    for a, b in zip(loose_records[-1].after, none_records[-1].after, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------- non-finite steps


def test_a_skipped_step_leaves_every_piece_of_state_unchanged(tmp_path: Path) -> None:
    """deepseek-v3-tiny: weights, expert biases (buffers), Adam's moments and step counts, learning rates."""
    t = trainer("deepseek-v3-tiny", tmp_path, "train.steps=3", "train.warmup_steps=2", base=SHORT)
    assert any(layer.router.expert_bias is not None for layer in t.moe_layers.values())
    assert t.train_step(1).finite  # Adam has state and the bias has moved once
    poisoned = {"on": True}

    def poison(module, args, out):  # the forward's loss terms (or logits) made NaN: a real non-finite step
        if not poisoned["on"]:
            return out
        return type(out)(*(term * float("nan") for term in out)) if isinstance(out, tuple) else out * float("nan")

    t.chunks[0].register_forward_hook(poison)
    model_before = {k: whole(v) for k, v in t.chunks[0].state_dict().items()}
    optimizer_before = t.optimizers[0].state_dict()
    moments_before = {i: {k: whole(v) for k, v in s.items()} for i, s in optimizer_before["state"].items()}
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in optimizer_before["param_groups"]]

    result = t.train_step(2)
    assert not result.finite and math.isnan(result.loss)
    for key, value in t.chunks[0].state_dict().items():
        assert torch.equal(whole(value), model_before[key]), key
    after = t.optimizers[0].state_dict()
    assert [{k: v for k, v in g.items() if k != "params"} for g in after["param_groups"]] == groups_before
    assert after["state"].keys() == moments_before.keys()
    for index, state in after["state"].items():
        for key, value in state.items():
            assert torch.equal(whole(value), moments_before[index][key]), (index, key)
    assert all(p.grad is None for p in t.chunks[0].parameters())

    poisoned["on"] = False  # the same step again, finite this time, does train
    assert t.train_step(2).finite
    assert any(not torch.equal(whole(v), model_before[k]) for k, v in t.chunks[0].state_dict().items())


# ----------------------------------------------------------------------------------------------- expert bias


def test_expert_bias_moves_against_the_measured_load_by_the_rate(tmp_path: Path) -> None:
    """Loads counted here from the routers' top-k (every micro-batch of the step); bias += rate * sign(mean - load)."""
    rate = 0.01
    t = trainer("deepseek-v3-tiny", tmp_path, "train.steps=2", f"model.moe.router.bias_update_rate={rate}", base=SHORT)
    loads: dict[int, torch.Tensor] = {}

    def counter(index: int, num_experts: int):
        def hook(module, args, routing):
            counts = torch.bincount(routing.topk_indices.flatten(), minlength=num_experts)
            loads[index] = loads.get(index, torch.zeros(num_experts, dtype=torch.int64)) + counts
        return hook

    for index, layer in t.moe_layers.items():
        layer.router.register_forward_hook(counter(index, layer.cfg.num_experts))
    before = {i: layer.router.expert_bias.detach().clone() for i, layer in t.moe_layers.items()}
    assert t.train_step(1).finite
    assert set(loads) == set(before) and len(loads) >= 2
    tokens = 4 * 16 * t.recipe.model.moe.top_k  # every token of the global batch, top_k assignments each
    for index, load in loads.items():
        assert int(load.sum()) == tokens
        moved = t.moe_layers[index].router.expert_bias.detach() - before[index]
        mean = load.double().mean()
        expected = torch.tensor([rate if n < mean else -rate if n > mean else 0.0 for n in load.double()])
        assert not torch.all(expected == 0)
        torch.testing.assert_close(moved.double(), expected.double(), rtol=0, atol=1e-7)


def test_expert_counts_and_bias_agree_with_recompute_and_micro_batches(tmp_path: Path) -> None:
    """Each step's expert counts and the expert bias they move are the same with recomputation off, selective
    (the MoE layer rerun) and full, and with 1, 2 or 4 micro-batches per step: a recompute rerun counts nothing
    (the layer reads in_recomputation), every micro-batch counts once, and the routing weights now travelling with
    the rows change neither."""
    variants = {"none": [], "moe": ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe]"],
                "full": ["parallel.recompute.granularity=full"], "one-micro-batch": ["train.micro_batch_size=4"],
                "four-micro-batches": ["train.micro_batch_size=1"]}
    seen = {}
    for key, sets in variants.items():
        t = trainer("deepseek-v3-tiny", tmp_path / key, "train.steps=2", *sets, base=SHORT)
        steps = []
        for step in (1, 2):
            assert t.train_step(step).finite
            steps.append({i: (layer.tokens_per_expert.clone(), layer.router.expert_bias.detach().clone())
                          for i, layer in t.moe_layers.items()})
        seen[key] = steps
    tokens = 4 * 16 * load_recipe("deepseek-v3-tiny", SHORT).model.moe.top_k  # the global batch's assignments
    for key, steps in seen.items():
        for step, layers in enumerate(steps):
            for index, (counts, bias) in layers.items():
                assert int(counts.sum()) == tokens, (key, step, index)
                want_counts, want_bias = seen["none"][step][index]
                assert torch.equal(counts, want_counts), (key, step, index)
                assert torch.equal(bias, want_bias), (key, step, index)


def test_update_expert_bias_direction_and_amount_by_hand() -> None:
    bias = torch.zeros(5)
    update_expert_bias(bias, torch.tensor([9, 1, 5, 5, 5]), 0.5)  # mean 5: 0 over, 1 under, the rest at the mean
    assert bias.tolist() == [-0.5, 0.5, 0.0, 0.0, 0.0]
    update_expert_bias(bias, torch.tensor([0, 0, 0, 0, 10]), 0.25)  # mean 2
    assert bias.tolist() == [-0.25, 0.75, 0.25, 0.25, -0.25]


# ------------------------------------------------------------------------------------------------ evaluation


def test_evaluate_is_the_mean_token_loss_of_the_validation_batches(tmp_path: Path) -> None:
    """Two validation global batches of 4, in micro-batches of 1: the mean cross-entropy over their 128 tokens."""
    t = trainer("qwen3-moe-tiny", tmp_path, "train.steps=2", "train.eval_steps=2", "train.micro_batch_size=1",
                "data.reset_at_eod=false", base=SHORT)
    assert t.train_step(1).finite  # a trained model, not the initial one
    value = t.evaluate()
    assert t.chunks[0].training  # evaluation gives the model back in training mode

    samples = torch.stack([torch.as_tensor(t.datasets.valid.sample(i), dtype=torch.int64) for i in range(8)])
    assert torch.equal(samples[:4], global_batch(t.datasets.valid, step=0, global_batch_size=4))
    t.chunks[0].eval()
    with torch.no_grad():
        logits = t.chunks[0](samples[:, :-1]).double()
    t.chunks[0].train()
    log_probs = logits.log_softmax(-1).gather(-1, samples[:, 1:, None]).squeeze(-1)
    expected = -log_probs.mean().item()
    assert value == pytest.approx(expected, rel=1e-5)
    # and not the loss of the training data, nor of only the first batch
    assert abs(value - (-log_probs[:4].mean().item())) > 1e-4
    assert value == pytest.approx(F.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten()).item(), rel=1e-5)
