"""Parameter counts from a model section, without building the model (the login node has no torch): the sums
of the modules' declared parameters and GEMMs (models/declarations), placed as each declares.

Counts use the unpadded vocabulary, as published model cards do; `padded=True` counts what the engine
allocates. `active` counts the parameters one token passes through (top-k routed experts, not all of them).
The matrix counts (`attention_matrices`, `ffn_matrices`) are also what the FLOPs formula multiplies
(moe_train/plan/flop_count.py): one multiply-add per weight per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from moe_train.config.schema import ModelConfig, Recipe
from moe_train.models.declarations import embedding as ends
from moe_train.models.declarations import mtp as mtp_module
from moe_train.models.declarations.layer import attention_module, decoder_layer, ffn_modules
from moe_train.models.declarations.parts import Module, Param

from .rank_layout import Chunk, PlanLayout


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int
    embedding: int
    mtp: int


def attention_matrices(m: ModelConfig) -> int:
    """Weights of the attention projections (the declared GEMMs of the layer's attention)."""
    return sum(g.matrices for g in attention_module(m).gemms)


def ffn_matrices(m: ModelConfig, *, moe_layer: bool, active: bool) -> int:
    """Weights of one layer's feed-forward GEMMs: dense SwiGLU, or router + routed experts (top_k of them when
    `active`) + shared experts."""
    return sum(g.weights if active else g.matrices for module in ffn_modules(m, moe_layer=moe_layer)
               for g in module.gemms)


def _layer(m: ModelConfig, *, moe_layer: bool, active: bool) -> int:
    """Parameters of one decoder layer: every declared parameter of its modules (`active`: a token's share)."""
    return sum(p.count(active=active) for module in decoder_layer(m, moe_layer=moe_layer) for p in module.params)


def _numel(*modules: Module) -> int:
    return sum(p.numel for module in modules for p in module.params)


def count_parameters(m: ModelConfig, *, padded: bool = False) -> ParameterCount:
    """`padded`: the vocabulary as allocated, padded to `make_vocab_size_divisible_by` (never by tp: every layout
    has the same parameter shapes, docs/decisions.md)."""
    embedding = _numel(ends.embedding(m, padded=padded), ends.head(m, padded=padded, tied=m.tie_embeddings))
    total = active = embedding + _numel(ends.final_norm(m))
    moe_layers = m.moe_layers_in(0, m.num_layers)  # counted, not walked: validate answers at any num_layers
    for moe_layer, count in ((True, moe_layers), (False, m.num_layers - moe_layers)):
        if not count:
            continue
        total += count * _layer(m, moe_layer=moe_layer, active=False)
        active += count * _layer(m, moe_layer=moe_layer, active=True)
    mtp_block = _layer(m, moe_layer=m.moe is not None, active=False)
    mtp = m.mtp_layers * (mtp_block + _numel(mtp_module.declare(m)))
    return ParameterCount(total=total, active=active, embedding=embedding, mtp=mtp)


# ------------------------------------------------------------------------------- tensors as a rank holds them


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as one rank holds it after tensor and expert parallelism, before FSDP2 shards its
    dim 0 (`fsdp_rows`).

    `unit` is the FSDP2 unit that gathers it (parallel/data_parallel.py): `block` (a decoder block but its routed
    experts), `experts`, `mtp` (an MTP module's own projection and norms), `root` (embedding, final norm, head).
    `mesh` is the group of its gradient norm (train/grad_norm.py): `dense` (plain tensors, FSDP over dp), `tp`
    (tensor-parallel DTensors, FSDP over dp x tp), `experts` (over edp, or edp x ep x etp when expert-parallel).
    `partial`: replicated over tp with a partial gradient on each rank, summed over tp once per step.
    `gemm`: the `train.fp8.modules` kind of the Linear this is the weight of (attention, mlp, shared_experts,
    head; "" for the rest): what FSDP2's fp8 all-gather gathers in fp8 (models/fp8/all_gather.py).
    `split`: the dimension tensor parallelism cuts (tp for a Linear: 0 column-, 1 row-parallel; etp for an
    expert stack: 1 or 2), None where the tensor is whole over it: what Muon gathers to orthogonalise the whole
    matrix (plan/muon_cost.py). `name`: the parameter's declared name (models/declarations), under its module."""

    shape: tuple[int, ...]
    unit: str
    mesh: str
    partial: bool = False
    gemm: str = ""
    split: int | None = None
    name: str = ""

    @functools.cached_property
    def numel(self) -> int:
        out = 1
        for size in self.shape:
            out *= size
        return out


def fsdp_rows(rows: int, shards: int) -> tuple[int, int]:
    """(rows FSDP2 rank 0 holds, rows each rank sends in an all-gather): dim 0 is cut into `shards` chunks of
    ceil(rows / shards); the ranks past the end hold fewer or none, and every rank's chunk is padded to the
    full chunk in the collectives."""
    chunk = -(-rows // shards)
    return min(chunk, rows), chunk


def _tensor(p: Param, unit: str, *, tp: int, sequence_parallel: bool, ep: int = 1, etp: int = 1) -> Tensor:
    """A declared parameter as one rank holds it, placed as it declares (models/declarations/parts.py)."""
    shape = list(p.shape)
    if p.placement == "expert":  # expert stacks: an FSDP2 unit of their own, their gradient norm over the experts
        shape[0] //= ep
        if p.etp_dim is not None:
            shape[p.etp_dim] //= etp
        return Tensor(tuple(shape), "experts", "experts", split=p.etp_dim if etp > 1 and len(shape) == 3 else None,
                      name=p.name)
    if p.placement in ("column", "row") and tp > 1:
        dim = 0 if p.placement == "column" else 1
        shape[dim] //= tp
        return Tensor(tuple(shape), unit, "tp", gemm=p.fp8, split=dim if len(shape) == 2 else None, name=p.name)
    partial = {"sequence": sequence_parallel and tp > 1, "replicated": tp > 1}.get(p.placement, False)
    return Tensor(p.shape, unit, "dense", partial, p.fp8, name=p.name)


def _tensors(modules, unit: str, **layout) -> tuple[Tensor, ...]:
    return tuple(_tensor(p, unit, **layout) for module in modules for p in module.params)


@functools.lru_cache(maxsize=1024)
def block_tensors(m: ModelConfig, *, moe_layer: bool, tp: int, sequence_parallel: bool, ep: int,
                  etp: int) -> tuple[Tensor, ...]:
    """The parameters of one decoder block (parallel/tensor.py's plan, parallel/expert.py's expert shards)."""
    return _tensors(decoder_layer(m, moe_layer=moe_layer), "block", tp=tp, sequence_parallel=sequence_parallel,
                    ep=ep, etp=etp)


@functools.lru_cache(maxsize=1024)
def root_tensors(m: ModelConfig, *, tp: int, sequence_parallel: bool, embedding: bool = True,
                 head: bool = True) -> tuple[Tensor, ...]:
    """Embedding and head (vocabulary-parallel: rows over tp; one tensor when tied) and the final norm."""
    modules = [ends.embedding(m)] if embedding else []
    if head:
        modules += [ends.final_norm(m), ends.head(m, tied=m.tie_embeddings and embedding)]
    return _tensors(modules, "root", tp=tp, sequence_parallel=sequence_parallel)


@functools.lru_cache(maxsize=256)
def mtp_tensors(m: ModelConfig, *, tp: int, sequence_parallel: bool) -> tuple[Tensor, ...]:
    """An MTP module's own enorm, hnorm, eh_proj (2h -> h) and norm, all replicated over tp (its block aside)."""
    return _tensors([mtp_module.declare(m)], "mtp", tp=tp, sequence_parallel=sequence_parallel)


# ------------------------------------------------------------------------------- a rank's FSDP2 units


def fp8_gathered_kinds(recipe: Recipe) -> frozenset[str]:
    """The `Tensor.gemm` kinds FSDP2 gathers in fp8 (`train.fp8.fp8_all_gather`): the fp8-marked Linear weights;
    the routed experts' grouped weights stay bf16 (models/fp8/all_gather.py)."""
    t = recipe.train
    if t.precision != "fp8" or not t.fp8.fp8_all_gather:
        return frozenset()
    return frozenset(t.fp8.modules) - {"experts"}


@dataclass
class Unit:
    """One FSDP2 unit of a rank, `count` times alike: its tensors (params.Tensor) and the ranks it shards over."""

    tensors: tuple[Tensor, ...]
    shards: int
    count: int

    @functools.cached_property
    def _sizes(self) -> tuple[int, int, int]:
        """(elements at FSDP2 coordinate 0, elements of its padded shard, elements unsharded), once per unit:
        `plan --search` asks for them thousands of times, and hashing the tensors for a shared cache cost more
        than the sums."""
        held = padded = total = 0
        for t in self.tensors:
            rows, chunk = fsdp_rows(t.shape[0], self.shards)
            row = t.numel // t.shape[0]
            held, padded, total = held + rows * row, padded + chunk * row, total + t.numel
        return held, padded, total

    @property
    def local(self) -> int:
        """Elements the rank at FSDP2 coordinate 0 holds (full chunks: the most loaded)."""
        return self.count * self._sizes[0]

    @property
    def padded_shard(self) -> int:
        """Elements one rank sends in the unit's all-gather (every chunk padded to ceil(dim 0 / shards))."""
        return self._sizes[1]

    @property
    def numel(self) -> int:
        return self._sizes[2]

    def shard_bytes(self, param_bytes: int, fp8: frozenset[str]) -> int:
        """Bytes one rank sends in the unit's all-gather: its padded shard in the parameter dtype, the weights
        of the kinds `fp8` names (FSDP2's fp8 all-gather, `fp8_gathered_kinds`) at one byte each."""
        return sum(fsdp_rows(t.shape[0], self.shards)[1] * (t.numel // t.shape[0])
                   * (1 if t.gemm in fp8 else param_bytes) for t in self.tensors)

    def fp8_weights(self, fp8: frozenset[str]) -> int:
        """The unit's weights gathered in fp8: one fp32 amax all-reduce each per gather."""
        return sum(t.gemm in fp8 for t in self.tensors)


@dataclass
class RankParams:
    units: list[Unit] = field(default_factory=list)
    largest_unit: float = 0.0  # the largest FSDP unit (a layer with its experts, or the embedding/head)
    largest_gemms: dict[str, float] = field(default_factory=dict)  # its weights' elements by fp8 kind (Tensor)

    @property
    def tensors(self) -> list[tuple[Tensor, int]]:
        """Every tensor of the rank with the number of units holding one like it."""
        return [(t, unit.count) for unit in self.units for t in unit.tensors]

    @property
    def dense(self) -> float:
        """Dense parameters on this rank before FSDP sharding (after tp)."""
        return sum(t.numel * count for t, count in self.tensors if t.unit != "experts")

    @property
    def experts(self) -> float:
        """Expert parameters on this rank before FSDP sharding (after ep, etp)."""
        return sum(t.numel * count for t, count in self.tensors if t.unit == "experts")

    @property
    def local(self) -> int:
        """Elements this rank holds after FSDP2 (dp coordinate 0: full chunks, the most loaded)."""
        return sum(unit.local for unit in self.units)

    def fp8_elements(self, fp8: frozenset[str]) -> float:
        """Elements of this rank's weights FSDP2 gathers in fp8 (before sharding)."""
        return sum(t.numel * count for t, count in self.tensors if t.gemm in fp8)

    def gathered_bytes(self, param_bytes: int, fp8: frozenset[str]) -> int:
        """Bytes of every unit's gathered parameters, as FSDP2's all-gather outputs hold them (each tensor's
        padded chunks of all shards): what the rank holds over a step whose units stay gathered (per-step
        gathers, pipeline stages); measure's `gathered_param_bytes`."""
        return sum(unit.count * unit.shards * unit.shard_bytes(param_bytes, fp8) for unit in self.units)


def rank_params(m: ModelConfig, layout: PlanLayout, chunks: list[Chunk]) -> RankParams:
    """The FSDP2 units of one pipeline rank (parallel/data_parallel.py): each decoder block, its routed experts
    with it or apart (`layout.experts_apart`), each MTP module's own projection and norms, and the root
    (embedding, final norm, head)."""
    out = RankParams()
    dense_shards, sp = layout.dps * layout.cp, layout.sequence_parallel  # HSDP: shards within a replica
    kinds = {moe: block_tensors(m, moe_layer=moe, tp=layout.tp, sequence_parallel=sp, ep=layout.ep, etp=layout.etp)
             for moe in {False, m.moe is not None}}

    def add_block(moe: bool, count: int) -> None:
        tensors = kinds[moe]
        if not layout.experts_apart:
            out.units.append(Unit(tensors, dense_shards, count))
        else:
            out.units.append(Unit(tuple(t for t in tensors if t.unit == "block"), dense_shards, count))
            experts = tuple(t for t in tensors if t.unit == "experts")
            if experts:
                out.units.append(Unit(experts, layout.edps, count))
        if sum(t.numel for t in tensors) > out.largest_unit:
            out.largest_unit = sum(t.numel for t in tensors)
            out.largest_gemms = {}
            for t in tensors:
                out.largest_gemms[t.gemm] = out.largest_gemms.get(t.gemm, 0) + t.numel

    root: list[Tensor] = []
    for chunk in chunks:
        for moe, count in ((True, chunk.moe_layers), (False, len(chunk.layers) - chunk.moe_layers)):
            if count:
                add_block(moe, count)
        for _ in range(chunk.mtp):
            add_block(m.moe is not None, 1)
            out.units.append(Unit(mtp_tensors(m, tp=layout.tp, sequence_parallel=sp), dense_shards, 1))
        # the last stage's own copy of the embedding for MTP (and the tied head) when pp > 1 (docs/decisions.md)
        embedding = chunk.embedding or (layout.pp > 1 and chunk.mtp > 0)
        if embedding or chunk.loss:
            root += root_tensors(m, tp=layout.tp, sequence_parallel=sp, embedding=embedding, head=chunk.loss)
    if root:
        out.units.append(Unit(tuple(root), dense_shards, 1))
        vocab = _numel(ends.embedding(m)) / layout.tp
        if vocab > out.largest_unit:  # one vocabulary matrix: the head's when the root holds no embedding
            out.largest_unit = vocab
            matrices = [t for t in root if len(t.shape) == 2]
            out.largest_gemms = {matrices[0].gemm: vocab} if len(matrices) == 1 else {}
    return out
