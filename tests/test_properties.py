"""Property-based tests (hypothesis) where the input is a space, not a few cases: recipe `extends` and `--set`
merging, pipeline-layout strings, the MoE dispatcher's permute/unpermute round trip, and which samples each
data-parallel rank reads. Every expected value is built from the generated input by the rule the docs state,
not by the function under test."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moe_train.config import load_recipe
from moe_train.config.loader import deep_merge, parse_override
from moe_train.config.pp_layout import MAX_EXPANDED, LayoutError, Stage, parse_layout
from moe_train.data import global_batch
from moe_train.models.moe.dispatcher import LocalDispatcher

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------------------- extends and --set

KEYS = st.sampled_from(["a", "b", "c", "d"])
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.lists(st.integers(0, 3), max_size=3))
TREES = st.recursive(LEAVES, lambda children: st.dictionaries(KEYS, children, max_size=4), max_leaves=12)
MAPPINGS = st.dictionaries(KEYS, TREES, max_size=4)


def leaves(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """Every non-mapping value by its key path (an empty mapping counts as a value)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


@FAST
@given(MAPPINGS, MAPPINGS)
def test_deep_merge_child_wins_and_keeps_the_rest_of_the_parent(base: dict, override: dict) -> None:
    frozen_base, frozen_override = copy.deepcopy(base), copy.deepcopy(override)
    merged = deep_merge(base, override)
    assert (base, override) == (frozen_base, frozen_override)  # inputs untouched
    merged_leaves = leaves(merged)
    for path, value in leaves(override).items():
        if value == {} and isinstance(_at(base, path), dict):
            continue  # an empty mapping merges into the parent's and replaces nothing
        assert merged_leaves.get(path, _at(merged, path)) == value, path
    for path, value in leaves(base).items():
        if survives(path, override):
            assert _at(merged, path) == value, path
    assert deep_merge(merged, override) == merged  # applying the child twice changes nothing
    assert deep_merge(base, {}) == base


def survives(path: tuple, override: dict) -> bool:
    """A parent's value survives unless the child sets its key, or a key above it to something not a mapping."""
    node = override
    for depth, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            return True
        node = node[key]
        if depth == len(path) - 1 or not isinstance(node, dict):
            return False
    return True


def _at(tree, path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.text(alphabet="abcxyz019:.-_ ", min_size=1, max_size=8),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.sampled_from(["k", "v"]), SCALARS))


@FAST
@given(st.lists(st.sampled_from(["train", "lr", "model", "x_1"]), min_size=1, max_size=4), VALUES)
def test_set_values_read_back_as_the_yaml_they_were_written_as(path: list[str], value) -> None:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    if text.endswith("\n...") or text.endswith(" ..."):
        text = text.rsplit("...", 1)[0].strip()
    parts, parsed = parse_override(f"{'.'.join(path)}={text}")
    assert parts == tuple(path)
    assert parsed == value or (value == "" and parsed == "")


# Integer fields, their built-in default in qwen3-tiny, and a valid range.
FIELDS = {"train.steps": (1, 10**6), "train.seed": (0, 10**6), "logging.interval": (1, 1000),
          "train.eval_steps": (1, 50)}


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_extends_chain_and_overrides_take_the_last_word(data) -> None:
    """grandparent (a built-in) <- parent <- child <- --set: each field has the value of the last that sets it."""
    defaults = load_recipe("qwen3-tiny")
    layers = {name: {} for name in ("parent", "child", "set")}
    for field, (low, high) in FIELDS.items():
        for name in layers:
            if data.draw(st.booleans(), label=f"{name} sets {field}"):
                layers[name][field] = data.draw(st.integers(low, high), label=f"{name} {field}")
    with tempfile.TemporaryDirectory() as folder:
        for name, parent in (("parent", "qwen3-tiny"), ("child", "parent.yaml")):
            tree: dict = {"extends": parent}
            for field, value in layers[name].items():
                section, key = field.split(".")
                tree.setdefault(section, {})[key] = value
            (Path(folder) / f"{name}.yaml").write_text(yaml.safe_dump(tree))
        recipe = load_recipe(Path(folder) / "child.yaml", [f"{f}={v}" for f, v in layers["set"].items()])
    for field in FIELDS:
        section, key = field.split(".")
        expected = getattr(getattr(defaults, section), key)
        for name in ("parent", "child", "set"):
            expected = layers[name].get(field, expected)
        assert getattr(getattr(recipe, section), key) == expected, field


# ------------------------------------------------------------------------------------------ pipeline layouts

STAGES = st.builds(Stage, embedding=st.booleans(), layers=st.integers(0, 5), mtp=st.integers(0, 2),
                   loss=st.booleans())


@st.composite
def written_layouts(draw) -> tuple[str, list[Stage]]:
    """A list of stages and one of the many ways to write it: t*N or repeated letters, (..|)*N groups, spaces."""
    stages = draw(st.lists(STAGES, min_size=1, max_size=8))
    chunks = []
    for stage in stages:
        layers = stage.layers
        if layers >= 2 and draw(st.booleans()):
            body = draw(st.sampled_from([f"t*{layers}", f"(t)*{layers}", f"t{'t' * (layers - 2)}*1t"]))
        else:
            body = "t" * layers
        chunks.append(("E" if stage.embedding else "") + body + "m" * stage.mtp + ("L" if stage.loss else ""))
    # Runs of identical stages (other than the last) may be written as a group: (X|)*n.
    text, index = "", 0
    while index < len(chunks):
        run = 1
        while index + run < len(chunks) - 1 and chunks[index + run] == chunks[index]:
            run += 1
        if run >= 2 and index + run < len(chunks) and draw(st.booleans()):
            text += f"({chunks[index]}|)*{run}"
        else:
            run = 1
            text += chunks[index] + ("|" if index < len(chunks) - 1 else "")
        index += run
    if draw(st.booleans()):
        text = text.replace("|", " | ")
    return text, stages


@FAST
@given(written_layouts())
def test_layout_strings_parse_to_the_stages_they_describe(case: tuple[str, list[Stage]]) -> None:
    text, stages = case
    assert parse_layout(text) == stages, text


@FAST
@given(st.text(alphabet="EtmL|()*0123456789x ", max_size=24))
@example("t*99999999999")
@example("((Et|)*99999)*99999")
def test_any_layout_text_parses_or_fails_with_a_layout_error(text: str) -> None:
    """Never another exception (MemoryError on t*99999999999, IndexError...): `validate` reports LayoutError."""
    try:
        stages = parse_layout(text)
    except LayoutError:
        return
    assert stages and all(isinstance(s, Stage) for s in stages)
    assert sum(s.layers + s.mtp for s in stages) <= MAX_EXPANDED


# ------------------------------------------------------------------------------------------------ dispatcher


@st.composite
def routings(draw):
    num_experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, num_experts))
    tokens = draw(st.integers(1, 12))
    hidden = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    indices = torch.tensor(np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)]))
    keep = None
    if draw(st.booleans()):
        keep = torch.tensor(rng.random((tokens, top_k)) < 0.7)
    pad = draw(st.booleans())
    return num_experts, indices, keep, pad, torch.tensor(rng.standard_normal((tokens, hidden)), dtype=torch.float64)


@FAST
@given(routings())
def test_dispatch_then_combine_is_each_tokens_weighted_sum_of_its_kept_experts(case) -> None:
    num_experts, indices, keep, pad, x = case
    tokens, top_k = indices.shape
    kept = torch.ones_like(indices, dtype=torch.bool) if keep is None else keep
    loads = [int(((indices == e) & kept).sum()) for e in range(num_experts)]
    pad_to = max(loads) + 1 if pad else None
    dispatcher = LocalDispatcher(num_experts=num_experts)
    weights = torch.rand(tokens, top_k, dtype=torch.float64, generator=torch.Generator().manual_seed(tokens))
    rows, probs, counts, plan = dispatcher.dispatch(x, indices, weights, keep=keep, pad_to=pad_to)

    # Expert-major rows: expert e's block holds, in token order, the tokens routed to e (then zero padding).
    assert counts.tolist() == ([pad_to] * num_experts if pad else loads)
    start = 0
    for e in range(num_experts):
        block = pad_to if pad else loads[e]
        routed = [t for t in range(tokens) for k in range(top_k) if indices[t, k] == e and kept[t, k]]
        assert torch.equal(rows[start : start + len(routed)], x[routed]), e
        assert not rows[start + len(routed) : start + block].any()
        start += block
    assert rows.shape[0] == start

    # An "expert" that scales its rows by (e + 1) and applies each row's weight (as the experts' activation
    # does); combine must undo the permutation and sum each token's slots.
    scale = torch.cat([torch.full((pad_to if pad else loads[e],), float(e + 1)) for e in range(num_experts)])
    out = dispatcher.combine(rows * (scale.double() * probs)[:, None], plan)
    expected = torch.zeros_like(x)
    for t in range(tokens):
        for k in range(top_k):
            if kept[t, k]:
                expected[t] += weights[t, k] * (indices[t, k] + 1) * x[t]
    torch.testing.assert_close(out.double(), expected)


# ----------------------------------------------------------------------------------- data-parallel samples


class Numbered:
    """Sample i is [i, i, ..., i]: the batch says which samples it holds."""

    def __len__(self) -> int:
        return 1000

    def sample(self, index: int) -> np.ndarray:
        return np.full(5, index, dtype=np.int64)


@FAST
@given(st.integers(1, 12), st.integers(1, 6), st.integers(0, 50))
def test_each_rank_reads_its_contiguous_share_of_the_global_batch(per_rank: int, dp_size: int, step: int) -> None:
    global_size = per_rank * dp_size
    source = Numbered()
    parts = [global_batch(source, step=step, global_batch_size=global_size, dp_rank=r, dp_size=dp_size)
             for r in range(dp_size)]
    for rank, part in enumerate(parts):
        first = step * global_size + rank * per_rank
        assert part[:, 0].tolist() == list(range(first, first + per_rank))
    whole = global_batch(source, step=step, global_batch_size=global_size)
    assert torch.equal(torch.cat(parts), whole)  # every layout sees the same samples in the same order
    if dp_size > 1 and global_size % (dp_size + 1):
        with pytest.raises(ValueError, match="not divisible"):
            global_batch(source, step=step, global_batch_size=global_size, dp_size=dp_size + 1)
    with pytest.raises(ValueError, match="outside"):
        global_batch(source, step=step, global_batch_size=global_size, dp_rank=dp_size, dp_size=dp_size)
