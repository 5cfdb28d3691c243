"""The chunked head + cross-entropy (models/linear.py `linear_cross_entropy_sum`, train.loss_chunk_tokens).

The same loss and gradients as the unchunked head and loss, in fp32 to ~1e-6 relative (the chunks' GEMMs and
sums run in another order): every family with MTP, ignored targets and a padded vocabulary, chunks that divide
the tokens and chunks that do not. What it keeps for backward falls by the logits, as the planner says:
measure's per-layer bytes, FLOPs (the recomputed head GEMM) and collectives against plan exactly, and the fall
of the head's bytes exactly. Under vocabulary parallelism (TP2, TP2+SP) it trains as the single process does:
tests/test_compile.py's two-rank job.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BF16_TOLERANCE, GPU, SHRINK_LAYOUT, assert_same_run, fast_sample, plan_against_measure

from moe_train.config import load_recipe
from moe_train.config.loss_chunks import AUTO_CHUNK_TOKENS, loss_chunk_tokens
from moe_train.measure.driver import Target, measure
from moe_train.models import build_model
from moe_train.plan.activation_memory import head_activation_bytes
from moe_train.plan.assumptions import Assumptions
from moe_train.plan.estimate import _activation_layout, estimate, plan_json
from moe_train.plan.rank_layout import PlanLayout

RTOL = 2e-6  # fp32: measured ~1e-7 on the losses, <= 8e-7 of each gradient's largest element


pytestmark = pytest.mark.usefixtures("no_process_group")  # tests/conftest.py


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_chunked_loss_and_gradients_equal_the_unchunked(name):
    cfg = load_recipe(name, ["model.num_layers=2"]).model
    assert cfg.padded_vocab_size() > cfg.vocab_size  # the padding columns are masked in both
    torch.manual_seed(0)
    model = build_model(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    labels = ids.roll(-1, dims=1)
    labels[0, :5] = -100
    runs = {}
    for chunk in (0, 7, 16, 1000):  # unchunked, a ragged last chunk, even chunks, one chunk
        model.zero_grad()
        model.lm_loss.chunk_tokens = chunk
        terms = model(ids, labels=labels)
        (terms.lm_sum + terms.mtp).backward()
        runs[chunk] = (terms.lm_sum.detach(), terms.mtp.detach(),
                       {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    lm, mtp, grads = runs.pop(0)
    for chunk, (got_lm, got_mtp, got_grads) in runs.items():
        torch.testing.assert_close(got_lm, lm, rtol=RTOL, atol=0, msg=f"loss, chunks of {chunk}")
        torch.testing.assert_close(got_mtp, mtp, rtol=RTOL, atol=0, msg=f"MTP loss, chunks of {chunk}")
        assert got_grads.keys() == grads.keys()
        for key, grad in grads.items():
            torch.testing.assert_close(got_grads[key], grad, rtol=RTOL, atol=RTOL * grad.abs().max().item(),
                                       msg=lambda m, key=key, chunk=chunk: f"{key}, chunks of {chunk}: {m}")


def _head_bytes(recipe) -> float:
    layout = PlanLayout.from_recipe(recipe)
    lay = _activation_layout(recipe, layout, Assumptions())
    cfg = recipe.model
    return (head_activation_bytes(cfg, lay, vocab_parallel=True)
            + cfg.mtp_layers * head_activation_bytes(cfg, lay, vocab_parallel=True, final_norm=False))


# (model, overrides, bytes the unchunked loss saves beside the plan's head items and the chunked one does not:
#  nll_loss's fp32 total weight per loss (4); under vocabulary parallelism its index (int64) and two boolean
#  masks per token, where the chunked loss saves the targets themselves (int64): 2 bytes a token, less the
#  boolean padding mask the plan counts there (384 / tp columns), which that loss never saves)
CASES = [
    ("qwen3-tiny", ["train.precision=fp32"], lambda tokens: 4),
    ("qwen3-tiny", ["train.precision=bf16"], lambda tokens: 4),
    ("deepseek-v3-tiny", ["train.precision=fp32"], lambda tokens: 2 * 4),  # the main loss and MTP's
    ("qwen3-moe-tiny", ["parallel.tp=2", "launch.gpus_per_node=2", "parallel.sequence_parallel=true"],
     lambda tokens: 2 * tokens - 384 // 2),
]


@pytest.mark.parametrize(("name", "extra", "small"), fast_sample(CASES, 2),
                         ids=[f"{c[0]}-{'-'.join(c[1])}" for c in CASES])
def test_measure_shows_the_logits_gone_as_plan_says(name, extra, small):
    """measure --fake, unchunked and chunked: per-layer bytes, FLOPs (+ one head GEMM per head, recompute) and
    collectives equal the plan's; the head's saved bytes (measure's `other`) fall by what the plan's head
    formula falls, plus the few token-id and scalar saves the plan leaves out (`small`)."""
    reports, recipes = {}, {}
    for chunk in (0, 16):
        recipe = recipes[chunk] = load_recipe(name, [
            "model.num_layers=2", "train.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=2",
            f"train.loss_chunk_tokens={chunk}", *extra], check_files=False)
        reports[chunk] = measure(recipe, Target(fake=True))
        assert plan_against_measure(recipe, reports[chunk], tolerance=1e-9) == []
    cfg = recipes[0].model
    heads = 1 + cfg.mtp_layers
    head_gemm = 2 * cfg.hidden_size * cfg.padded_vocab_size() * 128 / recipes[0].parallel.tp
    assert reports[16]["flops"]["recompute"] - reports[0]["flops"]["recompute"] == heads * head_gemm
    other = {chunk: report["activation_bytes_per_layer"]["other"] for chunk, report in reports.items()}
    planned_fall = _head_bytes(recipes[0]) - _head_bytes(recipes[16])
    assert other[0] - other[16] == planned_fall + small(128)
    logits = heads * 4 * 128 * cfg.padded_vocab_size() / recipes[0].parallel.tp  # fp32, what the loss kept
    assert other[0] - other[16] > logits / 2  # less the lse, and under SP the whole sequence the head reads


def test_the_default_chunks_where_the_logits_are_large():
    assert loss_chunk_tokens(None, tokens=4096, vocab=151936) == AUTO_CHUNK_TOKENS  # Qwen3: 2.5 GB of logits
    assert loss_chunk_tokens(None, tokens=4096, vocab=151936 / 4) == 0  # tp 4: 0.6 GB
    assert loss_chunk_tokens(None, tokens=64, vocab=384) == 0  # the tiny recipes
    assert loss_chunk_tokens(0, tokens=4096, vocab=151936) == 0
    assert loss_chunk_tokens(512, tokens=64, vocab=384) == 512
    plan = {chunk: plan_json(estimate(load_recipe("qwen3-30b-a3b", [f"train.loss_chunk_tokens={chunk}"]), GPU))
            for chunk in ("0", "null")}
    saved = plan["0"]["memory_bytes"]["activations"] - plan["null"]["memory_bytes"]["activations"]
    assert saved > 2e9  # a micro-batch's fp32 logits over 151,936 words at 4,096 tokens, less the lse


def test_chunked_loss_trains_as_the_unchunked_under_fsdp2_bf16(tmp_path):
    """The trainer's build in bf16 (FSDP2's mixed precision: the head's weight gathered for forward, resharded,
    gathered again for the chunks' backward): two steps as the unchunked loss, within the bf16 tolerance of
    the layout tests (the chunks' logits are the same bf16 GEMM rows; their gradients are summed in fp32)."""
    from workers.record import record_run

    overrides = [*SHRINK_LAYOUT, "model.num_layers=1", "train.precision=bf16", "train.micro_batch_size=4",
                 "train.adam_eps=1e-4"]
    want = record_run("qwen3-tiny", overrides, world=1, run_dir=tmp_path / "whole", steps=2)
    got = record_run("qwen3-tiny", [*overrides, "train.loss_chunk_tokens=48"], world=1, run_dir=tmp_path / "chunked",
                     steps=2)
    assert_same_run(got, want, **BF16_TOLERANCE)
