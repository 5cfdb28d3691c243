"""A step of many micro-batches, measured from a few: the whole model at world size 1 runs the recipe's every
micro-batch (deepseek-v3: 2,048), which would take most of an hour on fake tensors for figures that a few of
them fix exactly.

Every micro-batch of a step has the same shapes, and under `--fake` (forced even routing, no values) the same
work, so each figure of the report is affine in the number of micro-batches M once the schedule is past its
start-up: sums (FLOPs, bytes and calls per collective, tokens) grow by one micro-batch's worth per micro-batch,
maxima (per-layer activations, a 1F1B stage's in-flight peak, parameter, gradient and optimizer bytes) stop
growing once the pipeline is full. So the step is measured at three micro-batch counts M1 < M2 < M3 equally
spaced past the start-up, and each figure taken on to the recipe's count from them, but only where the three
agree on it being affine (otherwise every micro-batch is walked). GPipe is walked in full: its peak (every
micro-batch in flight) grows with M and can overtake a peak elsewhere in the step past the samples, so three
agreeing samples prove nothing (seen at 32 tokens a sample: 4, 5 and 6 micro-batches disagree).

The spacing is pp for the interleaved schedules (which need a multiple of pp), 1 otherwise; M1 is 2 without a
pipeline (the first micro-batch creates the gradients), 2 x pp for 1F1B (past any stage's pp - stage
micro-batches in flight) and pp x (vpp + 1) for the interleaved schedules (their live bytes still grow
unevenly up to there: pp 2, vpp 2 is affine from 6). Real runs route by value, so their micro-batches differ:
they walk them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.config.schema import Recipe


class NotAffine(Exception):
    """The sampled reports do not fix the step's figures: walk every micro-batch instead."""


def sample_counts(recipe: Recipe, micro_batches: int) -> tuple[int, int, int] | None:
    """The three micro-batch counts to measure, or None when walking all `micro_batches` costs no more."""
    p = recipe.parallel
    if p.pp > 1 and p.pp_schedule == "gpipe":
        return None  # its in-flight peak may overtake another one past the samples: three agreeing do not prove it
    interleaved = p.pp > 1 and p.pp_schedule in ("interleaved_1f1b", "zero_bubble")
    spacing = p.pp if interleaved else 1
    first = 2 if p.pp == 1 else p.pp * (p.vpp + 1) if interleaved else 2 * p.pp
    counts = (first, first + spacing, first + 2 * spacing)
    if sum(counts) >= micro_batches or (micro_batches - counts[-1]) % spacing:
        return None
    return counts


def with_micro_batches(recipe: Recipe, micro_batches: int, *, dp: int) -> Recipe:
    """The recipe with `micro_batches` micro-batches per step on each data-parallel rank (nothing else moves)."""
    train = recipe.train
    size = micro_batches * train.micro_batch_size * dp
    return recipe.model_copy(update={"train": train.model_copy(update={"global_batch_size": size})})


def _onwards(values: list, steps: int) -> object:
    """Values at M1, M2, M3 taken on `steps` spacings past M3; equal non-numbers stay as they are."""
    first = values[0]
    if isinstance(first, dict):
        if any(set(value) != set(first) for value in values):
            raise NotAffine(f"keys differ: {[sorted(map(str, value)) for value in values]}")
        return {key: _onwards([value[key] for value in values], steps) for key in values[-1]}
    if isinstance(first, int | float) and not isinstance(first, bool):
        low, mid, high = values
        if mid - low != high - mid:
            raise NotAffine(f"{low}, {mid}, {high} are not equally spaced")
        return high + steps * (high - mid)
    if any(value != first for value in values):
        raise NotAffine(f"{values} differ")
    return first


def derive(reports: list[dict], counts: tuple[int, int, int], micro_batches: int) -> dict:
    """The report of a step of `micro_batches` from the reports of steps of `counts` micro-batches; raises
    NotAffine when they do not fix it."""
    spacing = counts[1] - counts[0]
    return _onwards(reports, (micro_batches - counts[-1]) // spacing)
