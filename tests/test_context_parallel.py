"""Context parallelism (parallel/context_parallel.py, parallel/ring_attention.py): attention across the cp ranks'
shards against full causal attention (fp64, forward and backward), and training layouts with cp > 1 against the
single-process run of the same recipe, parameter by parameter (tests/workers/train_layouts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank import run_ranks

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
