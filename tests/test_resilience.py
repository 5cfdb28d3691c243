"""Resilience on real gloo ranks: one 4-rank job (tests/workers/resilience.py) runs every case, this process
compares them with the single-process run of the same recipe.

- Resharding resume: a checkpoint saved at TP=2 x EP=2 or at PP=2 x EP=2 resumes at TP=1 x EP=4 (same ranks,
  same run folder) and at world size 1 (this process, a checkpoint from elsewhere): every parameter's and
  optimizer state's full tensor equals the saved one exactly, and the following steps' losses equal the
  uninterrupted single-process run's (relative 1e-5, the layouts' own agreement). `convert to-hf` of the sharded
  checkpoint holds every expert and shard and gives transformers the logits of the single-process checkpoint's
  export.
- A NaN in one rank's own shard of one gradient (after every reduction): every rank rejects the step, no rank's
  state moves, and the next step trains.
- Stop requests: only the logging rank reads the notice file; a notice or one rank's SIGTERM stops all ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import FP32, SHRINK_LAYOUT, train_losses
from multirank import run_ranks
from workers.record import full_state

from moe_train.checkpoint.convert import to_hf
from moe_train.checkpoint.hf import state_dict_to_hf
from moe_train.config import load_recipe
from moe_train.train.loop import Trainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECIPE = "qwen3-moe-tiny"
# The layout tests' recipe (helpers.SHRINK_LAYOUT: adam_eps 1e-6 keeps Adam's sensitivity to reduction-order
# rounding low) at its fp32 MoE case.
SHRINK = [*SHRINK_LAYOUT, *FP32[RECIPE]]
STEPS, STOP_AT = 4, 2
# Layouts a checkpoint is saved under (4 ranks); one more line here adds a case (e.g. pipeline parallelism).
SAVE_LAYOUTS = {"tp2-ep2": ["parallel.tp=2", "parallel.ep=2"], "pp2-ep2": ["parallel.pp=2", "parallel.ep=2"]}
# Layouts each of those checkpoints resumes under on the same 4 ranks (world size 1 is resumed in this process).
RESUME_LAYOUTS = {"tp1-ep4": ["parallel.ep=4"]}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("resilience")
    cases: list[dict] = [{"kind": "stops", "id": "stops", "signal_rank": 3}]
    cases += [{"kind": "reshard", "id": f"save-{layout_id}", "recipe": RECIPE, "overrides": SHRINK, "save": layout,
               "resume": RESUME_LAYOUTS, "steps": STEPS, "stop_at": STOP_AT}
              for layout_id, layout in SAVE_LAYOUTS.items()]
    cases.append({"kind": "poison", "id": "poison", "recipe": RECIPE, "overrides": SHRINK,
                  "layout": SAVE_LAYOUTS["tp2-ep2"], "steps": 3, "poison_step": 2, "poison_rank": 1})
    saved = run_ranks("resilience", 4, {"cases": cases, "run_root": str(tmp / "runs")}, tmp, timeout=480)
    records = {key: value if key == "stops" else torch.load(value, weights_only=True) for key, value in saved.items()}
    return {"runs": tmp / "runs", "tmp": tmp, "records": records}


@pytest.fixture(scope="module")
def reference(job) -> dict:
    """The uninterrupted single-process run, with a checkpoint at STOP_AT."""
    run_dir = job["tmp"] / "reference"
    trainer = Trainer(load_recipe(RECIPE, [*SHRINK, f"run_dir={run_dir}", f"train.steps={STEPS}",
                                           f"checkpoint.interval={STOP_AT}", "checkpoint.keep=null"]))
    trainer.train()
    return {"losses": train_losses(run_dir), "checkpoint": run_dir / "checkpoints" / f"step-{STOP_AT:07d}"}


def assert_equal_tensors(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:5]}"
    assert any("/exp_avg" in key for key in want)  # the optimizer state is part of the comparison
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key}"


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.slow
@pytest.mark.parametrize("save_layout", SAVE_LAYOUTS)
def test_a_checkpoint_resumes_under_other_layouts_exactly(job, reference, save_layout: str) -> None:
    record = job["records"][f"save-{save_layout}"]
    saved = record["saved"]
    assert_same_losses(record["losses"], reference["losses"], range(1, STOP_AT + 1))
    checkpoint = job["runs"] / f"save-{save_layout}" / "checkpoints" / f"step-{STOP_AT:07d}"
    for layout_id in RESUME_LAYOUTS:
        resumed = record[layout_id]
        assert resumed["started"] == STOP_AT and resumed["own"] and resumed["started_from"] == str(checkpoint)
        assert_equal_tensors(resumed["loaded"], saved, f"{save_layout} -> {layout_id}")
        assert_same_losses(resumed["losses"], reference["losses"], range(STOP_AT + 1, STEPS + 1))
    # World size 1, in another run folder: a checkpoint from elsewhere (read through the restricted reader).
    run_dir = job["tmp"] / f"ws1-from-{save_layout}"
    trainer = Trainer(load_recipe(RECIPE, [*SHRINK, f"run_dir={run_dir}", f"train.steps={STEPS}",
                                           f"checkpoint.resume={checkpoint}"]))
    assert trainer.progress.step == STOP_AT and not trainer.start.own
    assert_equal_tensors(full_state(trainer), saved, f"{save_layout} -> world size 1")
    trainer.train()
    assert_same_losses(train_losses(run_dir), reference["losses"], range(STOP_AT + 1, STEPS + 1))


@pytest.mark.slow
def test_export_of_a_sharded_checkpoint_gathers_every_expert_and_shard(job, reference) -> None:
    import transformers  # the test extra installs it: a missing one is an error, never a silent skip
    from safetensors.torch import load_file

    layout = "tp2-ep2"
    sharded = job["runs"] / f"save-{layout}" / "checkpoints" / f"step-{STOP_AT:07d}"
    to_hf(sharded, job["tmp"] / "hf-sharded")
    to_hf(reference["checkpoint"], job["tmp"] / "hf-ws1")
    cfg = load_recipe(RECIPE, SHRINK).model
    saved = job["records"][f"save-{layout}"]["saved"]
    want = state_dict_to_hf(cfg, {k: v for k, v in saved.items() if "/" not in k})
    exported = load_file(job["tmp"] / "hf-sharded" / "model.safetensors")
    assert set(exported) == set(want)
    assert sum(".experts." in name for name in exported) == 2 * 8 * 3  # layers x experts x projections
    for name, value in want.items():
        assert torch.equal(exported[name], value), name
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name in ("hf-sharded", "hf-ws1"):
        model = transformers.AutoModelForCausalLM.from_pretrained(job["tmp"] / name).eval()
        with torch.no_grad():
            logits[name] = model(tokens).logits
    assert logits["hf-ws1"].abs().mean() > 0.1
    torch.testing.assert_close(logits["hf-sharded"], logits["hf-ws1"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_nan_in_one_ranks_gradient_shard_is_rejected_by_every_rank(job) -> None:
    record = job["records"]["poison"]
    assert record["verdicts"] == [[None, "nonfinite", None]] * 4
    # No rank moved at step 2 (model, Adam moments and counts); every rank trained at steps 1 and 3.
    assert record["unchanged"] == [[False, True, False]] * 4


@pytest.mark.slow
def test_stop_requests_agree_and_only_the_logging_rank_reads_the_notice(job) -> None:
    reasons = job["records"]["stops"]
    assert reasons["none"] == [None] * 4
    assert reasons["unread notice"] == [None] * 4  # rank 1's file exists, but rank 1 does not read a notice
    notice = job["runs"] / "stops" / "PREEMPT-0"
    assert reasons["notice"] == [f"preemption notice {notice}"] + ["the preemption notice (read by another rank)"] * 3
    assert reasons["signal"] == ["a stop requested on another rank"] * 3 + ["SIGTERM"]
