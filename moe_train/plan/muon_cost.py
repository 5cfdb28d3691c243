"""What train.optimizer muon costs one rank per step beyond its state (train/muon.py, docs/optimizer.md): the
Newton-Schulz FLOPs of every Muon matrix the rank holds a shard of, each orthogonalised whole, and the
all-gathers that make it whole. Torch-free, so plan counts with it on the login node; measure counts the
products and collectives the optimizer runs (tests/test_muon.py holds the two equal).

Which tensors (`muon_trained`): Muon's under the default `train.muon.exclude`: every attention, dense MLP and
shared-expert weight and each routed expert's own [out, in] matrices; not the embedding, head, router or MTP's
eh_proj, nor any 1-D tensor. A recipe excluding other modules is planned as the default one.

The gathers: train/muon.py redistributes each sharded fp32 update (DTensor) to Replicate over every mesh
dimension but ep, one all-gather per sharded dimension, in the order DTensor takes them, which sets each one's
payload (measured: FSDP2 dp2, TP2, dp2 x tp2/tp4, ETP2 with and without EP2, EDP2 x ETP2):
- the FSDP2 group first when dim 0 is also cut by a mesh dimension inside it (a column-parallel weight's tp,
  an expert stack's ep: FSDP2 then shards dim 0 strided): it sends this rank's padded FSDP2 chunk, and tp (etp)
  then sends the tp-local whole;
- otherwise tp (etp) first, sending this rank's FSDP2 shard, then the FSDP2 group, sending its padded chunk of
  the tp-gathered rows.
The way back to this rank's shard is a local slice (no collective).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from moe_train.config.schema import MuonConfig

from .params import RankParams, Tensor, Unit, fsdp_rows
from .rank_layout import PlanLayout

FP32 = 4  # the update Newton-Schulz orthogonalises: fp32 whatever train.adam_moment_dtype stores


def newton_schulz_flops(rows: int, cols: int, *, steps: int) -> int:
    """FLOPs of train/muon.py's `newton_schulz` on one [rows, cols] matrix (2 per multiply-add). Its orientation
    rule (it iterates on the wide orientation, so the Gram matrix is the small one) makes a step X X^T (2 m^2 n),
    G G (2 m^3) and P X (2 m^2 n), m = min(rows, cols), n = max; the elementwise terms are left out, as the
    FLOP counter leaves them."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


DEFAULT_EXCLUDE = MuonConfig().exclude  # train.muon.exclude's default: the module names AdamW trains


def muon_trained(tensor: Tensor) -> bool:
    """Whether train.optimizer muon gives `tensor` to Muon under the default `train.muon.exclude`: train/muon.py's
    muon_param_groups rule on its declared name (models/declarations): a matrix (not a vector: fewer than 2
    dimensions or a `<stack>_bias`, gpt-oss's [E, width] expert biases) of no module the exclude names."""
    name = tensor.name.split(".")
    return len(tensor.shape) >= 2 and not name[-1].endswith("_bias") and not set(name[:-1]) & set(DEFAULT_EXCLUDE)


def whole_matrices(tensor: Tensor, layout: PlanLayout) -> tuple[int, int, int]:
    """(matrices, rows, cols): the whole matrices behind this rank's `tensor`, which Newton-Schulz runs on: a
    Linear's [out, in] with tp's cut undone, an expert stack's E/ep experts (ep keeps whole experts apart) each
    [out, in] with etp's cut undone."""
    shape = list(tensor.shape)
    if tensor.split is not None:
        shape[tensor.split] *= layout.etp if tensor.unit == "experts" else layout.tp
    return (shape[0] if len(shape) == 3 else 1), shape[-2], shape[-1]


def muon_flops(params: RankParams, layout: PlanLayout, *, steps: int) -> int:
    """Newton-Schulz FLOPs of one optimizer step on this rank: `steps` iterations on every whole matrix it holds
    a shard of (each rank of an FSDP2 or tp group repeats them: the gather design, docs/optimizer.md)."""
    total = 0
    for unit in params.units:
        for tensor in unit.tensors:
            if muon_trained(tensor):
                matrices, rows, cols = whole_matrices(tensor, layout)
                total += unit.count * matrices * newton_schulz_flops(rows, cols, steps=steps)
    return total


def muon_gathers(params: RankParams, layout: PlanLayout,
                 fsdp_group: Callable[[Unit], str]) -> Iterator[tuple[str, int, int, int]]:
    """(group, payload bytes, group size, times) of each all-gather of one optimizer step (the module
    docstring's order); `fsdp_group` names a unit's FSDP2 group as the FSDP2 traffic does. A group of one rank
    moves nothing (the caller drops it)."""
    for unit in params.units:
        group = fsdp_group(unit)
        for tensor in unit.tensors:
            if not muon_trained(tensor):
                continue
            held, chunk = fsdp_rows(tensor.shape[0], unit.shards)
            row = tensor.numel // tensor.shape[0]
            inner = "etp" if tensor.unit == "experts" else "tp"
            size = 1 if tensor.split is None else layout.etp if inner == "etp" else layout.tp
            if tensor.split == 0 or (tensor.unit == "experts" and layout.ep > 1):
                yield group, FP32 * chunk * row, unit.shards, unit.count
                yield inner, FP32 * tensor.numel, size, unit.count
            else:
                yield inner, FP32 * held * row, size, unit.count
                yield group, FP32 * chunk * row * size, unit.shards, unit.count
