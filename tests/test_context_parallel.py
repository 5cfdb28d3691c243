"""Context parallelism (parallel/context_parallel.py, parallel/ring_attention.py): attention across the cp ranks'
shards against full causal attention (fp64, forward and backward), and training layouts with cp > 1 against the
single-process run of the same recipe, parameter by parameter (tests/workers/train_layouts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    FP32,
    LAYOUT_STEPS,
    MEASURE_SHAPE,
    NO_PIPELINE,
    SHRINK_LAYOUT,
    assert_same_run,
    case,
    fast_sample,
    plan_against_measure,
)
from multirank import run_ranks
from workers.record import record_run

from moe_train.parallel.context_parallel import chunk_indices, shard_sequence


def test_shard_keeps_chunks_r_and_2cp_minus_1_minus_r() -> None:
    assert chunk_indices(8, cp=2, rank=0).tolist() == [0, 1, 6, 7]
    assert chunk_indices(8, cp=2, rank=1).tolist() == [2, 3, 4, 5]
    assert chunk_indices(16, cp=4, rank=1).tolist() == [2, 3, 12, 13]
    x = torch.arange(24).view(2, 12)  # the shards of all ranks cover every token once
    parts = torch.cat([shard_sequence(x, cp=3, rank=r) for r in range(3)], dim=-1)
    assert sorted(parts[1].tolist()) == x[1].tolist()


ATTENTION_CASES = [
    # GQA (2 query heads per kv head), a batch of 2, with and without packed documents
    {"b": 2, "heads": 4, "kv_heads": 2, "s": 32, "d": 8, "dv": 8},
    # MLA's shapes: one kv head count = query heads, v narrower than q/k
    {"b": 1, "heads": 2, "kv_heads": 2, "s": 16, "d": 12, "dv": 4},
]


# gpt-oss: sinks and a sliding window shorter than a chunk (5 of 8 tokens at cp 2: whole blocks outside every window are
# skipped) or longer (13: windows across chunk edges), with and without packed documents
WINDOW_CASES = [{"window": 5, "documents": False}, {"window": 5, "documents": True},
                {"window": 13, "documents": False}]


def _attention_cases(world: int) -> list[dict]:
    cases = []
    for n, shape in enumerate(ATTENTION_CASES):
        for comm in ("p2p", "allgather"):
            for documents in (False, True):
                cases.append({**shape, "s": shape["s"] * world // 2, "comm": comm, "documents": documents,
                              "id": f"{n}-{comm}-{'docs' if documents else 'causal'}"})
    for comm in ("p2p", "allgather"):
        for window in WINDOW_CASES:
            cases.append({**ATTENTION_CASES[0], "s": ATTENTION_CASES[0]["s"] * world // 2, "comm": comm,
                          "sinks": True, **window,
                          "id": f"sinks-window{window['window']}-{comm}-{'docs' if window['documents'] else 'causal'}"})
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_attention_across_shards_equals_full_attention(tmp_path: Path, world: int) -> None:
    results = run_ranks("cp_attention", world, {"cases": _attention_cases(world)}, tmp_path, timeout=120)
    assert len(results) == 14
    for case_id, errors in results.items():
        for name, error in errors.items():
            assert error < 1e-12, (case_id, name, error)


# ------------------------------------------------------------------------------------- training layouts

_REFERENCES: dict[tuple, dict] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run of a recipe (SHRINK_LAYOUT, as every layout test's), each computed once for this
    module's tests."""
    def run(recipe: str, overrides: list[str], steps: int = LAYOUT_STEPS, evaluate: bool = False) -> dict:
        key = (recipe, tuple(overrides), steps, evaluate)
        if key not in _REFERENCES:
            folder = tmp_path_factory.mktemp(f"ref-{recipe}")
            _REFERENCES[key] = record_run(recipe, [*SHRINK_LAYOUT, *overrides], world=1, run_dir=folder, steps=steps,
                                          evaluate=evaluate)
        return _REFERENCES[key]

    return run


DOCS = "data.reset_at_eod=true"
MTP_RECIPE = ["train.micro_batch_size=2", "train.precision=fp32"]


@pytest.mark.slow
def test_cp2_equals_single_process(tmp_path: Path, reference) -> None:
    """CP2 on 2 ranks (dp 1): qwen3-tiny with both K/V exchanges (and evaluation) and with packed documents,
    DeepSeek-V3-tiny (MLA, MTP, expert bias, seq_aux_loss over each sequence's shards) and qwen3-moe-tiny: the
    single process's losses, step-1 gradients, parameters and buffers after three steps, and expert balance
    figures; and a CP2 run resumed at CP1 (DP2) from its step-2 checkpoint, and a CP1 (DP2) run resumed at CP2,
    each against four straight steps."""
    dense, moe = FP32["qwen3-tiny"], FP32["qwen3-moe-tiny"]
    cases = [
        case("cp2-p2p-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=2", "parallel.cp_comm=p2p"], evaluate=True),
        case("cp2-allgather-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=2", "parallel.cp_comm=allgather"]),
        case("cp2-docs-qwen3-tiny", "qwen3-tiny", [*dense, DOCS, "parallel.cp=2"]),
        case("cp2-deepseek-v3-tiny", "deepseek-v3-tiny", [*MTP_RECIPE, "parallel.cp=2"]),
        case("cp2-qwen3-moe-tiny", "qwen3-moe-tiny", [*moe, "parallel.cp=2"]),
        # two steps at cp 2, two more from its checkpoint at cp 1 (dp 2): DCP reshards, the run goes on
        case("cp2-to-cp1-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=2"], steps=4, stop_at=2,
                resume_overrides=["parallel.cp=1"]),
        # and back: two steps at cp 1 (dp 2), two more at cp 2 (dp 1)
        case("cp1-to-cp2-qwen3-tiny", "qwen3-tiny", dense, steps=4, stop_at=2,
                resume_overrides=["parallel.cp=2"]),
    ]
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "cp2")}, tmp_path,
                      timeout=400)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    want = reference("qwen3-tiny", dense, evaluate=True)
    assert_same_run(records["cp2-p2p-qwen3-tiny"], want)
    assert records["cp2-p2p-qwen3-tiny"]["eval"] == pytest.approx(want["eval"], rel=1e-5)  # over the shards too
    assert_same_run(records["cp2-allgather-qwen3-tiny"], want)
    assert_same_run(records["cp2-docs-qwen3-tiny"], reference("qwen3-tiny", [*dense, DOCS]))
    assert_same_run(records["cp2-deepseek-v3-tiny"], reference("deepseek-v3-tiny", MTP_RECIPE))
    assert_same_run(records["cp2-qwen3-moe-tiny"], reference("qwen3-moe-tiny", moe))
    straight = reference("qwen3-tiny", dense, steps=4)
    for name in ("cp2-to-cp1-qwen3-tiny", "cp1-to-cp2-qwen3-tiny"):
        resumed = records[name]
        assert resumed["started"] == 2, name
        for key, value in straight["state"].items():
            torch.testing.assert_close(resumed["state"][key], value, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, key=key, name=name: f"{name}: {key}: {m}")


@pytest.mark.slow
def test_cp_composes_on_four_ranks(tmp_path: Path, reference) -> None:
    """CP4 (8 chunks) on qwen3-tiny with selective recompute (core_attn: the exchange runs again in backward);
    CP2 x TP2 + SP on qwen3-moe-tiny (the sequence split by cp, then by tp; the MoE token set over cp x tp);
    CP2 x EP2 x DP2 with full recompute (the experts' ep ranks are cp ranks: parallel folding); CP2 x PP2
    (1f1b): each the single process's run."""
    dense, moe = FP32["qwen3-tiny"], FP32["qwen3-moe-tiny"]
    cases = [
        case("cp4-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=4", "parallel.recompute.granularity=selective",
                                                 "parallel.recompute.modules=[core_attn,layernorm]"]),
        case("cp2-tp2-sp-qwen3-moe-tiny", "qwen3-moe-tiny",
                [*moe, "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        case("cp2-ep2-qwen3-moe-tiny", "qwen3-moe-tiny", [*moe, "parallel.cp=2", "parallel.ep=2",
                                                              "parallel.recompute.granularity=full"]),
        case("cp2-pp2-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=2", "parallel.pp=2"]),
    ]
    saved = run_ranks("train_layouts", 4, {"cases": cases, "run_root": str(tmp_path / "cp4")}, tmp_path,
                      timeout=400)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    want = reference("qwen3-tiny", dense, evaluate=True)
    assert_same_run(records["cp4-qwen3-tiny"], want)
    assert_same_run(records["cp2-pp2-qwen3-tiny"], want)
    want = reference("qwen3-moe-tiny", moe)
    assert_same_run(records["cp2-tp2-sp-qwen3-moe-tiny"], want)
    assert_same_run(records["cp2-ep2-qwen3-moe-tiny"], want)


def test_validate_asks_the_sequence_to_split_into_2cp_chunks() -> None:
    from moe_train.config import load_recipe
    from moe_train.config.loader import RecipeError

    with pytest.raises(RecipeError, match=r"train.seq_length: 30 must be divisible by 4 \(2\*cp\) with context"):
        load_recipe("qwen3-tiny", ["launch.gpus_per_node=2", "parallel.cp=2", "train.seq_length=30"])
    # a MoE model's tp ranks route slices of each cp shard: 2*cp*tp
    with pytest.raises(RecipeError, match=r"train.seq_length: 36 must be divisible by 8 \(2\*cp\*tp\)"):
        load_recipe("qwen3-moe-tiny", ["launch.gpus_per_node=4", "parallel.cp=2", "parallel.tp=2",
                                       "train.seq_length=36"])
    load_recipe("qwen3-tiny", ["launch.gpus_per_node=4", "parallel.cp=2", "parallel.tp=2", "train.seq_length=36"])


def test_default_exchange_per_family() -> None:
    from moe_train.config import load_recipe

    chosen = [load_recipe(name, ["launch.gpus_per_node=2", "parallel.cp=2"]).parallel.cp_exchange(family)
              for name, family in (("qwen3-tiny", "qwen3"), ("qwen3-moe-tiny", "qwen3_moe"),
                                   ("deepseek-v3-tiny", "deepseek_v3"))]
    assert chosen == ["p2p", "p2p", "allgather"]
    recipe = load_recipe("deepseek-v3-tiny", ["launch.gpus_per_node=2", "parallel.cp=2", "parallel.cp_comm=p2p"])
    assert recipe.parallel.cp_exchange("deepseek_v3") == "p2p"


# ------------------------------------------------------------------------------------ plan against measure



def _tiny_cp(name: str, world: int, extra: list[str]):
    from moe_train.config import load_recipe

    return load_recipe(name, [*MEASURE_SHAPE, f"launch.gpus_per_node={world}", "parallel.cp=2",
                              "train.micro_batch_size=2", f"train.global_batch_size={world}", *extra],
                       check_files=False)


PLAN_CASES = [
    ("qwen3-tiny", 2, ["parallel.cp_comm=p2p"]),
    ("qwen3-tiny", 2, ["parallel.cp_comm=allgather", "train.precision=bf16", "data.reset_at_eod=true"]),
    ("qwen3-tiny", 4, ["parallel.cp=4", "parallel.recompute.granularity=selective",
                       "parallel.recompute.modules=[core_attn]"]),
    ("qwen3-tiny", 2, ["parallel.recompute.granularity=full"]),
    ("qwen3-moe-tiny", 4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("qwen3-moe-tiny", 8, ["parallel.tp=2", "parallel.ep=2"]),
    ("deepseek-v3-tiny", 2, ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[mla_up_proj]"]),
    ("deepseek-v3-tiny", 2, ["parallel.cp_comm=p2p", "train.precision=bf16"]),
]


@pytest.mark.parametrize(("name", "world", "extra"), fast_sample(PLAN_CASES, 8), ids=[f"{n}-{w}-{i}" for i, (n, w, _) in
                                                                       enumerate(PLAN_CASES)])
def test_plan_equals_measure_under_cp(name: str, world: int, extra: list[str], no_process_group) -> None:
    """measure --fake of one CP rank (cp/send, cp/recv or cp/all_gather, cp/reduce_scatter, the token groups'
    counts over cp or cp_tp, MTP's count, FLOPs by phase, bytes saved per layer) and the plan agree exactly."""
    from moe_train.measure.driver import Target, measure

    recipe = _tiny_cp(name, world, extra)
    report = measure(recipe, Target(fake=True))
    assert any(key.startswith("cp/") for key in report["comm_bytes"])
    assert plan_against_measure(recipe, report, tolerance=1e-9) == []
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_qwen3_30b_layer_at_32k_keeps_half_the_bytes_at_cp2(no_process_group) -> None:
    """A full-size Qwen3-30B-A3B MoE layer at s = 32768 (bf16, EP8), measured with --fake on one rank: at cp = 2
    it saves 0.45-0.55x the activation bytes of cp = 1, with either exchange (the all-gather regathers K/V in
    backward instead of keeping them); the exchange's bytes are the formula's, and the plan equals measure."""
    from moe_train.config import load_recipe
    from moe_train.measure.driver import Target, measure

    def run(cp: int, comm: str) -> dict:
        recipe = load_recipe("qwen3-30b-a3b", [
            *NO_PIPELINE, "model.num_layers=1", "train.seq_length=32768", "launch.nodes=1", "launch.gpus_per_node=8",
            f"parallel.cp={cp}", f"parallel.cp_comm={comm}", "parallel.ep=8", f"train.global_batch_size={8 // cp}",
            "train.micro_batch_size=1"], check_files=False)
        report = measure(recipe, Target(fake=True))
        assert plan_against_measure(recipe, report, tolerance=1e-9) == []
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return report

    one, ring, gathered = run(1, "p2p"), run(2, "p2p"), run(2, "allgather")
    layer = one["activation_bytes_per_layer"]["0"]
    for report in (ring, gathered):
        assert 0.45 <= report["activation_bytes_per_layer"]["0"] / layer <= 0.55
    kv = 2 * (32768 // 2) * 4 * 128 * 2  # K and V of this rank: s/cp tokens x 4 kv heads x 128, bf16
    grads = 2 * kv  # fp32
    assert ring["comm_bytes"]["cp/send"] == ring["comm_bytes"]["cp/recv"] == (2 - 1) * kv * 2 + 2 * grads
    assert gathered["comm_bytes"]["cp/all_gather"] == 2 * kv
    assert gathered["comm_bytes"]["cp/reduce_scatter"] == 2 * grads


# ---------------------------------------------------------------------------------- recipes and search

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize(("name", "gpu", "cp", "comm"), [("qwen3-30b-a3b-32k", "h100", 8, "p2p"),
                                                         ("deepseek-v3-32k", "b200", 8, "allgather")])
def test_32k_recipes_fit_their_cluster(name: str, gpu: str, cp: int, comm: str) -> None:
    """The built-in 32K recipes: valid, context-parallel, planned to fit their named GPUs (validate's verdict),
    DeepSeek-V3 with its published YaRN settings and Qwen3 with its rope unchanged."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import HARDWARE
    from moe_train.plan.estimate import estimate
    from moe_train.plan.fit import check_fit

    recipe = load_recipe(RECIPES / f"{name}.yaml")
    base = load_recipe(name.removesuffix("-32k"))
    assert (recipe.train.seq_length, recipe.parallel.cp, recipe.launch.gpu) == (32768, cp, gpu)
    assert recipe.parallel.cp_exchange(recipe.model.family) == comm
    assert recipe.model.rope == base.model.rope  # DeepSeek-V3's YaRN (factor 40 over 4096), Qwen3's theta 1e6
    tokens = recipe.train.global_batch_size * recipe.train.seq_length
    assert tokens == base.train.global_batch_size * base.train.seq_length  # the same tokens per step
    assert check_fit(recipe).error is None
    assert estimate(recipe, HARDWARE[gpu]).fits


@pytest.mark.slow
def test_search_considers_cp() -> None:
    """At 32K the 30B model's layouts on its 32 H100s include context-parallel ones near the top, and the best
    are valid recipes. Since plan counts attention as the causal kernel runs it ((s+1)/2 keys a query, half the
    s x s it counted before), TP4 + SP with cp = 1 ranks first (~160K tokens/s planned) and CP8 third (~145K):
    CP's advantage at 32K was the quadratic term it no longer doubles."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import HARDWARE
    from moe_train.plan.search import search

    recipe = load_recipe(RECIPES / "qwen3-30b-a3b-32k.yaml")
    every, valid, fits = search(recipe, HARDWARE["h100"], top=10_000)
    assert every and len(every) <= fits <= valid
    assert {c.overrides["parallel.cp"] for c in every} >= {1, 2, 4, 8}
    assert any(candidate.overrides["parallel.cp"] > 1 for candidate in every[:5])
    best_with = next(c for c in every if c.overrides["parallel.cp"] > 1)
    assert best_with.plan.tokens_per_s > 0.85 * every[0].plan.tokens_per_s
    for candidate in every[:3]:
        sets = [f"{k}={'null' if v is None else v}" for k, v in candidate.overrides.items()
                if k != "parallel.recompute"]
        load_recipe(RECIPES / "qwen3-30b-a3b-32k.yaml", sets)
