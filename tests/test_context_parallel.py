"""Context parallelism (parallel/context_parallel.py, parallel/ring_attention.py): attention across the cp ranks'
shards against full causal attention (fp64, forward and backward), and training layouts with cp > 1 against the
single-process run of the same recipe, parameter by parameter (tests/workers/train_layouts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
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


def _attention_cases(world: int) -> list[dict]:
    cases = []
    for n, shape in enumerate(ATTENTION_CASES):
        for comm in ("p2p", "allgather"):
            for documents in (False, True):
                cases.append({**shape, "s": shape["s"] * world // 2, "comm": comm, "documents": documents,
                              "id": f"{n}-{comm}-{'docs' if documents else 'causal'}"})
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_attention_across_shards_equals_full_attention(tmp_path: Path, world: int) -> None:
    results = run_ranks("cp_attention", world, {"cases": _attention_cases(world)}, tmp_path, timeout=120)
    assert len(results) == 8
    for case_id, errors in results.items():
        for name, error in errors.items():
            assert error < 1e-12, (case_id, name, error)


# ------------------------------------------------------------------------------------- training layouts

def _layouts():  # imported late: test_data_parallel's helpers (SHRINK, case, reference, assert_same_run)
    import test_data_parallel as dp

    return dp


DOCS = "data.reset_at_eod=true"
MTP_RECIPE = ["train.micro_batch_size=2", "train.precision=fp32"]


def test_cp2_equals_single_process(tmp_path: Path) -> None:
    """CP2 on 2 ranks (dp 1): qwen3-tiny with both K/V exchanges and with packed documents, DeepSeek-V3-tiny
    (MLA, MTP, expert bias, seq_aux_loss over each sequence's shards) and qwen3-moe-tiny: the single process's
    losses, step-1 gradients, parameters and buffers after three steps, and expert balance figures."""
    dp = _layouts()
    dense, moe = dp.FP32["qwen3-tiny"], dp.FP32["qwen3-moe-tiny"]
    cases = [
        dp.case("cp2-p2p-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=2", "parallel.cp_comm=p2p"]),
        dp.case("cp2-allgather-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=2", "parallel.cp_comm=allgather"]),
        dp.case("cp2-docs-qwen3-tiny", "qwen3-tiny", [*dense, DOCS, "parallel.cp=2"]),
        dp.case("cp2-deepseek-v3-tiny", "deepseek-v3-tiny", [*MTP_RECIPE, "parallel.cp=2"]),
        dp.case("cp2-qwen3-moe-tiny", "qwen3-moe-tiny", [*moe, "parallel.cp=2"]),
        # two steps at cp 2, two more from its checkpoint at cp 1 (dp 2): DCP reshards, the run goes on
        dp.case("cp2-to-cp1-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=2"], steps=4, stop_at=2,
                resume_overrides=["parallel.cp=1"]),
    ]
    saved = run_ranks("train_layouts", 2, {"cases": cases, "run_root": str(tmp_path / "cp2")}, tmp_path,
                      timeout=400)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    want = dp.reference(tmp_path, "qwen3-tiny", dense)
    dp.assert_same_run(records["cp2-p2p-qwen3-tiny"], want)
    dp.assert_same_run(records["cp2-allgather-qwen3-tiny"], want)
    dp.assert_same_run(records["cp2-docs-qwen3-tiny"], dp.reference(tmp_path / "docs", "qwen3-tiny", [*dense, DOCS]))
    dp.assert_same_run(records["cp2-deepseek-v3-tiny"], dp.reference(tmp_path, "deepseek-v3-tiny", MTP_RECIPE))
    dp.assert_same_run(records["cp2-qwen3-moe-tiny"], dp.reference(tmp_path, "qwen3-moe-tiny", moe))
    resumed = records["cp2-to-cp1-qwen3-tiny"]
    assert resumed["started"] == 2
    straight = record_run("qwen3-tiny", [*dp.SHRINK, *dense], world=1, run_dir=tmp_path / "straight", steps=4)
    for key, value in straight["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_cp_composes_on_four_ranks(tmp_path: Path) -> None:
    """CP4 (8 chunks) on qwen3-tiny; CP2 x TP2 + SP on qwen3-moe-tiny (the sequence split by cp, then by tp; the
    MoE token set over cp x tp); CP2 x EP2 x DP2 (the experts' ep ranks are cp ranks: parallel folding); CP2 x
    PP2 (1f1b): each the single process's run."""
    dp = _layouts()
    dense, moe = dp.FP32["qwen3-tiny"], dp.FP32["qwen3-moe-tiny"]
    cases = [
        dp.case("cp4-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=4"]),
        dp.case("cp2-tp2-sp-qwen3-moe-tiny", "qwen3-moe-tiny",
                [*moe, "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        dp.case("cp2-ep2-qwen3-moe-tiny", "qwen3-moe-tiny", [*moe, "parallel.cp=2", "parallel.ep=2"]),
        dp.case("cp2-pp2-qwen3-tiny", "qwen3-tiny", [*dense, "parallel.cp=2", "parallel.pp=2"]),
    ]
    saved = run_ranks("train_layouts", 4, {"cases": cases, "run_root": str(tmp_path / "cp4")}, tmp_path,
                      timeout=400)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    want = dp.reference(tmp_path, "qwen3-tiny", dense)
    dp.assert_same_run(records["cp4-qwen3-tiny"], want)
    dp.assert_same_run(records["cp2-pp2-qwen3-tiny"], want)
    want = dp.reference(tmp_path, "qwen3-moe-tiny", moe)
    dp.assert_same_run(records["cp2-tp2-sp-qwen3-moe-tiny"], want)
    dp.assert_same_run(records["cp2-ep2-qwen3-moe-tiny"], want)


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
