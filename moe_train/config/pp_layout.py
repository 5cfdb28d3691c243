"""Megatron's pipeline layout notation, parsed without torch so `validate` can check it on a login node.

A layout lists what each pipeline stage holds: `E` the embedding, `t` a decoder layer, `m` an MTP module, `L`
the loss (final norm and head), `|` a stage break; `X*n` repeats X and parentheses group, so
`Et*3|(tt|)*29m|L` is 32 stages for DeepSeek-V3's 61 layers. Stages are numbered in virtual order: with pp
ranks and vpp chunks each, stage s runs on rank s % pp; in a V (`parallel.pp_schedule` dualpipev, vpp 2) stage s
runs on rank s for s < pp and on rank 2 pp - 1 - s after, so rank 0 holds the first and the last stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.config.schema import Recipe

SYMBOLS = "EtmL"
# No real layout comes near this (DeepSeek-V3: 61 layers in 32 stages); a typo such as t*99999999999 must be a
# one-line error, not a MemoryError.
MAX_EXPANDED = 100_000


class LayoutError(ValueError):
    """A layout string that does not parse; the message says where."""


@dataclass(frozen=True)
class Stage:
    embedding: bool
    layers: int
    mtp: int
    loss: bool


def _expand(text: str, position: int, depth: int) -> tuple[str, int]:
    """Expand repetitions from `position` until a closing parenthesis (depth > 0) or the end."""
    out: list[str] = []
    while position < len(text):
        char = text[position]
        if char == ")":
            if depth == 0:
                raise LayoutError(f"unmatched ')' at character {position + 1}")
            return "".join(out), position + 1
        if char == "(":
            piece, position = _expand(text, position + 1, depth + 1)
        elif char in SYMBOLS or char == "|":
            piece, position = char, position + 1
        elif char.isspace():
            position += 1
            continue
        else:
            raise LayoutError(f"unexpected '{char}' at character {position + 1} (allowed: E t m L | ( ) *N)")
        if position < len(text) and text[position] == "*":
            end = position + 1
            while end < len(text) and text[end].isdigit():
                end += 1
            if end == position + 1:
                raise LayoutError(f"'*' at character {position + 1} needs a count")
            count = int(text[position + 1 : end])
            if len(piece) * count > MAX_EXPANDED:
                raise LayoutError(f"'*{count}' at character {position + 1} repeats past {MAX_EXPANDED:,} symbols")
            piece *= count
            position = end
        out.append(piece)
    if depth > 0:
        raise LayoutError("unclosed '('")
    return "".join(out), position


def parse_layout(text: str) -> list[Stage]:
    """The stages of a layout string, in virtual-stage order."""
    flat, _ = _expand(text, 0, 0)
    stages = [
        Stage(embedding="E" in chunk, layers=chunk.count("t"), mtp=chunk.count("m"), loss="L" in chunk)
        for chunk in flat.split("|")
    ]
    return stages


def even_layout(num_layers: int, stages: int, mtp_layers: int = 0) -> list[Stage]:
    """The default split: layers divided evenly; embedding first, MTP and loss on the last stage."""
    per_stage = num_layers // stages
    return [
        Stage(embedding=i == 0, layers=per_stage, mtp=mtp_layers if i == stages - 1 else 0, loss=i == stages - 1)
        for i in range(stages)
    ]


@dataclass(frozen=True)
class StageContents:
    """What one virtual stage holds, by the whole model's indices: decoder layers `layers` (consecutive) and
    MTP modules `mtp` (0-based, module k is layer num_layers + k); `rank` is its pipeline rank."""

    index: int
    rank: int
    layers: tuple[int, ...]
    mtp: tuple[int, ...]
    embedding: bool
    loss: bool


@functools.lru_cache(maxsize=512)
def pipeline_stages(*, pp: int, vpp: int, layout: str | None, num_layers: int,
                    mtp_layers: int, v_shape: bool = False) -> tuple[StageContents, ...]:
    """Every virtual stage of a (valid) pipeline, in order: the layout string's, or the even split. Layers are
    dealt out in order, so each appears in exactly one stage. Cached (and so a tuple): the planner's search asks
    for the same few pipelines many times."""
    stages = parse_layout(layout) if layout is not None else even_layout(num_layers, pp * vpp, mtp_layers)
    out, next_layer, next_mtp = [], 0, 0
    for index, stage in enumerate(stages):
        out.append(StageContents(
            index=index, rank=v_rank(index, pp) if v_shape else index % pp,
            layers=tuple(range(next_layer, next_layer + stage.layers)),
            mtp=tuple(range(next_mtp, next_mtp + stage.mtp)), embedding=stage.embedding, loss=stage.loss,
        ))
        next_layer += stage.layers
        next_mtp += stage.mtp
    return tuple(out)


def v_rank(index: int, pp: int) -> int:
    """The rank of virtual stage `index` in a V of 2 pp stages (torch's "v" style: down the ranks, then back)."""
    return index if index < pp else 2 * pp - 1 - index


def stages_of(recipe: Recipe) -> tuple[StageContents, ...]:
    """The virtual stages of a recipe's pipeline: what the engine builds, measure keeps and the plan counts."""
    p, m = recipe.parallel, recipe.model
    return pipeline_stages(pp=p.pp, vpp=p.vpp, layout=p.pp_layout, num_layers=m.num_layers, mtp_layers=m.mtp_layers,
                           v_shape=p.pp_schedule == "dualpipev")
