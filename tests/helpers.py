"""The helpers several test files share, one copy each: the tiny-recipe overrides, the metrics.jsonl reader, the
trainer factory, free ports, the layout tests' comparison, plan-against-measure, the GEMM-site counter.

Test modules never import one another: what two of them need lives here (or in cli_helpers.py, multirank.py,
processes.py, workers/). Heavy imports (torch, the compute half) happen inside the functions that need them, so a
login-half test file that imports this module loads no torch (workers import it on their ranks too).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from moe_train.config import load_recipe
from moe_train.config.fp8_auto import with_fp8_resolved
from moe_train.config.hardware import HARDWARE

# ---------------------------------------------------------------------------------------------- tiny recipes

# A built-in tiny recipe cut to seconds a step on a CPU: 2 layers, 32-token sequences, 2 micro-batches of 2,
# one warm-up step, fp32, a metrics line every step, no evaluation, no periodic checkpoint (the last step's
# checkpoint is still written). Later overrides win, so a test appends what it changes.
SHRINK = ["model.num_layers=2", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.warmup_steps=1", "train.precision=fp32", "logging.interval=1", "train.eval_interval=null",
          "checkpoint.interval=null"]


def shrink(*changes: str, without: tuple[str, ...] = (), base: list[str] = SHRINK) -> list[str]:
    """`base` with each `field=value` of `changes` in place of that field's entry (or added), the fields named in
    `without` left at the recipe's own value."""
    fields = {change.split("=", 1)[0] for change in changes} | set(without)
    return [entry for entry in base if entry.split("=", 1)[0] not in fields] + list(changes)


# The variants more than one file uses (a file with a need of its own calls shrink() itself and says why).
# The CLI runs (test_run_cli, test_async_checkpoint, test_tools): 4 micro-batches a step (2 on each of two ranks),
# and the recipe's own checkpoint interval (the runs are shorter than it: only the last step's checkpoint).
SHRINK_CLI = shrink("train.global_batch_size=8", without=("checkpoint.interval",))
# The SLURM job tests (test_slurm_resilience, test_slurm_two_nodes): 4 micro-batches a step, 2 on each of two ranks.
SHRINK_SLURM = shrink("train.global_batch_size=8")
# One layer of 16-token sequences, one micro-batch, no warm-up: the checkpoint tests, which train a step or two
# only to have a checkpoint to save and load.
SHRINK_ONE_LAYER = shrink("model.num_layers=1", "train.seq_length=16", "train.global_batch_size=2",
                          "train.warmup_steps=0")
# The layout-equivalence tests (data, tensor, context, pipeline parallel, compile, chunked loss, resilience): the
# micro-batch size and precision are each case's own (FP32 / BF16 below). Adam normalises each element's step:
# for a gradient element g near zero the step's sensitivity to g is about lr / (4 * eps), so the rounding
# difference of another reduction order (a reduce-scatter of partial sums, not one sum), ~1e-10 on a rare token's
# embedding row, became a 2e-6 step difference with eps 1e-8 (one element in 49k). eps 1e-6 keeps that
# sensitivity 100x lower; every other element agrees to ~1e-8 either way.
SHRINK_LAYOUT = shrink("train.global_batch_size=8", "train.lr=1e-3", "train.min_lr=1e-4", "train.adam_eps=1e-6",
                       without=("train.micro_batch_size", "train.precision"))


# ---------------------------------------------------------------------------------------------- the fast tier


def fast_sample(cases: list, every: int) -> list:
    """`cases` as pytest params, every `every`-th one (the first included) in the fast tier and the others marked
    slow: a parametrised test of many few-second cases keeps a spread sample in `pytest -m "not slow"`, and the
    whole suite (CI) still runs each case. A case that is a tuple is unpacked into the test's arguments."""
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)),
                         marks=() if number % every == 0 else pytest.mark.slow)
            for number, case in enumerate(cases)]


# ---------------------------------------------------------------------------------------------- a run's output


def read_metrics(run_dir: Path, kind: str | None = None, *, missing_ok: bool = False) -> list[dict]:
    """The records of `run_dir`/metrics.jsonl (those of `kind` only, if given). A missing file is an error unless
    `missing_ok` (a test that polls a run still starting): then no records."""
    path = Path(run_dir) / "metrics.jsonl"
    if missing_ok and not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if kind is None or r["kind"] == kind]


def train_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of every train line."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def trainer(name: str, run_dir: Path, *extra: str, base: list[str] = SHRINK):
    """An in-process Trainer of built-in recipe `name`, shrunk by `base`, writing to `run_dir`."""
    from moe_train.train.loop import Trainer

    return Trainer(load_recipe(name, [*base, f"run_dir={run_dir}", *extra]))


def sets(*values: str) -> list[str]:
    """`--set value` for each value: overrides as the command line takes them."""
    return [arg for value in values for arg in ("--set", value)]


def free_port() -> int:
    """A TCP port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- layout tests

LAYOUT_STEPS = 3
FP32 = {
    "qwen3-tiny": ["train.micro_batch_size=2", "train.precision=fp32"],
    "qwen3-moe-tiny": ["train.micro_batch_size=1", "train.precision=fp32"],  # 4 (DP2) or 2 (DP4) micro-batches
    "deepseek-v3-tiny": ["train.micro_batch_size=2", "train.precision=fp32"],  # MTP, expert bias, dense layer
}
# gpt-oss-tiny's layout cases: four layers (sliding, full, sliding, full); fp32 micro-batches of 2.
GPT_OSS_LAYOUT = ["model.num_layers=4", "model.layer_types=[sliding_attention, full_attention, sliding_attention, "
                  "full_attention]", "train.micro_batch_size=2", "train.precision=fp32", "train.adam_eps=1e-5"]
BF16 = ["train.micro_batch_size=2", "train.precision=bf16"]
# bf16 compute differs between layouts only through the order of fp32 reductions and per-rank batch shapes
# (parameters stay fp32, gradients are reduced in fp32): losses within 1e-3, parameters within 1e-3 + 1e-2 rel.
BF16_TOLERANCE = {"loss": 1e-3, "rtol": 1e-2, "atol": 1e-3}


def case(case_id: str, recipe: str, overrides: list[str], **extra) -> dict:
    """A layout case for tests/workers/train_layouts.py: SHRINK_LAYOUT, then `overrides`."""
    return {"id": case_id, "recipe": recipe, "overrides": [*SHRINK_LAYOUT, *overrides], "steps": LAYOUT_STEPS,
            **extra}


def reference(tmp_path: Path, recipe: str, overrides: list[str]) -> dict:
    """The single-process run a layout case is held to."""
    from workers.record import record_run

    return record_run(recipe, [*SHRINK_LAYOUT, *overrides], world=1, run_dir=tmp_path / f"ref-{recipe}",
                      steps=LAYOUT_STEPS)


def assert_same_run(got: dict, want: dict, *, loss: float = 1e-5, rtol: float = 1e-4, atol: float = 1e-6,
                    balance_rel: float = 1e-6, balance_abs: float = 0.0) -> None:
    """A layout's record (workers/record.py) equals the single-process one: every step's loss, every gradient of
    step 1, every parameter and buffer after the last step, and the expert balance figures of every step."""
    import torch

    assert got["losses"] == pytest.approx(want["losses"], rel=loss)
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
    assert set(got["state"]) == set(want["state"])
    for name, value in want["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name} after the last step: {m}")
    for got_step, want_step in zip(got["moe"], want["moe"], strict=True):
        if want_step is not None:  # the same routing: the same load figures, layer by layer
            assert got_step.keys() == want_step.keys()
            for layer, figures in want_step.items():
                assert got_step[layer].keys() == figures.keys(), layer
                for key, value in figures.items():  # one by one: approx compares a list nested in a dict exactly
                    # "tokens" counts what "load" gives as fractions: its absolute tolerance in tokens
                    scale = sum(value) if key == "tokens" else 1
                    assert got_step[layer][key] == pytest.approx(value, rel=balance_rel, abs=balance_abs * scale), (
                        layer, key)


# ---------------------------------------------------------------------------------------------- plan vs measure


# The planner's figures are hardware-independent; a GPU is needed only to plan at all.
GPU = HARDWARE["h100"]


# Two layers (DeepSeek-V3: dense, MoE, and its MTP module), one micro-batch of 64-token sequences.
MEASURE_SHAPE = ["model.num_layers=2", "train.seq_length=64"]
# The pipeline settings of a layout without pipeline parallelism, spelled out (full-size recipes set pp).
NO_PIPELINE = ["parallel.pp=1", "parallel.vpp=1", "parallel.pp_schedule=1f1b", "parallel.pp_layout=null"]


def recompute(policy: str) -> list[str]:
    """`none`, `full-uniform-N`, `full-block-N`, or selective modules joined by `+`."""
    if policy == "none":
        return ["parallel.recompute.granularity=none"]
    if policy.startswith("full-"):
        _, method, layers = policy.split("-")
        return ["parallel.recompute.granularity=full", f"parallel.recompute.method={method}",
                f"parallel.recompute.num_layers={layers}"]
    return ["parallel.recompute.granularity=selective", f"parallel.recompute.modules=[{policy.replace('+', ',')}]"]


def disagreements(figures: list, *, tolerance: float) -> list[str]:
    """One line per figure (measure/versus_plan.Figure) off by more than `tolerance` (parameter bytes: by
    anything at all)."""
    out = []
    for figure in figures:
        allowed = 0.0 if figure.name == "param_bytes" else tolerance
        if figure.relative_error > allowed:
            out.append(f"{figure.name}: plan {figure.planned:,.0f}, measured {figure.measured:,.0f} "
                       f"({(figure.planned - figure.measured) / figure.measured:+.2%})" if figure.measured else
                       f"{figure.name}: plan {figure.planned:,.0f}, measured 0")
    return out


def plan_against_measure(recipe, report: dict, *, tolerance: float, plan: dict | None = None) -> list[str]:
    """`plan`: the plan JSON to hold `report` to (default: the recipe's most loaded rank)."""
    from moe_train.measure.targets import as_fake_runs
    from moe_train.measure.versus_plan import against
    from moe_train.plan.estimate import estimate, plan_json

    plan = plan or plan_json(estimate(as_fake_runs(recipe), GPU))
    return disagreements(against(plan, report), tolerance=tolerance)


def tiny_recipe(name: str, tp: int, sp: bool, policy: str, precision: str, *extra: str):
    """A tiny recipe at tensor-parallel size `tp` under recompute `policy`. fp32 cases: micro-batches of 2
    sequences; bf16 cases: of 1 (where a sequence slice is a contiguous view of the whole micro-batch), and
    DeepSeek-V3 without its MTP module (a third block and head: seconds each)."""
    batch = 2 if precision == "fp32" else 1
    if name == "deepseek-v3-tiny" and precision == "bf16":
        extra = ("model.mtp_layers=0", *extra)
    return load_recipe(name, [*MEASURE_SHAPE, f"train.precision={precision}", f"launch.gpus_per_node={tp}",
                              f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}",
                              f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}",
                              *recompute(policy), *extra], check_files=False)


def full_size_recipe(name: str, tp: int, ep: int, sp: bool, policy: str, *, world: int | None = None,
                     extra: tuple[str, ...] = ()):
    """One layer of the model (with dense-first layers, DeepSeek-V3's and GLM-4.5's: its first dense and first MoE
    layer, no MTP) at the recipe's sequence length and precision, without context parallelism, on `world` ranks
    (default: the layout's smallest with dp > 1), one micro-batch per rank, no activation offloading (the
    policies it is given may recompute the recipe's offloaded regions). train.fp8.recipe auto resolved for the
    recipe's own GPU (plan_against_measure plans on an h100, where auto would mean another recipe than measure's
    launch target runs)."""
    world = world or max(2 * tp, ep, 8)
    cut = (["model.num_layers=2", "model.first_k_dense=1", "model.mtp_layers=0"]
           if load_recipe(name).model.first_k_dense else ["model.num_layers=1"])
    nodes = -(-world // 8)  # the recipes' GPUs have 8 per node
    overrides = [*NO_PIPELINE, *cut, "parallel.cp=1", "parallel.offload.modules=[]", f"launch.nodes={nodes}",
                 f"launch.gpus_per_node={world // nodes}",
                 f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.sequence_parallel={str(sp).lower()}",
                 f"train.global_batch_size={world // tp}", "train.micro_batch_size=1", *recompute(policy), *extra]
    return with_fp8_resolved(load_recipe(name, overrides, check_files=False))


def assert_same_step(fake: dict, real: dict, *, peak_rel: float = 0.10) -> None:
    """`measure --fake` against the real run: every figure equal, except the live-bytes peak: when Python frees a
    real run's tensors can vary (reference cycles wait for the garbage collector). Within 2% where the optimizer's
    temporaries set the peak; since AdamW runs fused (no temporaries) the peak is inside backward, where a real
    TP=2 full-recompute MoE step holds 9% more than its fake run (docs/measure.md): within 10% (`peak_rel`)."""
    exact = set(real) - {"fake", "peak_memory_bytes", "exposed_comm"}  # a real run's wait times: fake has none
    assert {k: fake[k] for k in exact} == {k: real[k] for k in exact}
    assert fake["peak_memory_bytes"] == pytest.approx(real["peak_memory_bytes"], rel=peak_rel)


# ---------------------------------------------------------------------------------------------- the GEMM site


def block_gemms(cfg, index: int) -> int:
    """Weight GEMMs of decoder block `index`'s forward, from the config alone (the same on every tp rank, each
    on its shard): attention projections, then the MLP, or the router + 3 grouped expert products (+ shared)."""
    if cfg.family == "deepseek_v3":
        attention = (1 if cfg.q_lora_rank is None else 2) + 3  # q (or q_a, q_b), kv_a, kv_b, o
    else:
        attention = 4
    if not cfg.is_moe_layer(index):
        return attention + 3
    shared = 3 if cfg.moe.shared_expert_ffn_hidden_size > 0 else 0
    return attention + 1 + 3 + shared


def gemm_origins():
    """A dispatch mode that records, for every GEMM dispatched while it is on, where it came from: "site" when
    models/linear.py is on the Python stack, "attention" when only models/attention.py (SDPA's score products),
    else "elsewhere" (its `origins` list)."""
    import sys

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import moe_train

    package = Path(moe_train.__file__).parent
    site, attention = package / "models" / "linear.py", package / "models" / "attention.py"
    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default, torch.ops.aten._grouped_mm.default, torch.ops.aten._scaled_mm.default}

    class GemmOrigins(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.origins: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in gemms:
                frame, files = sys._getframe(), set()
                while frame is not None:
                    files.add(Path(frame.f_code.co_filename))
                    frame = frame.f_back
                self.origins.append("site" if site in files else "attention" if attention in files else "elsewhere")
            return func(*args, **(kwargs or {}))

    return GemmOrigins()


# ---------------------------------------------------------------------------------------------- data


def write_tokenizer(tmp_path: Path, special: str = "<|endoftext|>") -> str:
    """A small BPE tokenizer.json trained here on stdlib text (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from moe_train.data.builtin import corpus_files

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<pad>", special])
    with open(corpus_files()[0]) as f:
        tokenizer.train_from_iterator([f.read()], trainer)
    path = str(tmp_path / "tokenizer.json")
    tokenizer.save(path)
    return path
