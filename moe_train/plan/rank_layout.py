"""The parallel layout the planner reasons about: mesh sizes, what each pipeline rank holds, and which link
each process group's traffic crosses.

Ranks are numbered as config/mesh_shape.py numbers them (row-major, last dimension fastest): on the dense
mesh (pp, dp, cp, tp) tp neighbours are adjacent ranks; on the expert mesh (pp, edp, ep, etp) etp neighbours
are. A group whose members lie within one NVLink domain (`Hardware.nvlink_domain` consecutive ranks: a node,
or a whole NVL72 rack) talks over NVLink; otherwise its traffic crosses the network.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from moe_train.config.loss_chunks import recipe_loss_chunk_tokens
from moe_train.config.mesh_shape import (
    DENSE_DIMS,
    EXPERT_DIMS,
    EXPERT_DP_SPLIT,
    MeshShape,
    dispatch_node_ranks,
    ep_split,
)
from moe_train.config.pp_layout import pipeline_stages
from moe_train.config.schema import ModelConfig, Recipe

from .recompute_policy import RecomputePolicy


@dataclass(frozen=True, kw_only=True)
class PlanLayout(MeshShape):
    """A candidate layout: the mesh shape (its sizes, world size and rank strides) and what the planner needs
    beside it (virtual stages, batch, schedule, recompute)."""

    vpp: int
    sequence_parallel: bool
    recompute: RecomputePolicy
    micro_batch: int
    global_batch: int
    seq_length: int
    pp_schedule: str
    pp_layout: str | None
    experts_apart: bool  # routed experts an FSDP2 unit of their own (`ParallelConfig.experts_apart`)
    loss_chunk_tokens: int  # tokens per chunk of the head + loss (config/loss_chunks.py); 0: unchunked
    ep_split: tuple[int, int] = (1, 1)  # (epnode, eplocal) of the hierarchical dispatcher; else (1, ep)
    device: str = "cpu"  # launch.device: the kernel table's row (moe_train/kernels.py) the ranks run
    fp8_modules: tuple[str, ...] = ()  # the GEMM kinds in fp8 (train.fp8.modules under precision fp8)
    # attention runs SDPA with is_causal: no document restarts (data.reset_at_eod), no sinks or sliding windows
    # (gpt-oss: every pair scored)
    causal_kernel: bool = True
    # gpt-oss's sinks or sliding windows: attention written out through its log-sum-exp (the kernel table's
    # `sinks_and_windows`), whose backward recomputes the scores, as context parallelism's does
    blockwise_attention: bool = False

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> PlanLayout:
        p, t = recipe.parallel, recipe.train
        shape = MeshShape.from_recipe(recipe)
        return cls(
            **vars(shape), vpp=p.vpp, sequence_parallel=p.sequence_parallel,
            recompute=RecomputePolicy.from_config(p.recompute, tuple(p.offload.modules)),
            micro_batch=t.micro_batch_size, global_batch=t.global_batch_size, seq_length=t.seq_length,
            pp_schedule=p.pp_schedule, pp_layout=p.pp_layout, experts_apart=p.experts_apart,
            loss_chunk_tokens=recipe_loss_chunk_tokens(recipe),
            ep_split=(ep_split(shape, dispatch_node_ranks(recipe)) if recipe.model.moe is not None
                      and recipe.model.moe.dispatcher == "hierarchical" else (1, p.ep)),
            device=recipe.launch.device,
            fp8_modules=tuple(sorted(set(t.fp8.modules))) if t.precision == "fp8" else (),
            causal_kernel=not recipe.data.reset_at_eod and not recipe.model.attention_sinks
            and recipe.model.sliding_window is None,
            blockwise_attention=recipe.model.attention_sinks or recipe.model.sliding_window is not None,
        )

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per step (gradient accumulation)."""
        return max(1, self.global_batch // (self.micro_batch * self.dp))


@dataclass(frozen=True)
class Chunk:
    """One model chunk (virtual stage) of a pipeline rank."""

    virtual_index: int
    layers: list[int]
    embedding: bool
    mtp: int
    loss: bool
    moe_layers: int  # how many of `layers` are MoE layers


def rank_chunks(layout: PlanLayout, cfg: ModelConfig) -> list[list[Chunk]]:
    """For each pipeline rank, its chunks in virtual order, with the global indices of their decoder layers
    (the engine's assignment: config/pp_layout.py `pipeline_stages`)."""
    per_rank: list[list[Chunk]] = [[] for _ in range(layout.pp)]
    stages = pipeline_stages(pp=layout.pp, vpp=layout.vpp, layout=layout.pp_layout, num_layers=cfg.num_layers,
                             mtp_layers=cfg.mtp_layers, v_shape=layout.pp_schedule == "dualpipev")
    for stage in stages:
        moe = sum(1 for index in stage.layers if cfg.is_moe_layer(index))
        per_rank[stage.rank].append(Chunk(stage.index, list(stage.layers), stage.embedding, len(stage.mtp),
                                          stage.loss, moe))
    return per_rank


def in_flight(layout: PlanLayout, rank: int) -> list[int]:
    """Micro-batches whose activations one pipeline rank holds at its peak, per chunk.

    1F1B: rank r runs pp - r forwards before its first backward. Interleaved 1F1B (Megatron-Core's warm-up):
    2 (pp - r - 1) + (vpp - 1) pp + 1 chunk forwards, dealt to the chunks in groups of pp, which is where its
    memory penalty over 1F1B comes from (chunk 0 holds up to 2pp - 1). gpipe holds every micro-batch.
    zero_bubble is counted as interleaved. dualpipev (plan/overlap.py `dualpipev_order`): 2 pp - r forwards of
    the stage on the way down before its first backward, r + 1 of the one on the way back. Never more than the
    step's micro-batches.
    """
    m, pp, vpp = layout.micro_batches, layout.pp, layout.vpp
    if pp == 1:
        return [1] * vpp
    if layout.pp_schedule == "gpipe":
        return [m] * vpp
    if layout.pp_schedule == "dualpipev":
        return [min(2 * pp - rank, m), min(rank + 1, m)]
    if vpp == 1:
        return [min(pp - rank, m)]
    warmup = 2 * (pp - rank - 1) + (vpp - 1) * pp + 1
    counts = [0] * vpp
    for k in range(min(warmup, m * vpp)):
        counts[(k // pp) % vpp] += 1
    return [min(c, m) for c in counts]


# ---------------------------------------------------------------------------------------------- links

@functools.lru_cache(maxsize=4096)
def group_span(layout: PlanLayout, group: str) -> tuple[int, int]:
    """(size, span in consecutive ranks) of a group named as measure names it (`dp`, `ep`, `dp_cp`, `dpr`, `dps`, ...;
    `embedding`: a first-stage rank and its last-stage peer, as far apart as the pipeline spans)."""
    if group == "embedding":
        return 2, group_span(layout, "pp")[1]
    if group in ("epnode", "eplocal"):  # the hierarchical dispatcher's split of ep (`layout.ep_split`)
        nodes, local = layout.ep_split
        stride = layout.strides(EXPERT_DIMS)["ep"]
        return (nodes, stride * local * nodes) if group == "epnode" else (local, stride * local)
    dims = group.split("_")
    expert = any(d in (*EXPERT_DIMS[1:], *EXPERT_DP_SPLIT[1:]) for d in dims)
    stride = layout.strides(EXPERT_DIMS if expert else DENSE_DIMS)
    size = span = 1
    for dim in dims:
        size *= getattr(layout, dim)
        span = max(span, stride[dim] * getattr(layout, dim))
    return size, span


def crosses_network(layout: PlanLayout, group: str, *, nvlink_domain: int) -> bool:
    size, span = group_span(layout, group)
    return size > 1 and span > nvlink_domain


def ranks_within_domain(layout: PlanLayout, group: str, *, nvlink_domain: int) -> int:
    """How many members of a group share one NVLink domain with a given member."""
    size, span = group_span(layout, group)
    if span <= nvlink_domain:
        return size
    stride = span // size
    return max(1, min(size, nvlink_domain // max(stride, 1)))
