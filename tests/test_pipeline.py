"""Pipeline parallelism against the single-process run of the same recipe, parameter by parameter.

Each layout trains on real gloo ranks (tests/workers/train_layouts.py, several cases per job) with several
micro-batches per step; the reference trains the same recipe at world size 1. Compared as every layout test
(helpers.assert_same_run):
the loss of every step (relative 1e-5), every gradient of step 1 and every parameter and buffer (the expert
bias included) after the last step, the expert balance figures of every step; where two stages hold the same
tensor (the last stage's copy of the embedding, for MTP or a tied head) both copies are bit-equal
(workers/record.py checks it when it gathers the stages). The cases cover 1f1b, gpipe and interleaved 1F1B,
PP=4, PP with TP+SP, with EP (folded over dp and over tp), PP2 x FSDP2 dp2 with gradients reduced once per step
or reduce-scattered in every backward (`parallel.grad_reduce`), DeepSeek-V3 with an uneven layout whose first stage
holds only a dense layer and whose last holds MTP, tied embeddings, recompute, evaluation and resume.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_cli
from helpers import LAYOUT_STEPS, SHRINK_LAYOUT, assert_same_run, read_metrics
from multirank import run_ranks
from processes import run_bounded
from workers.record import record_run

from moe_train.checkpoint.layout import latest_checkpoint
from moe_train.checkpoint.state import load_model_weights
from moe_train.config import load_recipe
from moe_train.config.pp_layout import pipeline_stages
from moe_train.models import build_model

FP32 = ["train.precision=fp32", "train.micro_batch_size=1", "model.num_layers=4"]  # 8 (dp 1) or 4 micro-batches
TP_EPS = ["train.adam_eps=1e-5"]  # test_tensor_parallel explains: TP sums per-head parts in another order
UNEVEN = "parallel.pp_layout=Et|tttmL"  # stage 0: the embedding and DeepSeek's dense layer; stage 1: MoE + MTP
REDUCE_EACH = "parallel.grad_reduce=per_microbatch"
INTERLEAVED = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"]

# (id, recipe, layout overrides (parallel.*: not given to the reference), model/train overrides)
WORLD2 = [
    ("qwen3-1f1b", "qwen3-tiny", ["parallel.pp=2"], ["train.micro_batch_size=1"]),
    ("qwen3-tied-gpipe", "qwen3-tiny", ["parallel.pp=2", "parallel.pp_schedule=gpipe"],
     ["model.tie_embeddings=true", "train.micro_batch_size=2"]),
    ("moe-interleaved-full", "qwen3-moe-tiny",
     ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b",
      "parallel.recompute.granularity=full", "parallel.recompute.method=uniform", "parallel.recompute.num_layers=1"],
     []),
    ("dsv3-uneven", "deepseek-v3-tiny", ["parallel.pp=2", UNEVEN], []),
]
EVALUATED = "qwen3-1f1b"  # the one case that also evaluates after its last step
WORLD4 = [
    ("qwen3-pp4", "qwen3-tiny", ["parallel.pp=4"], []),
    ("qwen3-pp2-tp2-sp-selective", "qwen3-tiny",
     ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute.granularity=selective",
      "parallel.recompute.modules=[core_attn,layernorm]"], TP_EPS),
    ("moe-pp2-ep2", "qwen3-moe-tiny", ["parallel.pp=2", "parallel.ep=2"], []),  # experts over the dp ranks
    ("dsv3-uneven-tp2-ep2", "deepseek-v3-tiny", ["parallel.pp=2", UNEVEN, "parallel.tp=2", "parallel.ep=2"],
     TP_EPS),  # experts folded over the tp ranks; the last stage's embedding copy vocabulary-sharded
    # PP2 x FSDP2 dp2 at both gradient cadences: reduced once per step, or reduce-scattered into the fp32 shards
    # in every backward (parallel.grad_reduce per_microbatch, the stage's lean gradient buffer)
    ("moe-pp2-ep2-reduce-each", "qwen3-moe-tiny", ["parallel.pp=2", "parallel.ep=2", REDUCE_EACH], []),
    ("qwen3-interleaved-dp2", "qwen3-tiny", INTERLEAVED, []),
    ("qwen3-interleaved-dp2-reduce-each", "qwen3-tiny", [*INTERLEAVED, REDUCE_EACH], []),
]


def _case(case_id: str, recipe: str, layout: list[str], model: list[str], **extra) -> dict:
    return {"id": case_id, "recipe": recipe, "overrides": [*SHRINK_LAYOUT, *FP32, *model, *layout],
            "steps": LAYOUT_STEPS, **extra}


def _assert_cases(tmp_path: Path, table: list[tuple], saved: dict[str, str]) -> None:
    references: dict[tuple, dict] = {}  # cases that differ only in their layout share the single-process run
    for case_id, recipe, _, model in table:
        got = torch.load(saved[case_id], weights_only=True)
        evaluates = case_id == EVALUATED
        # An evaluation exactly where the case asked for one (a pipeline that skipped it must not pass).
        assert (got["eval"] is not None) == evaluates, case_id
        key = (recipe, tuple(model), evaluates)
        if key not in references:
            references[key] = record_run(recipe, [*SHRINK_LAYOUT, *FP32, *model], world=1,
                                         run_dir=tmp_path / f"ref-{case_id}", steps=LAYOUT_STEPS, evaluate=evaluates)
        want = references[key]
        assert_same_run(got, want)
        if evaluates:
            assert got["eval"] == pytest.approx(want["eval"], rel=1e-5)


@pytest.mark.slow
def test_pipeline_two_ranks_equals_single_process(tmp_path: Path) -> None:
    cases = [_case(*row, evaluate=row[0] == EVALUATED) for row in WORLD2]
    resume = ["parallel.pp=2", UNEVEN]
    cases.append(_case("dsv3-resume", "deepseek-v3-tiny", resume, [], steps=4, stop_at=2))
    cases.append(_case("dsv3-straight", "deepseek-v3-tiny", resume, [], steps=4))
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "pp2")}, tmp_path, timeout=420)
    _assert_cases(tmp_path, WORLD2, saved)

    # Stopped at step 2 and resumed: each stage loads its own keys; bitwise the uninterrupted run.
    resumed, straight = (torch.load(saved[k], weights_only=True) for k in ("dsv3-resume", "dsv3-straight"))
    assert resumed["started"] == 2
    for key, value in straight["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    # The rank that holds the loss (the last stage's) wrote the metrics.
    logged = read_metrics(tmp_path / "pp2" / "dsv3-resume", "train")
    assert [r["loss"] for r in logged] == straight["losses"]
    assert all(r["mtp_loss"] > 0 and set(r["moe"]) == {"1", "2", "3", "4"} for r in logged)


@pytest.mark.slow
def test_pipeline_four_ranks_equals_single_process(tmp_path: Path) -> None:
    cases = [_case(*row) for row in WORLD4]
    saved = run_ranks("train_layouts", 4, {"cases": cases, "run_root": str(tmp_path / "pp4")}, tmp_path, timeout=480)
    _assert_cases(tmp_path, WORLD4, saved)
    # reduced in every backward: the sum of per-micro-batch shards, not the shard of one sum (the cadence ran)
    once, each = (torch.load(saved[k], weights_only=True)["grads"]
                  for k in ("qwen3-interleaved-dp2", "qwen3-interleaved-dp2-reduce-each"))
    assert once.keys() == each.keys()
    assert any(not torch.equal(each[name], value) for name, value in once.items()), "grad_reduce changed nothing"


@pytest.mark.parametrize(("name", "layout", "pp", "vpp"), [
    ("deepseek-v3", "Et*3|(tttt|)*14ttmL", 8, 2),
    ("qwen3-235b-a22b", "Et*11|(t*12|)*6t*11L", 8, 1),
    ("deepseek-v3-tiny", "Et|t*7mL", 2, 1),
    ("glm4.5", "Et*5|(t*6|)*12t*5|t*5|t*5mL", 16, 1),
])
def test_every_layer_is_in_exactly_one_stage(name: str, layout: str, pp: int, vpp: int) -> None:
    model = load_recipe(name).model
    stages = pipeline_stages(pp=pp, vpp=vpp, layout=layout, num_layers=model.num_layers, mtp_layers=model.mtp_layers)
    layers = [index for stage in stages for index in stage.layers]
    assert layers == list(range(model.num_layers))
    assert [k for stage in stages for k in stage.mtp] == list(range(model.mtp_layers))
    assert [stage.rank for stage in stages] == [index % pp for index in range(pp * vpp)]
    assert stages[0].embedding and stages[-1].loss and all(not s.mtp for s in stages[:-1])


TWO = ["launch.gpus_per_node=2", "parallel.pp=2"]


@pytest.mark.parametrize(("recipe", "sets", "expected"), [
    ("qwen3-tiny", [*TWO, "parallel.pp_layout=Et*4|t*4"], "the loss 'L' must appear once, in the last stage"),
    ("qwen3-tiny", [*TWO, "parallel.pp_layout=t*4|Et*4L"], "the embedding 'E' must appear once, in the first stage"),
    ("qwen3-tiny", [*TWO, "parallel.pp_layout=Et*4|t*2|t*2L"], "has 3 stages, but pp*vpp = 2"),
    ("qwen3-tiny", [*TWO, "parallel.pp_layout=E(t*4|t*4L"], "unclosed '('"),
    ("qwen3-tiny", [*TWO, "parallel.pp_layout=Et*|t*8L"], "'*' at character 3 needs a count"),
    ("qwen3-tiny", [*TWO, "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_layout=Et*8||L|"],
     "stage(s) 1, 3 hold nothing"),
    ("deepseek-v3-tiny", [*TWO, "parallel.pp_layout=Et*8m|L"], "MTP modules 'm' belong to the last stage"),
    ("qwen3-tiny", [*TWO, "train.global_batch_size=2", "train.micro_batch_size=2"],
     "1f1b needs at least pp = 2 micro-batches per step"),
    ("qwen3-tiny", [*TWO, "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b", "train.global_batch_size=6",
                    "train.micro_batch_size=2"], "interleaved_1f1b needs the micro-batch count per step"),
    ("qwen3-moe-tiny", [*TWO, "model.moe.router.load_balancing=all_layers_aux_loss"],
     "all_layers_aux_loss needs every layer's counts before any backward"),
])
def test_bad_pipeline_layouts_are_one_line_each(recipe: str, sets: list[str], expected: str) -> None:
    args = [arg for item in sets for arg in ("--set", item)]
    assert_bad_input(run_cli("validate", recipe, *args), expected)


def test_zero_bubble_is_refused_before_training(tmp_path: Path) -> None:
    """torch's zero-bubble weight pass leaves FSDP2's sharded parameters without gradients: refused, exit 2."""
    result = run_cli("run", "qwen3-tiny", "--nproc", "2", "--set", "parallel.pp=2", "--set",
                     "parallel.pp_schedule=zero_bubble", "--set", f"run_dir={tmp_path / 'zb'}")
    assert_bad_input(result, "parallel.pp_schedule: the zero_bubble schedule with FSDP2", "not supported yet")


@pytest.mark.slow
def test_run_nproc_trains_a_pipeline_and_the_last_stage_reports(tmp_path: Path) -> None:
    """`moe-train run --nproc 2` with pp 2 (torchrun, the entry): the summary and metrics come from the last stage's
    rank, the run completes with a checkpoint that a single process loads and `convert to-hf` exports."""
    run_dir = tmp_path / "run"
    sets = [*SHRINK_LAYOUT, *FP32, "train.steps=2", "parallel.pp=2", f"run_dir={run_dir}"]
    argv = [sys.executable, "-m", "moe_train.cli.main", "run", "deepseek-v3-tiny", "--nproc", "2",
            *(arg for item in [*sets, UNEVEN] for arg in ("--set", item))]
    done = run_bounded(argv, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("complete at step 2/2") == 1
    train = read_metrics(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2] and all(r["mtp_loss"] > 0 for r in train)
    assert (run_dir / "COMPLETE").exists() and latest_checkpoint(run_dir / "checkpoints").name == "step-0000002"
    # The two stages' shards make the whole model: it loads, strictly by name, into one process's model.
    model = build_model(load_recipe("deepseek-v3-tiny", [*SHRINK_LAYOUT, *FP32]).model)
    before = model.lm_head.weight.clone()
    load_model_weights(latest_checkpoint(run_dir / "checkpoints"), model)
    assert not torch.equal(model.lm_head.weight, before)  # the trained head (stage 1's), not the fresh one
    # Both stages' shards, MTP included, become one transformers checkpoint with the trained model's logits.
    exported = run_cli("convert", "to-hf", str(run_dir / "checkpoints"), "-o", str(tmp_path / "hf"))
    assert exported.code == 0, exported.stderr
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(tokens)
        assert ours.abs().mean() > 0.1  # O(1) logits: the comparison means something
        torch.testing.assert_close(hf(tokens).logits, ours, atol=1e-4, rtol=1e-4)
    from safetensors.torch import load_file

    files = {name: tensor for path in (tmp_path / "hf").glob("*.safetensors")
             for name, tensor in load_file(path).items()}
    mtp_layer = model.cfg.num_layers  # transformers skips DeepSeek's MTP layer; the file keeps it for the next run
    assert torch.equal(files[f"model.layers.{mtp_layer}.eh_proj.weight"], model.mtp["0"].eh_proj.weight)
