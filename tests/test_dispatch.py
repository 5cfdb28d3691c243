"""Token dispatchers: permutation round trips, and expert-parallel dispatch against the single-process one.

The multi-rank checks run in tests/workers/dispatch.py (gloo, one process per rank, every case in one job per
world size) through tests/multirank.py, which kills every rank on timeout.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from multirank import run_ranks

from moe_train.models.moe.dispatcher import DISPATCHERS, LocalDispatcher, dispatcher_for
from moe_train.models.moe.permute import permute, unpermute


def check_round_trip(hidden, indices, keep, pad_to, num_experts):
    tokens, top_k = indices.shape
    probs = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(tokens)) + 1  # nonzero weights
    rows, row_probs, counts, perm = permute(hidden, indices, probs, num_experts=num_experts, keep=keep,
                                            pad_to=pad_to)
    expected = hidden.repeat_interleave(top_k, dim=0)
    expected_probs = probs.reshape(-1, 1)
    if keep is not None:
        expected = expected * keep.reshape(-1, 1)
        expected_probs = expected_probs * keep.reshape(-1, 1)
    assert torch.equal(unpermute(rows, perm), expected)
    # each row's weight travels with it (exactly: a copy), padding rows carry 0
    assert row_probs.shape == (rows.shape[0],) and row_probs.dtype == probs.dtype
    assert torch.equal(unpermute(row_probs.unsqueeze(-1), perm), expected_probs)
    assert int((row_probs != 0).sum()) == (tokens * top_k if keep is None else int(keep.sum()))
    kept = indices.reshape(-1) if keep is None else indices[keep]
    real = torch.bincount(kept, minlength=num_experts)
    assert counts.tolist() == ([pad_to] * num_experts if pad_to is not None else real.tolist())
    # Each expert's block holds exactly its own slots' rows (in token order), then zero padding.
    starts = torch.cumsum(counts, 0) - counts
    for expert in range(num_experts):
        block = rows[starts[expert] : starts[expert] + counts[expert]]
        tokens_of_expert = [t for t in range(tokens) for k in range(top_k)
                            if indices[t, k] == expert and (keep is None or keep[t, k])]
        assert torch.equal(block[: len(tokens_of_expert)], hidden[tokens_of_expert])
        assert not block[len(tokens_of_expert) :].any()


def test_permute_then_unpermute_returns_the_input_exactly():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 5, generator=generator)
    indices = torch.rand(9, 4, generator=generator).topk(2, dim=-1).indices
    keep = torch.rand(9, 2, generator=generator) > 0.3
    check_round_trip(hidden, indices, None, None, 4)
    check_round_trip(hidden, indices, keep, None, 4)
    check_round_trip(hidden, indices, keep, 9, 4)
    check_round_trip(hidden, torch.zeros(9, 1, dtype=torch.int64), None, None, 4)  # one expert takes all


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(0, 12),
    num_experts=st.integers(1, 6),
    top_k=st.integers(1, 3),
    drop=st.floats(0.0, 1.0),
    extra_pad=st.one_of(st.none(), st.integers(0, 3)),
    seed=st.integers(0, 2**16),
)
def test_permute_round_trip_property(tokens, num_experts, top_k, drop, extra_pad, seed):
    top_k = min(top_k, num_experts)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 3, generator=generator, dtype=torch.float64)
    indices = torch.rand(tokens, num_experts, generator=generator).topk(top_k, dim=-1).indices
    keep = torch.rand(tokens, top_k, generator=generator) >= drop
    most = int(torch.bincount(indices[keep], minlength=num_experts).max()) if tokens else 0
    pad_to = None if extra_pad is None else most + extra_pad
    check_round_trip(hidden, indices, keep, pad_to, num_experts)


@pytest.mark.parametrize("name", ["alltoall", "allgather", "hierarchical"])
def test_without_a_group_the_dispatchers_are_the_local_one(name):
    """group None: no communication, bit-equal to LocalDispatcher, including drops and padding."""
    dispatcher = dispatcher_for(name, num_experts=4, group=None)
    assert isinstance(dispatcher, DISPATCHERS[name])
    assert dispatcher.num_local_experts == 4
    local = LocalDispatcher(num_experts=4)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 6, generator=generator)
    indices = torch.rand(7, 4, generator=generator).topk(2, dim=-1).indices
    weights = torch.rand(7, 2, generator=generator)
    keep = torch.rand(7, 2, generator=generator) > 0.25
    for options in ({}, {"keep": keep}, {"keep": keep, "pad_to": 7}):
        rows, probs, counts, plan = dispatcher.dispatch(hidden, indices, weights, **options)
        rows_l, probs_l, counts_l, plan_l = local.dispatch(hidden, indices, weights, **options)
        assert torch.equal(rows, rows_l) and torch.equal(probs, probs_l) and torch.equal(counts, counts_l)
        out = dispatcher.combine(rows * 2 * probs.unsqueeze(-1), plan)
        assert out.dtype == torch.float32
        assert torch.equal(out, local.combine(rows_l * 2 * probs_l.unsqueeze(-1), plan_l))


def test_dispatcher_for_refuses_unknown_names():
    with pytest.raises(ValueError, match="model.moe.dispatcher"):
        dispatcher_for("broadcast", num_experts=4, group=None)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_dispatch_equals_single_process(world, tmp_path):
    """Every case of tests/workers/dispatch.py: outputs, gradients and byte counts on each of `world` ranks."""
    result = run_ranks("dispatch", world, {}, tmp_path, timeout=90)
    assert not result["failures"], "\n".join(result["failures"])
    # groups x expert counts x cases x dispatchers, + the fp32 agreement, + at 4 ranks the ep x etp cases
    expected = 2 * 10 * 2 + 1 if world == 2 else 2 * 2 * 10 * 2 + 1 + 10
    assert result["checks"] == [expected] * world


@pytest.mark.slow
def test_hierarchical_dispatch_on_two_emulated_nodes_equals_alltoall(tmp_path):
    """tests/workers/dispatch_hierarchical.py on 4 gloo ranks as 2 nodes x 2: outputs and every gradient equal the
    single-process reference and the all-to-all dispatcher (fp64 1e-12, fp32 1e-6); the rows crossing nodes are
    what the routing implies and never more than the all-to-all dispatcher's, fewer once tokens need a node's
    experts more than once."""
    result = run_ranks("dispatch_hierarchical", 4, {}, tmp_path, timeout=120)
    assert not result["failures"], "\n".join(result["failures"])
    assert result["checks"] == [2 * 10 + 3] * 4
    totals = {case: [sum(column) for column in zip(*ranks, strict=True)] for case, ranks in result["network"].items()}
    assert all(rows <= flat for rows, flat in totals.values()), totals
    rows, flat = totals["E8 top4 torch.float64"]
    assert 0 < rows < flat, (rows, flat)
