"""The gradient of the balancing losses alone, layout by layout, against the single process (Megatron-Core's
aux-loss tests).

The layout tests compare the total loss's gradients, under which an aux-loss gradient wrongly scaled by a group
size (tp, ep, dp, micro-batches) can hide: it is ~1e-3 of the language-model gradient. Here one training step
runs with the language-model and MTP losses multiplied by zero (tests/workers/aux_gradients.py): the forward,
its collectives and the trainer's step are those of training, but the only gradients are the ones the MoE
layers attach (aux_loss for qwen3-moe-tiny, seq_aux_loss + z-loss for deepseek-v3-tiny and glm4-moe-tiny), after
every reduction of the layout. Every parameter's gradient is compared with the single-process run of the same
micro-batch size (the router weights and everything upstream of them: attention, norms, earlier experts, the
embedding).
global_aux_loss depends on dp by definition (docs/decisions.md), so its gradient is compared with a direct computation
of Megatron-Core's definition over the data-parallel ranks' micro-batches instead.

fp32: the router computes in fp32 whatever the model's dtype, so fp64 cannot reach the losses. Without the
language-model loss the only noise is the aux gradient's own rounding (relative ~1e-7), while a wrong group
factor is a relative error of 1/2 or more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SHRINK_LAYOUT
from multirank import run_ranks
from workers.aux_gradients import zero_language_model_loss
from workers.record import record_run

from moe_train.config import load_recipe
from moe_train.data import build_datasets, global_batch
from moe_train.models import build_model
from moe_train.models.moe import MoELayer

BASE = [*SHRINK_LAYOUT, "train.precision=fp32", "train.grad_clip=null"]
MODEL = {
    "qwen3-moe-tiny": [],  # aux_loss, per layer over each micro-batch
    "deepseek-v3-tiny": ["model.moe.router.z_loss_coeff=1e-3"],  # seq_aux_loss + z-loss; MTP's MoE block too
    "glm4-moe-tiny": ["model.moe.router.z_loss_coeff=1e-3"],  # the same losses past biased q/k/v and partial rotary
}
GLOBAL = ["model.moe.router.load_balancing=global_aux_loss", "model.moe.router.aux_loss_coeff=1e-2"]
TP2, SP2 = ["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]
ALLGATHER = ["model.moe.dispatcher=allgather"]

# (id, model, layout, micro-batch size); global batch 8, so every rank accumulates 2 or more micro-batches.
WORLD2 = [
    ("moe-dp2", "qwen3-moe-tiny", [], 2),
    ("moe-tp2", "qwen3-moe-tiny", TP2, 2),
    ("moe-sp2", "qwen3-moe-tiny", SP2, 1),
    ("moe-ep2", "qwen3-moe-tiny", ["parallel.ep=2"], 2),
    ("moe-sp2-ep2", "qwen3-moe-tiny", [*SP2, "parallel.ep=2"], 1),
    ("dsv3-dp2", "deepseek-v3-tiny", [], 2),
    ("dsv3-sp2", "deepseek-v3-tiny", SP2, 2),
    ("dsv3-ep2", "deepseek-v3-tiny", ["parallel.ep=2"], 1),
    ("dsv3-tp2-ep2", "deepseek-v3-tiny", [*TP2, "parallel.ep=2"], 2),
    ("glm-sp2-ep2", "glm4-moe-tiny", [*SP2, "parallel.ep=2"], 2),
]
WORLD4 = [
    ("moe-ep2-edp2", "qwen3-moe-tiny", ["parallel.ep=2"], 1),
    ("moe-tp2-dp2-ep4", "qwen3-moe-tiny", [*TP2, "parallel.ep=4"], 1),  # experts over the whole world
    ("dsv3-ep2-edp2", "deepseek-v3-tiny", ["parallel.ep=2", *ALLGATHER], 1),
    ("dsv3-sp2-dp2-ep4", "deepseek-v3-tiny", [*SP2, "parallel.ep=4"], 1),
]
# global_aux_loss: (id, layout, micro-batch size, dp)
GLOBAL2 = [("global-dp2", [], 2, 2)]
GLOBAL4 = [("global-sp2-dp2-ep2", [*SP2, "parallel.ep=2"], 1, 2), ("global-dp4-ep4", ["parallel.ep=4"], 1, 4)]


def _overrides(name: str, mbs: int, *extra: str) -> list[str]:
    return [*BASE, *MODEL[name], f"train.micro_batch_size={mbs}", *extra]


def _cases(table: list[tuple], global_table: list[tuple]) -> list[dict]:
    cases = [{"id": case_id, "recipe": name, "overrides": _overrides(name, mbs, *layout)}
             for case_id, name, layout, mbs in table]
    cases += [{"id": case_id, "recipe": "qwen3-moe-tiny", "overrides": _overrides("qwen3-moe-tiny", mbs, *GLOBAL,
                                                                                   *layout)}
              for case_id, layout, mbs, _ in global_table]
    return cases


def _single_process(tmp_path: Path, cache: dict, name: str, mbs: int) -> dict[str, torch.Tensor]:
    if (name, mbs) not in cache:
        record = record_run(name, _overrides(name, mbs), world=1, run_dir=tmp_path / f"ref-{name}-{mbs}", steps=1,
                            prepare=zero_language_model_loss)
        cache[name, mbs] = record["grads"]
    return cache[name, mbs]


def global_aux_loss_gradients(mbs: int, dp: int) -> dict[str, torch.Tensor]:
    """Megatron-Core's global_aux_loss written out over the step's micro-batches, on one process: rank r's loss at
    micro-batch m is coeff * E * sum_e load_e * mean_t p_te over its tokens, load_e counting the top-k choices of
    every rank's micro-batches 0..m (detached) over their rows; the step's objective weighs each by
    1 / (micro-batches x dp), as the trainer does. Differentiated by autograd through the model's own forward
    (balancing switched off, the router's probabilities taken from a hook)."""
    recipe = load_recipe("qwen3-moe-tiny", [*_overrides("qwen3-moe-tiny", mbs, *GLOBAL), "launch.gpus_per_node=1"])
    coeff, experts = recipe.model.moe.router.aux_loss_coeff, recipe.model.moe.num_experts
    plain = recipe.model.model_copy(update={"moe": recipe.model.moe.model_copy(update={
        "router": recipe.model.moe.router.model_copy(update={"load_balancing": "none"})})})
    model = build_model(plain, seed=recipe.train.seed)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    routed: list[list] = [[] for _ in layers]  # per layer, the (probs, counts) of each forward in order
    for index, layer in enumerate(layers):
        layer.router.register_forward_hook(lambda mod, args, out, index=index: routed[index].append(
            (out.scores, torch.bincount(out.topk_indices.flatten(), minlength=experts).double())))
    source = build_datasets(recipe).train
    micro = {r: global_batch(source, step=0, global_batch_size=recipe.train.global_batch_size, dp_rank=r,
                             dp_size=dp).split(mbs) for r in range(dp)}
    steps = len(micro[0])
    for r in range(dp):
        for tokens in micro[r]:
            model(tokens[:, :-1], labels=tokens[:, 1:])
    objective = torch.zeros((), dtype=torch.float64)
    for per_layer in routed:
        forwards = {(r, m): per_layer[r * steps + m] for r in range(dp) for m in range(steps)}
        for (_, m), (probs, _) in forwards.items():
            seen = [forwards[q, k] for q in range(dp) for k in range(m + 1)]
            load = sum(counts for _, counts in seen) / sum(p.shape[0] for p, _ in seen)
            loss = coeff * experts * (load * probs.double().mean(0)).sum()
            objective = objective + loss / (steps * dp)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(objective, list(params.values()), allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g.float() for (name, p), g in zip(params.items(), grads,
                                                                                          strict=True)}


def assert_same_gradients(case_id: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every parameter's gradient within fp32 rounding of its own scale; the aux losses reach every router and the
    embedding, and nothing reaches the head (the language-model loss really is out of the step)."""
    assert set(got) == set(want), case_id
    for name, grad in want.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m, name=name: f"{case_id}: gradient of {name}: {m}")
    routers = [name for name in want if name.endswith("router.weight")]
    assert routers and all(want[name].abs().max() > 0 for name in routers), case_id
    assert want["embed_tokens.weight"].abs().max() > 0, case_id
    assert not got["lm_head.weight"].any() and not want["lm_head.weight"].any(), case_id


def _check(tmp_path: Path, table: list[tuple], global_table: list[tuple], saved: dict) -> None:
    cache: dict = {}
    for case_id, name, _, mbs in table:
        got = torch.load(saved[case_id], weights_only=True)["grads"]
        assert_same_gradients(case_id, got, _single_process(tmp_path, cache, name, mbs))
    for case_id, _, mbs, dp in global_table:
        got = torch.load(saved[case_id], weights_only=True)["grads"]
        assert_same_gradients(case_id, got, global_aux_loss_gradients(mbs, dp))


@pytest.mark.slow
def test_aux_loss_gradients_on_two_ranks_equal_single_process(tmp_path: Path) -> None:
    saved = run_ranks("aux_gradients", 2, {"cases": _cases(WORLD2, GLOBAL2), "run_root": str(tmp_path / "w2")},
                      tmp_path, timeout=240)
    _check(tmp_path, WORLD2, GLOBAL2, saved)


@pytest.mark.slow
def test_aux_loss_gradients_on_four_ranks_equal_single_process(tmp_path: Path) -> None:
    saved = run_ranks("aux_gradients", 4, {"cases": _cases(WORLD4, GLOBAL4), "run_root": str(tmp_path / "w4")},
                      tmp_path, timeout=300)
    _check(tmp_path, WORLD4, GLOBAL4, saved)


def test_the_global_reference_counts_over_the_ranks() -> None:
    """The direct computation tells global_aux_loss from its per-rank variant: with dp 1 it is a different
    gradient (each micro-batch's loads over fewer tokens), so the layout comparison above can fail."""
    dp2, dp1 = global_aux_loss_gradients(2, 2), global_aux_loss_gradients(2, 1)
    router = "layers.1.ffn.router.weight"
    assert not torch.allclose(dp2[router], dp1[router], rtol=1e-2)


@pytest.mark.parametrize("name", list(MODEL))
def test_the_language_model_loss_is_out_of_the_step(tmp_path: Path, name: str) -> None:
    """Zeroing the language-model loss leaves the balancing gradients: switching the balancing losses off too
    leaves none at all, so the gradients compared above are the balancing losses' alone."""
    off = ["model.moe.router.aux_loss_coeff=0", "model.moe.router.z_loss_coeff=0"]
    record = record_run(name, [*_overrides(name, 2), *off], world=1, run_dir=tmp_path / "off", steps=1,
                        prepare=zero_language_model_loss)
    assert all(not grad.any() for grad in record["grads"].values())
