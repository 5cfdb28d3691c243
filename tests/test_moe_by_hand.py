"""Capacity keep-masks and balancing losses against plain-Python loops written from their docstrings' definitions
(hypothesis draws the routings), so an expected value never comes from the function under test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_train.config.routing_shapes import expert_capacity
from moe_train.models.moe.aux_loss import global_aux_loss, seq_aux_loss, z_loss
from moe_train.models.moe.capacity import capacity_keep_mask

FAST = settings(max_examples=80, deadline=None)


@st.composite
def routings(draw, *, sequences: int = 1):
    num_experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, num_experts))
    tokens = draw(st.integers(1, 10)) * sequences
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    indices = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)])
    # Weights from a few values, so ties happen and the tie rule is exercised.
    weights = rng.choice([0.1, 0.25, 0.5, 0.9], size=(tokens, top_k)) if draw(st.booleans()) else rng.random(
        (tokens, top_k))
    return num_experts, indices, weights, rng


def keep_by_hand(indices, weights, num_experts: int, capacity: int, policy: str) -> list[list[bool]]:
    """Each expert keeps `capacity` of its assignments: the highest weights (ties: earlier token) or the earliest."""
    keep = [[False] * indices.shape[1] for _ in range(indices.shape[0])]
    for expert in range(num_experts):
        slots = [(t, k) for t in range(indices.shape[0]) for k in range(indices.shape[1]) if indices[t, k] == expert]
        if policy == "probs":
            slots.sort(key=lambda slot: (-weights[slot], slot[0]))
        for t, k in slots[:capacity]:
            keep[t][k] = True
    return keep


@FAST
@given(routings(), st.integers(0, 12), st.sampled_from(["probs", "position"]))
def test_capacity_keep_mask_by_hand(case, capacity: int, policy: str) -> None:
    num_experts, indices, weights, _ = case
    got = capacity_keep_mask(torch.tensor(indices), torch.tensor(weights, dtype=torch.float32),
                             num_experts=num_experts, capacity=capacity, policy=policy)
    assert got.tolist() == keep_by_hand(indices, weights.astype(np.float32), num_experts, capacity, policy)


@FAST
@given(st.integers(1, 4096), st.integers(1, 8), st.integers(1, 64), st.sampled_from([1, 2, 5, 8, 10, 20]))
def test_expert_capacity_is_the_ceiling_of_the_fair_share(tokens: int, top_k: int, experts: int, tenths: int) -> None:
    """ceil(T * K / E * factor) in exact integer arithmetic (factor = tenths / 10)."""
    capacity = expert_capacity(num_tokens=tokens, top_k=top_k, num_experts=experts, capacity_factor=tenths / 10)
    numerator, denominator = tokens * top_k * tenths, experts * 10
    exact = -(-numerator // denominator)
    assert capacity in (exact, exact + 1)  # float rounding of factor may add one row, never remove one
    assert capacity * denominator >= numerator


@FAST
@given(routings(), st.integers(0, 5))
def test_global_aux_loss_by_hand(case, extra_tokens: int) -> None:
    """E * sum_e (count_e / N) * mean_t probs[t, e], with the counts over N >= T tokens."""
    num_experts, indices, _, rng = case
    tokens = indices.shape[0]
    probs = rng.dirichlet(np.ones(num_experts), size=tokens)
    counts = [int((indices == e).sum()) for e in range(num_experts)]
    wider = [c + int(rng.integers(0, 3)) for c in counts]
    total = tokens + extra_tokens
    expected = num_experts * sum(wider[e] / total * probs[:, e].mean() for e in range(num_experts))
    got = global_aux_loss(torch.tensor(probs), torch.tensor(wider), total).item()
    assert math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-7)


@FAST
@given(st.integers(1, 3).flatmap(lambda b: st.tuples(st.just(b), routings(sequences=b))))
def test_seq_aux_loss_by_hand(case) -> None:
    """Per sequence: f_i = E / (K T) * picks of i, P_i = mean_t s_i,t / sum_j s_j,t; mean over sequences of sum f P."""
    batch, (num_experts, indices, _, rng) = case
    top_k = indices.shape[1]
    seq = indices.shape[0] // batch
    scores = rng.random((indices.shape[0], num_experts)) + 0.01
    losses = []
    for b in range(batch):
        rows = range(b * seq, (b + 1) * seq)
        total = 0.0
        for i in range(num_experts):
            f = num_experts / (top_k * seq) * sum(int(i in indices[t]) for t in rows)
            p = sum(scores[t, i] / scores[t].sum() for t in rows) / seq
            total += f * p
        losses.append(total)
    got = seq_aux_loss(torch.tensor(scores).view(batch, seq, -1), torch.tensor(indices).view(batch, seq, -1), top_k)
    assert math.isclose(got.item(), sum(losses) / batch, rel_tol=1e-5)


@FAST
@given(st.lists(st.lists(st.floats(-20, 20), min_size=3, max_size=3), min_size=1, max_size=6))
def test_z_loss_by_hand(rows: list[list[float]]) -> None:
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in rows) / len(rows)
    assert math.isclose(z_loss(torch.tensor(rows, dtype=torch.float64)).item(), expected, rel_tol=1e-5, abs_tol=1e-6)


def test_an_unknown_drop_policy_names_the_field() -> None:
    with pytest.raises(ValueError, match="model.moe.drop_policy must be 'probs' or 'position', got 'random'"):
        capacity_keep_mask(torch.tensor([[0]]), torch.tensor([[1.0]]), num_experts=1, capacity=1, policy="random")


def test_ties_keep_the_earlier_token_in_a_large_batch() -> None:
    """Thousands of tied weights: an unstable sort (which CPU torch uses at this size) would keep arbitrary ones."""
    rng = np.random.default_rng(0)
    indices = rng.integers(0, 4, size=(4096, 1))
    weights = rng.choice([0.5, 1.0], size=(4096, 1)).astype(np.float32)
    got = capacity_keep_mask(torch.tensor(indices), torch.tensor(weights), num_experts=4, capacity=700, policy="probs")
    assert got.tolist() == keep_by_hand(indices, weights, 4, 700, "probs")
