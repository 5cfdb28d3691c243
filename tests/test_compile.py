"""train.compile: every decoder block compiled on its own (moe_train/parallel/compile.py) trains as the eager
model does, on each family, under the recompute policies, and under TP2+SP and EP2 (real gloo ranks, one job).

Compared as the layout tests compare (helpers.assert_same_run: losses relative 1e-5, gradients and
parameters after three steps rtol 1e-4 / atol 1e-6, the experts' balance figures relative 1e-6: routing and
telemetry counted once, recompute or not); in practice compiled and eager agree to the last bit or within
~1e-8 on the CPU. Graphs are counted (torch._dynamo's counters): one per block kind and graph-break segment,
all made in the first step, none after (dropless routing's varying row counts are dynamic dimensions). The
layout cases and the families use the `aot_eager` backend (MOE_TRAIN_COMPILE_BACKEND: autograd traced and
partitioned as for inductor, without code generation, which costs minutes on two cores); one case runs
inductor. Saved tensors under recompute: test_compiled_recomputation_saves_what_eager_saves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import SHRINK_LAYOUT, assert_same_run
from multirank import run_ranks
from workers.compile_layouts import counting_graphs
from workers.record import record_run

from moe_train.config import load_recipe
from moe_train.kernels import KERNELS
from moe_train.launch.rundir import IGNORED_FIELDS
from moe_train.parallel.compile import BACKEND_ENV, compile_enabled

FP32 = ["train.precision=fp32", "train.micro_batch_size=2"]
STEPS = 3
COMPILED = ["train.compile=true"]
SELECTIVE_ALL = ["parallel.recompute.granularity=selective",
                 "parallel.recompute.modules=[core_attn,layernorm,mla_up_proj,mlp,moe_act,shared_experts]"]
FULL = ["parallel.recompute.granularity=full", "parallel.recompute.method=uniform", "parallel.recompute.num_layers=1"]
MOE = ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe,layernorm]"]
MOE_ACT = ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe_act,layernorm]"]

# (family, recompute overrides, graphs one compiled step makes: one per block kind and graph-break segment)
FAMILIES = [
    ("qwen3-tiny", [], 1),  # two dense blocks, one graph
    ("qwen3-moe-tiny", MOE_ACT, None),  # the MoE layer compiled with its block
    ("deepseek-v3-tiny", SELECTIVE_ALL, None),
]


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")


def _compiled_run(name: str, overrides: list[str], run_dir: Path) -> dict:
    torch._dynamo.reset()  # nothing compiled before: every graph this run needs is made by it
    graphs: list[int] = []
    record = record_run(name, [*SHRINK_LAYOUT, *overrides, *COMPILED], world=1, run_dir=run_dir, steps=STEPS,
                        prepare=counting_graphs(graphs))
    return {**record, "graphs": graphs}


def _assert_compiled_once(graphs: list[int], expected: int | None) -> int:
    """Graphs made in the first step (== `expected` when given), none in the later steps; returns the count."""
    made = graphs[1] - graphs[0]
    assert made > 0
    assert graphs[1:] == [graphs[1]] * STEPS, graphs  # no step after the first compiles anything
    if expected is not None:
        assert made == expected
    return made


@pytest.mark.slow
def test_compiled_blocks_train_as_eager_on_each_family(tmp_path, aot_eager):
    for name, recompute, graphs in FAMILIES:
        overrides = [*FP32, *recompute]
        eager = record_run(name, [*SHRINK_LAYOUT, *overrides], world=1, run_dir=tmp_path / f"eager-{name}", steps=STEPS)
        compiled = _compiled_run(name, overrides, tmp_path / f"compiled-{name}")
        assert_same_run(compiled, eager)
        _assert_compiled_once(compiled["graphs"], graphs)


@pytest.mark.slow
def test_graphs_are_per_block_kind_not_per_layer(tmp_path, aot_eager):
    """Four dense blocks make the graphs two make: each kind compiles once and every block of it reuses it."""
    two = _compiled_run("qwen3-tiny", FP32, tmp_path / "two")
    four = _compiled_run("qwen3-tiny", [*FP32, "model.num_layers=4"], tmp_path / "four")
    assert _assert_compiled_once(two["graphs"], 1) == _assert_compiled_once(four["graphs"], 1)


def _saved_for_backward(name: str, overrides: list[str]) -> tuple[int, int]:
    """(tensors, bytes) one forward of the built model (the trainer's build) saves for backward, parameters aside,
    each storage once; measured on the second forward (the first compiles)."""
    from moe_train.parallel.bootstrap import bootstrap, shutdown
    from moe_train.train.build import build_training

    recipe = load_recipe(name, [*SHRINK_LAYOUT, *FP32, *overrides], check_files=False)
    ctx = bootstrap(recipe)
    try:
        torch._dynamo.reset()
        model = build_training(recipe, ctx, weights="init").chunks[0]
        ids = torch.randint(0, recipe.model.vocab_size, (2, recipe.train.seq_length),
                            generator=torch.Generator().manual_seed(0))
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage()._cdata not in params:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        for _ in range(2):
            seen.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                terms = model(ids, labels=ids)
            (terms.lm_sum + terms.mtp).backward()
        return len(seen), sum(seen.values())
    finally:
        shutdown(ctx)


@pytest.mark.slow
def test_compiled_recomputation_saves_what_eager_saves(aot_eager):
    """Full recomputation around compiled blocks keeps each group's input alone, as eager does (exactly); the
    `moe` policy, rerun around the (then eager) MoE layer, keeps less than the compiled model without it.
    Without recompute the compiled graphs save less than eager (the partitioner recomputes cheap ops)."""
    full_eager = _saved_for_backward("qwen3-moe-tiny", FULL)
    assert _saved_for_backward("qwen3-moe-tiny", [*FULL, *COMPILED]) == full_eager
    none_eager = _saved_for_backward("qwen3-moe-tiny", [])
    none = _saved_for_backward("qwen3-moe-tiny", COMPILED)
    moe = _saved_for_backward("qwen3-moe-tiny", [*MOE, *COMPILED])
    assert full_eager[1] < moe[1] < none[1] <= none_eager[1]


@pytest.mark.slow
def test_inductor_compiles_a_block_as_eager_trains_it(tmp_path):
    """The default backend (inductor's C++ code on the CPU) on one family: losses, gradients and parameters as
    eager within the layout tolerance (fused kernels round differently)."""
    assert os.environ.get(BACKEND_ENV) is None
    overrides = [*FP32, "model.num_layers=1"]
    eager = record_run("qwen3-tiny", [*SHRINK_LAYOUT, *overrides], world=1, run_dir=tmp_path / "eager", steps=STEPS)
    compiled = _compiled_run("qwen3-tiny", overrides, tmp_path / "inductor")
    assert_same_run(compiled, eager)
    _assert_compiled_once(compiled["graphs"], 1)


def test_train_compile_defaults_by_device_and_continues_a_run():
    recipe = load_recipe("qwen3-tiny")
    assert recipe.train.compile is None
    assert compile_enabled(recipe, torch.device("cpu")) is KERNELS["cpu"].compile is False
    assert compile_enabled(recipe, torch.device("cuda")) is KERNELS["cuda"].compile is True
    assert compile_enabled(load_recipe("qwen3-tiny", COMPILED), torch.device("cpu"))
    assert ("train", "compile") in IGNORED_FIELDS  # toggling it continues the same run


# ------------------------------------------------------------------------------- layouts (one 2-rank job)

TP_FP32 = ["train.precision=fp32", "train.adam_eps=1e-5", "train.global_batch_size=4"]  # test_tensor_parallel's
EP_MOE = ["train.micro_batch_size=1", "train.precision=fp32"]  # as the EP cases of test_data_parallel
SP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]
CHUNKED = ["train.loss_chunk_tokens=24"]  # 64 tokens a micro-batch: two whole chunks and a part
# (id, model, overrides, the single process's overrides it must equal)
WORLD2 = [
    ("compile-qwen3-sp2-full", "qwen3-tiny", [*TP_FP32, "train.micro_batch_size=2", *SP2, *FULL, *COMPILED],
     [*TP_FP32, "train.micro_batch_size=2"]),
    # the rows each rank's experts receive vary by step: the compiled combine sees them as dynamic dimensions
    ("compile-moe-ep2", "qwen3-moe-tiny", [*EP_MOE, "parallel.ep=2", *COMPILED], EP_MOE),
    ("chunked-qwen3-sp2", "qwen3-tiny", [*TP_FP32, "train.micro_batch_size=2", *SP2, *CHUNKED],
     [*TP_FP32, "train.micro_batch_size=2"]),
    ("chunked-dsv3-tp2", "deepseek-v3-tiny", [*TP_FP32, "train.micro_batch_size=2", "parallel.tp=2", *CHUNKED],
     [*TP_FP32, "train.micro_batch_size=2"]),
]


@pytest.mark.slow
def test_compiled_and_chunked_layouts_equal_the_single_process(tmp_path, aot_eager):
    """TP2+SP (full recompute) and EP2 (all-to-all) compiled, and the chunked loss under vocabulary parallelism
    (TP2 with DeepSeek-V3's MTP head, TP2+SP), against the eager, unchunked single process."""
    cases = [{"id": case_id, "recipe": name, "overrides": [*SHRINK_LAYOUT, *overrides], "steps": STEPS}
             for case_id, name, overrides, _ in WORLD2]
    saved = run_ranks("compile_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "w2")}, tmp_path,
                      timeout=600)
    for case_id, name, _, reference in WORLD2:
        got = torch.load(saved[case_id], weights_only=True)
        want = record_run(name, [*SHRINK_LAYOUT, *reference], world=1, run_dir=tmp_path / f"ref-{case_id}", steps=STEPS)
        assert_same_run(got, want)
        if case_id.startswith("compile-"):
            _assert_compiled_once(got["graphs"], None)
