"""The trainer's parts on their own: LR schedules, optimizer groups, the FLOPs formula, expert balance, the
loop's run tally and the gradient norm read on the host."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.utils.flop_counter import FlopCounterMode

from moe_train.config import TrainConfig, load_recipe
from moe_train.models import attention, build_model
from moe_train.models.moe.layer import router_entropy
from moe_train.plan.flop_count import forward_flops_per_token, training_flops_per_token
from moe_train.train.grad_norm import clip_grad_norm, host_norm
from moe_train.train.metrics import expert_balance
from moe_train.train.optimizer import build_optimizer
from moe_train.train.schedule import lr_at
from moe_train.train.tally import RunTally


def config(**fields) -> TrainConfig:
    base = {"seq_length": 8, "global_batch_size": 1, "steps": 100, "lr": 1.0, "min_lr": 0.1, "warmup_steps": 10}
    return TrainConfig(**{**base, **fields})


def test_warmup_is_linear_and_reaches_lr() -> None:
    train = config()
    assert [lr_at(s, train=train) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_falls_from_lr_to_min_lr_monotonically() -> None:
    train = config(lr_schedule="cosine")
    values = [lr_at(s, train=train) for s in range(10, 101)]
    assert values[0] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert lr_at(55, train=train) == pytest.approx(0.55)  # halfway: the midpoint of lr and min_lr
    assert lr_at(150, train=train) == pytest.approx(0.1)  # beyond the horizon: stays at min_lr


def test_wsd_holds_then_decays_linearly_over_its_fraction() -> None:
    train = config(lr_schedule="wsd", wsd_decay_fraction=0.2)  # 90 steps after warmup, the last 18 decay
    assert lr_at(82, train=train) == pytest.approx(1.0)
    assert lr_at(91, train=train) == pytest.approx(1.0 - 0.9 * 9 / 18)
    assert lr_at(100, train=train) == pytest.approx(0.1)


def test_constant_after_warmup() -> None:
    train = config(lr_schedule="constant")
    assert {lr_at(s, train=train) for s in (10, 50, 100)} == {1.0}


def test_no_weight_decay_on_norms_and_one_dimensional_parameters() -> None:
    recipe = load_recipe("qwen3-moe-tiny", ["model.num_layers=1"])
    model = build_model(recipe.model)
    optimizer = build_optimizer(model, train=recipe.train)
    decayed, undecayed = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == recipe.train.weight_decay and undecayed["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"])
    assert {names[id(p)] for p in undecayed["params"]} == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert any("norm" in names[id(p)] for p in undecayed["params"])
    assert len(decayed["params"]) + len(undecayed["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_flops_formula_matches_torch_flop_counter(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The formula against FlopCounterMode on the real model (math attention, per-expert matmuls, MTP on)."""
    # The model runs the kernel table's SDPA backends over any caller's choice: make the table's choice math.
    monkeypatch.setattr(attention, "sdpa_backends", lambda device_type: [SDPBackend.MATH])
    seq = 64
    recipe = load_recipe(name, ["model.num_layers=3", f"train.seq_length={seq}"])
    model = build_model(recipe.model)
    for module in model.modules():
        if hasattr(module, "use_grouped_mm"):  # count experts as plain matmuls (the counter's registry)
            module.use_grouped_mm = False
    tokens = torch.randint(0, recipe.model.vocab_size, (2, seq))
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens)
    measured = counter.get_total_flops() / tokens.numel()
    predicted = forward_flops_per_token(recipe.model, seq_length=seq)
    # The heads (main and MTP) run over the padded vocabulary, masked in the loss: executed, not model, FLOPs.
    cfg = recipe.model
    padding = 2 * cfg.hidden_size * (cfg.padded_vocab_size() - cfg.vocab_size) * (1 + cfg.mtp_layers)
    if name == "deepseek-v3-tiny":
        # MLA pads V (16) to the q/k head dim (24) for the fused kernel: executed, but not model, FLOPs.
        assert predicted + padding <= measured <= 1.03 * (predicted + padding)
    else:
        assert measured == predicted + padding
    assert training_flops_per_token(recipe.model, seq_length=seq) == 3 * predicted


def test_moe_flops_count_active_experts_only() -> None:
    recipe = load_recipe("qwen3-moe-tiny")
    more_experts = recipe.model.model_copy(update={"moe": recipe.model.moe.model_copy(update={"num_experts": 64})})
    base = forward_flops_per_token(recipe.model, seq_length=128)
    # 56 more experts, top-k unchanged: only the router grows (2 * hidden FLOPs per expert per layer).
    assert forward_flops_per_token(more_experts, seq_length=128) - base == 2 * 128 * 56 * recipe.model.num_layers


def test_expert_balance_figures() -> None:
    even = expert_balance(torch.tensor([4, 4, 4, 4]), 0.0, router_entropy=1.0)
    assert even == {"load_max_over_mean": 1.0, "load_cv": 0.0, "dropped_fraction": 0.0,
                    "load": [0.25, 0.25, 0.25, 0.25], "tokens": [4, 4, 4, 4], "router_entropy": 1.0}
    skewed = expert_balance(torch.tensor([8, 0, 0, 0]), 0.25)
    assert skewed["load"] == [1.0, 0.0, 0.0, 0.0] and "router_entropy" not in skewed
    assert skewed["load_max_over_mean"] == 4.0
    assert skewed["load_cv"] == pytest.approx(math.sqrt(3))
    assert skewed["dropped_fraction"] == 0.25


def test_router_entropy_by_hand() -> None:
    # Uniform scores over 8 experts: log 8 per token; one-hot (softmax-saturated) scores: 0; sigmoid scores are
    # normalised first: [0.5, 0.5] is uniform over 2.
    assert router_entropy(torch.full((3, 8), 0.125)).item() == pytest.approx(3 * math.log(8))
    assert router_entropy(torch.eye(4)).item() == pytest.approx(0.0, abs=1e-12)
    assert router_entropy(torch.tensor([[0.5, 0.5]])).item() == pytest.approx(math.log(2))


def test_run_tally_leaves_out_the_first_step_of_several_and_keeps_applied_losses(tmp_path) -> None:
    resumed = RunTally(first_step=4, last=8, tokens_per_step=100)
    for step, seconds in ((5, 10.0), (6, 1.0), (7, 3.0)):  # step 5 warms caches: not timed
        resumed.timed(step, seconds)
    assert resumed.tokens_per_s == 200 / 4.0
    alone = RunTally(first_step=4, last=5, tokens_per_step=100)
    alone.timed(5, 2.0)  # the only step of the process counts
    assert alone.tokens_per_s == 50.0 and RunTally(first_step=0, last=3, tokens_per_step=1).tokens_per_s == 0.0
    assert (resumed.first_loss, resumed.final_loss) == (None, None)
    for loss in (3.0, 2.5, 2.0):
        resumed.applied(loss)
    assert (resumed.first_loss, resumed.final_loss) == (3.0, 2.0)
    resumed.saved(6, tmp_path / "step-6")
    assert (resumed.saved_step, resumed.checkpoint) == (6, tmp_path / "step-6")


def test_clip_leaves_the_norm_on_the_device_and_the_host_reads_non_finite_as_nan() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])
    norm = clip_grad_norm([weight], 1.0)
    assert isinstance(norm, torch.Tensor) and host_norm(norm) == 5.0
    assert torch.allclose(weight.grad, torch.tensor([0.6, 0.8]))
    weight.grad = torch.tensor([float("inf"), 0.0])
    assert math.isnan(host_norm(clip_grad_norm([weight], None)))
    assert host_norm(clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0)) == 0.0  # no gradients at all
