"""The plan of one recipe on one cluster: memory of the most loaded rank, FLOPs, communication and step time.

Each pipeline rank is planned (ranks of one stage are alike under even routing); the reported rank is the one
with the highest peak memory, and the step time is the slowest rank's. Formulas: docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moe_train.config.fp8_auto import with_fp8_resolved
from moe_train.config.hardware import Hardware
from moe_train.config.routing_shapes import ForcedRouting
from moe_train.config.schema import ModelConfig, Recipe
from moe_train.kernels import kernels_for

from .activation_memory import (
    chunk_activation_bytes,
    full_recompute_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    layer_offloaded_bytes,
    mtp_activation_bytes,
    mtp_module_bytes,
    mtp_offloaded_bytes,
    other_activation_bytes,
)
from .assumptions import Assumptions
from .comm_bytes import CommBytes, comm_time, dispatch_forward
from .flop_count import forward_flops_per_token, layer_flops_by_region
from .muon_cost import muon_flops, muon_trained
from .overlap import ExposedComm, PairedPhases, dualpipev_bubble, exposed_comm, overlapped_pairs
from .params import RankParams, fp8_gathered_kinds, fsdp_rows, rank_params
from .rank_layout import Chunk, PlanLayout, in_flight, rank_chunks
from .recompute_policy import RecomputePolicy, recompute_groups
from .saved_tensors import ActivationLayout, expert_rows, padded_capacity

# Bytes of a gathered parameter: fp8 gathers bf16 weights and its GEMMs quantise them on the fly (keeping no fp8
# copy between GEMMs), except that train.fp8.fp8_all_gather gathers the fp8-marked Linear weights in fp8, one
# byte each (params.fp8_gathered_kinds, Unit.shard_bytes).
PARAM_BYTES = {"bf16": 2, "fp8": 2, "fp32": 4}
MASTER_BYTES = 4
GRAD_BYTES = 4  # fp32 gradients, reduced in fp32
ADAM_BYTES = {"fp32": 8, "bf16": 4}  # m and v, by train.adam_moment_dtype


# ------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class MoeLayerWork:
    """One MoE layer's executed FLOPs by kind of kernel (`_kernel`) in one micro-batch's forward and in its
    backward (with what recomputation reruns there), its memory-bound bytes over both, and how many such
    layers the rank runs (MTP's MoE blocks too)."""

    forward: dict[str, float]
    backward: dict[str, float]
    elementwise_bytes: float
    count: int


@dataclass
class RankPlan:
    rank: int
    params: RankParams
    memory: dict[str, float]
    activation_bytes_per_layer: dict[int, float]
    flops: dict[str, float]
    flops_split: dict[str, float]
    comm: CommBytes
    elementwise_bytes: float
    moe_sync: float  # seconds per step the host waits on MoE token counts
    # the dispatchers' bytes of the forwards (the rest of their keys' bytes ran in the backwards), and one MoE
    # layer's work in one micro-batch: what ep_overlap's pairs hide behind (plan/overlap.py)
    dispatch_forward: CommBytes = field(default_factory=CommBytes)
    moe_layer: MoeLayerWork | None = None
    # parallel.offload: {layer: bytes one micro-batch's forward moves to the host pool} (measure's figure), and
    # the bytes the pool holds at the rank's peak (every micro-batch in flight)
    offloaded_bytes_per_layer: dict[int, float] = field(default_factory=dict)
    host_bytes: float = 0.0
    local_params: int = 0  # params.local (elements after FSDP2), summed once
    chunks: list[Chunk] = field(default_factory=list)  # the rank's model chunks (`rank_chunks`)


@dataclass
class PlanMemo:
    """What the candidates of one `plan --search` share, each figure keyed by only what it depends on, so
    that layouts differing elsewhere reuse it: a pipeline's chunks (pp, vpp, its layout string, V or not), a rank's
    parameters (tp, ep, etp, cp and the FSDP2 shards, its chunks' shapes), one layer's FLOPs by region (the
    micro-batch's shape), a chunk's saved bytes (its activation shapes, the policy and which of its layers are
    MoE), the head's, an MTP module's and each kind of layer's bytes (the activation shapes). The model section
    is keyed by identity (hashing a pydantic model costs more than most formulas);
    `models` keeps each one alive, so that its id cannot be reused by another while the memo lives."""

    models: dict[int, ModelConfig] = field(default_factory=dict)
    chunks: dict[tuple, list[list[Chunk]]] = field(default_factory=dict)
    params: dict[tuple, tuple[RankParams, int]] = field(default_factory=dict)
    layer_flops: dict[tuple, dict[bool, dict[str, float]]] = field(default_factory=dict)
    chunk_bytes: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    # by the activation shapes (and policy) alone: the head's and an MTP module's saved bytes, what a layer of
    # each kind would save without recompute (the memory-bound traffic's)
    shape_bytes: dict[tuple, object] = field(default_factory=dict)

    def model_key(self, m: ModelConfig) -> int:
        self.models.setdefault(id(m), m)
        return id(m)


def _memoised(memo: PlanMemo | None, table: str, key: tuple, compute):
    """`compute()`, or with a memo its value under `key` in `memo.<table>`, computed once."""
    if memo is None:
        return compute()
    entries = getattr(memo, table)
    if key not in entries:
        entries[key] = compute()
    return entries[key]


@dataclass
class Plan:
    recipe: Recipe
    hardware: Hardware
    layout: PlanLayout
    assumptions: Assumptions
    ranks: list[RankPlan]
    worst: RankPlan
    model_flops_per_step: float
    executed_flops_per_step: float
    megatron_flops_per_step: float  # model FLOPs with causal attention over half of s x s (Megatron-Core's)
    time: dict[str, float] = field(default_factory=dict)
    time_rank: int = 0  # the pipeline rank whose step time is the step's (the slowest; `worst` is the fullest)
    # the time rank's dispatcher collectives per <group>/<op>: own seconds and what ep_overlap hides
    exposed_comm: dict[str, ExposedComm] = field(default_factory=dict)
    ep_phases: PairedPhases | None = None  # what the time rank's MoE layers hide their EP comm behind
    fp8_auto: bool = False  # train.fp8.recipe was auto (`recipe` holds what it resolved to on this GPU)
    # parallel.offload's copies on the host link of each planned pipeline rank (`offload_copies`), by rank
    offload_copies: dict[int, dict] = field(default_factory=dict)

    @property
    def device_memory(self) -> float:
        return float(self.hardware.memory_bytes)

    @property
    def peak(self) -> float:
        return self.worst.memory["total"]

    @property
    def fits(self) -> bool:
        return self.peak <= self.device_memory

    @property
    def tight(self) -> bool:
        """Fits, but within the memory margin of the device's capacity."""
        return self.fits and self.peak > self.device_memory * (1 - self.assumptions.memory_margin)

    @property
    def step_time(self) -> float:
        return self.time["step"]

    @property
    def tokens_per_s(self) -> float:
        return self.layout.global_batch * self.layout.seq_length / self.step_time

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops_per_step / self.step_time / self.layout.world_size / 1e12

    @property
    def tflops_per_gpu_megatron(self) -> float:
        """TFLOP/s per GPU as Megatron-Core reports it (its published figures): causal attention counts half
        of the s x s scores."""
        return self.megatron_flops_per_step / self.step_time / self.layout.world_size / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.hardware.bf16_flops if self.hardware.bf16_flops else 0.0


def _activation_layout(recipe: Recipe, layout: PlanLayout, a: Assumptions) -> ActivationLayout:
    return ActivationLayout(
        micro_batch=layout.micro_batch, seq_length=layout.seq_length,
        act_bytes=4 if recipe.train.precision == "fp32" else 2, tp=layout.tp,
        sequence_parallel=layout.sequence_parallel, cp=layout.cp, ep=layout.ep, etp=layout.etp,
        moe_imbalance=a.moe_imbalance, ep_nodes=layout.ep_split[0],
        # position ids per row with packed documents, and under cp (each row's shard has its own positions)
        position_batch=layout.micro_batch if recipe.data.reset_at_eod or layout.cp > 1 else 1,
        loss_chunk_tokens=layout.loss_chunk_tokens,
        documents=recipe.data.reset_at_eod, device=layout.device, fp8_gemms=layout.fp8_modules,
        **_fp8_kept(recipe),
    )


def _fp8_kept(recipe: Recipe) -> dict:
    """What the fp8 GEMMs keep for backward (train.fp8.saved_inputs), for ActivationLayout."""
    fp8 = recipe.train.fp8
    if recipe.train.precision != "fp8" or fp8.saved_inputs != "fp8":
        return {}
    return {"fp8_kept": fp8.recipe, "fp8_modules": tuple(sorted(set(fp8.modules)))}


# The train.fp8.modules kind each FLOP region's GEMMs belong to (models/fp8/select.py marks by these kinds); the
# router, core attention (SDPA) and MTP's eh_proj never run in fp8.
FP8_KIND = {"attention": "attention", "mla_down_proj": "attention", "mla_up_proj": "attention", "mlp": "mlp",
            "shared_experts": "shared_experts", "experts": "experts", "head": "head"}


def _kernel(region: str, fp8_modules: tuple[str, ...]) -> str:
    """The kind of kernel a region's FLOPs run on: attention, (fp8_)grouped_gemm, (fp8_)gemm."""
    if region == "core_attn":
        return "attention"
    kernel = "grouped_gemm" if region == "experts" else "gemm"
    return f"fp8_{kernel}" if FP8_KIND.get(region) in fp8_modules else kernel


def _layer_flops(m: ModelConfig, layout: PlanLayout, moe_layer: bool, a: Assumptions) -> dict[str, float]:
    """Forward FLOPs per token of the micro-batch that this rank runs for one layer, by region: sharded work
    divides by tp, MLA's replicated down projections only under SP (they run on the sequence region), routed
    experts scale by the stated imbalance (or, padded to capacity, by the padding)."""
    regions = dict(_regions_of(m, moe_layer, layout.seq_length, layout.device))
    tp = layout.tp
    out = {"attention": (regions["attention"] - regions.get("mla_down_proj", 0.0)) / tp,
           "mla_down_proj": regions.get("mla_down_proj", 0.0) / (tp if layout.sequence_parallel else 1),
           "core_attn": regions["core_attn"] / tp * executed_key_share(layout)}
    if "mla_up_proj" in regions:
        out["mla_up_proj"] = regions["mla_up_proj"] / tp  # part of `attention`
    for name in ("mlp", "router", "shared_experts"):
        if name in regions:
            out[name] = regions[name] / tp
    if "experts" in regions:
        # the rows the experts run per routed slot: the stated imbalance, or padded to capacity what pads them
        shapes = ActivationLayout(micro_batch=layout.micro_batch, seq_length=layout.seq_length, tp=tp,
                                  cp=layout.cp, ep=layout.ep, etp=layout.etp, moe_imbalance=a.moe_imbalance)
        padded = padded_capacity(m, shapes) is not None
        per_slot = (expert_rows(m, shapes) / (shapes.moe_tokens * m.moe.top_k * layout.etp) if padded
                    else a.moe_imbalance)
        out["experts"] = regions["experts"] / tp * per_slot
    return out


def executed_key_share(layout: PlanLayout) -> float:
    """The keys each query is scored against as the kernels run them, as a share of the sequence: a causal
    SDPA call (one rank's whole sequence, no document restarts) skips the masked pairs, (s + 1) / 2s of them
    kept; a masked call (document restarts) scores every pair; context parallelism's tiles `cp_key_share`."""
    if layout.cp > 1:
        return cp_key_share(layout.cp)
    return (layout.seq_length + 1) / (2 * layout.seq_length) if layout.causal_kernel else 1.0


def cp_key_share(cp: int) -> float:
    """Under context parallelism the keys each query token is scored against, as a share of the sequence (1
    at cp = 1, where SDPA is counted over every key): a rank's two query chunks of c = s / 2cp tokens are scored
    against 2cp + 1 chunk-by-chunk tiles, diagonals whole (parallel/ring_attention.py: the ring's three tiles at
    step 0 and two at each later step; the all-gather's r + 1 and 2cp - r chunks), (2cp + 1) c^2 for 2c queries."""
    return 1.0 if cp == 1 else (2 * cp + 1) / (4 * cp)


# Backward of attention written out through its log-sum-exp (context parallelism's tiles, gpt-oss's sinks and
# windows: models/blockwise_attention.py) against its forward (QK^T and PV): it recomputes QK^T and runs the
# dV, dP, dQ and dK products, 5 of the tile's GEMMs against 2 (SDPA's backward is counted as 2x its forward).
BLOCKWISE_ATTENTION_BACKWARD = 2.5


def _regions_of(m: ModelConfig, moe_layer: bool, seq: int, device: str) -> dict[str, float]:
    index = m.num_layers if moe_layer else 0  # an index past first_k_dense is MoE where the model has MoE
    return layer_flops_by_region(m, layer=index, seq_length=seq, executed=True,
                                 mla_value_padded=kernels_for(device).mla_value == "padded")


def _down_share(kind: str, fp8_modules: tuple[str, ...]) -> float:
    """The share of an MLP's FLOPs a recomputation ending with it runs again: gate and up, and the down projection
    too when it is an fp8 GEMM (its autograd Function saves its input after its product has run; a bf16 GEMM
    saves before, so the early stop comes first)."""
    return 1.0 if kind in fp8_modules else 2 / 3


def _selective_recompute(m: ModelConfig, flops: dict[str, float], modules: set[str], moe_layer: bool,
                         fp8_modules: tuple[str, ...] = ()) -> dict:
    """{region: FLOPs} that selective recompute runs again: each region up to its last saved tensor (the final
    down projection of an MLP is not re-run in bf16: nothing after it saves anything; `_down_share`)."""
    out: dict[str, float] = {}
    if "mla_up_proj" in modules and "mla_up_proj" in flops:
        out["mla_up_proj"], out["core_attn"] = flops["mla_up_proj"], flops["core_attn"]  # the region ends in SDPA
    elif "core_attn" in modules:
        out["core_attn"] = flops["core_attn"]
    if not moe_layer:
        if "mlp" in modules:
            out["mlp"] = flops["mlp"] * _down_share("mlp", fp8_modules)
        return out
    shared = flops.get("shared_experts", 0.0)
    if "moe" in modules:
        out["router"], out["experts"] = flops["router"], flops["experts"]
        out["shared_experts"] = shared  # they run before the dispatch: the routed experts save after them
    elif "shared_experts" in modules:
        out["shared_experts"] = shared * _down_share("shared_experts", fp8_modules)
    return out


def _group_tail(m: ModelConfig, flops: dict[str, float], moe_layer: bool,
                fp8_modules: tuple[str, ...] = ()) -> dict[str, float]:
    """What a recomputation ending with this layer does not re-run: everything after the last saved tensor."""
    if not moe_layer:
        return {"mlp": flops["mlp"] * (1 - _down_share("mlp", fp8_modules))}
    return {}  # the combine saves last (the shared experts ran before the dispatch): no GEMM after it


def _rank_flops(m: ModelConfig, layout: PlanLayout, chunks: list[Chunk], a: Assumptions,
                memo: PlanMemo | None = None) -> tuple[dict, dict]:
    """Executed FLOPs of one rank per step ({forward, backward, recompute, total}) and the same split by kind
    of kernel ({gemm, fp8_gemm, grouped_gemm, fp8_grouped_gemm, attention}, forward + backward + recompute) for
    the time model: the fp8 GEMMs are those of the kinds train.fp8.modules names (`layout.fp8_modules`)."""
    tokens = layout.micro_batches * layout.micro_batch * layout.seq_length / layout.cp  # this rank's share
    policy = layout.recompute
    fwd = dict.fromkeys(("gemm", "fp8_gemm", "grouped_gemm", "fp8_grouped_gemm", "attention"), 0.0)
    rec = dict(fwd)
    # what `_layer_flops` reads of the layout
    key = (memo and memo.model_key(m), layout.seq_length, layout.device, layout.tp, layout.sequence_parallel,
           layout.cp, layout.causal_kernel, layout.micro_batch, layout.ep, layout.etp, a.moe_imbalance)
    kinds = _memoised(memo, "layer_flops", key,
                      lambda: {moe: _layer_flops(m, layout, moe, a) for moe in {False, m.moe is not None}})
    # once per rank and kind of layer, as a layer of that kind first asks (`plan --search` plans thousands of
    # ranks): each region's kernel, what selective recompute reruns, what full recompute reruns (the whole
    # forward) and what a group's last layer does not
    kernel_of = {name: _kernel(name, layout.fp8_modules) for name in {*kinds[False], *kinds.get(True, ()),
                                                                         "head", "eh_proj"}}
    selective: dict[bool, dict[str, float]] = {}
    rerun = {moe: {k: v for k, v in regions.items() if k != "mla_up_proj"} for moe, regions in kinds.items()}
    tail: dict[bool, dict[str, float]] = {}

    def add(target: dict, regions: dict[str, float], times: float = 1.0) -> None:
        for name, value in regions.items():
            if name != "mla_up_proj" or target is rec:  # forward: part of `attention`
                if name not in kernel_of:  # a region only a recompute lists (with nothing to rerun, e.g. 0 FLOPs)
                    kernel_of[name] = _kernel(name, layout.fp8_modules)
                target[kernel_of[name]] += times * value * tokens

    def forward_layer(moe: bool, count: int = 1) -> None:
        add(fwd, kinds[moe], count)
        if policy.granularity == "selective":
            if moe not in selective:
                selective[moe] = _selective_recompute(m, kinds[moe], set(policy.modules), moe, layout.fp8_modules)
            add(rec, selective[moe], count)

    replicated = 1 if layout.sequence_parallel else layout.tp  # MTP's eh_proj runs on the sequence region
    head = 2.0 * m.hidden_size * m.padded_vocab_size() / layout.tp  # executed: the padding columns too
    for chunk in chunks:
        for moe, count in ((True, chunk.moe_layers), (False, len(chunk.layers) - chunk.moe_layers)):
            if count:
                forward_layer(moe, count)
        if policy.granularity == "full":
            for group in recompute_groups(chunk.layers, policy):
                moe_layers = sum(m.is_moe_layer(i) for i in group)
                for moe, count in ((True, moe_layers), (False, len(group) - moe_layers)):
                    if count:
                        add(rec, rerun[moe], count)
                last = m.is_moe_layer(group[-1])
                if last not in tail:
                    tail[last] = _group_tail(m, kinds[last], last, layout.fp8_modules)
                add(rec, tail[last], -1.0)
        # the chunked loss computes each chunk's logits again in backward (models/linear.py)
        heads = chunk.loss + chunk.mtp
        if chunk.loss:
            add(fwd, {"head": head})
        for _ in range(chunk.mtp):
            forward_layer(m.moe is not None)
            add(fwd, {"eh_proj": 2.0 * 2 * m.hidden_size * m.hidden_size / layout.tp * replicated, "head": head})
        if layout.loss_chunk_tokens and heads:
            add(rec, {"head": head}, heads)
    forward = sum(fwd.values())
    recompute = sum(rec.values())
    # blockwise attention's backward (context parallelism, gpt-oss) is 2.5x its forward where everything else is 2x
    blockwise = layout.cp > 1 or layout.blockwise_attention
    extra = (BLOCKWISE_ATTENTION_BACKWARD - 2) * fwd["attention"] if blockwise else 0.0
    split = {k: 3 * fwd[k] + rec[k] + (extra if k == "attention" else 0.0) for k in fwd}
    return {"forward": forward, "backward": 2 * forward + extra, "recompute": recompute,
            "total": 3 * forward + extra + recompute}, split


def _plan_rank(recipe: Recipe, layout: PlanLayout, assumptions: Assumptions, rank: int, chunks: list[Chunk], *,
               detail: bool = True, comm: bool = True, memo: PlanMemo | None = None) -> RankPlan:
    """One pipeline rank's memory, FLOPs, communication and host waits; `detail` adds the bytes per layer;
    without `comm` no communication (a lower bound of the step time: `plan --search` prunes by it)."""
    model = recipe.model
    shapes = _activation_layout(recipe, layout, assumptions)
    # what `rank_params` reads: the sharding and each chunk's shape (its layers' kinds, MTP, embedding, head)
    key = (memo and memo.model_key(model), layout.dps, layout.cp, layout.sequence_parallel, layout.tp, layout.ep,
           layout.etp, layout.experts_apart, layout.edps, layout.pp > 1,
           tuple((c.moe_layers, len(c.layers), c.mtp, c.embedding, c.loss) for c in chunks))
    params, local = _memoised(memo, "params", key, lambda: _with_local(rank_params(model, layout, chunks)))
    param_bytes = PARAM_BYTES[recipe.train.precision]
    activations, transient = _activation_bytes(model, shapes, layout, rank, chunks, memo)
    offloaded = _offloaded_per_layer(model, shapes, layout.recompute, chunks)
    memory = {
        "weights": MASTER_BYTES * local,
        "grads": GRAD_BYTES * local,
        "optimizer": _optimizer_bytes(recipe, params, local),
        "activations": activations,
        "buffers": _buffer_bytes(recipe, shapes, layout, assumptions, chunks, params, param_bytes, transient)
        + OFFLOAD_LAYERS_BACK * max(offloaded.values(), default=0.0),
    }
    memory["total"] = sum(memory.values())
    per_layer = _bytes_per_layer(model, shapes, layout.recompute, chunks) if detail else {}
    flops, split = _rank_flops(model, layout, chunks, assumptions, memo)
    # Muon's Newton-Schulz products: the optimizer's, outside the model's `total` (measure's flops.optimizer)
    train = recipe.train
    flops["optimizer"] = muon_flops(params, layout, steps=train.muon.ns_steps) if train.optimizer == "muon" else 0
    host = sum(sum(offloaded.get(i, 0.0) for i in _chunk_offload_keys(model, chunks, c)) * count
               for c, count in zip(chunks, in_flight(layout, rank), strict=False))
    bound = RankPlan(rank, params, memory, per_layer, flops, split, CommBytes(),
                     _elementwise_bytes(model, shapes, layout, chunks, assumptions, memo),
                     _moe_sync(model, layout, chunks, assumptions), offloaded_bytes_per_layer=offloaded,
                     host_bytes=host, local_params=local, chunks=chunks)
    return _with_comm(bound, recipe, layout, assumptions, chunks) if comm else bound


def _with_local(params: RankParams) -> tuple[RankParams, int]:
    return params, params.local  # a sum over the rank's units: once


def _with_comm(bound: RankPlan, recipe: Recipe, layout: PlanLayout, assumptions: Assumptions,
               chunks: list[Chunk]) -> RankPlan:
    """The rank planned without communication (`_plan_rank`'s comm False) with its communication added: the
    bytes of its collectives, its dispatchers' forward bytes and one MoE layer's work (what they hide behind);
    nothing else of the rank depends on them."""
    shapes = _activation_layout(recipe, layout, assumptions)
    counted = CommBytes.for_rank(recipe, layout, shapes, chunks, bound.params, PARAM_BYTES[recipe.train.precision],
                                 assumptions)
    return replace(bound, comm=counted, dispatch_forward=dispatch_forward(recipe, layout, shapes, chunks),
                   moe_layer=_moe_layer_work(recipe.model, layout, shapes, chunks, assumptions))


# An offloaded layer's saves are on the device again while its backward runs, and so are those of the layer before
# it, whose copy back runs meanwhile (parallel/offload.py prefetches one layer ahead): two layers' worth at a time.
OFFLOAD_LAYERS_BACK = 2


def _offloaded_per_layer(model: ModelConfig, shapes: ActivationLayout, policy: RecomputePolicy,
                         chunks: list[Chunk]) -> dict[int, float]:
    """{layer: bytes one micro-batch's forward moves to the host pool} for the rank's layers and MTP modules
    (numbered after the decoder layers, as measure numbers them); {} without offloading."""
    if not policy.offload:
        return {}
    out: dict[int, float] = {}
    mtp_index = model.num_layers
    for chunk in chunks:
        out.update({i: layer_offloaded_bytes(model, shapes, layer_index=i, policy=policy) for i in chunk.layers})
        for _ in range(chunk.mtp):
            out[mtp_index] = mtp_offloaded_bytes(model, shapes, policy)
            mtp_index += 1
    return out


def _chunk_offload_keys(model: ModelConfig, chunks: list[Chunk], chunk: Chunk) -> list[int]:
    """The keys of `_offloaded_per_layer` that belong to `chunk`: its layers and its MTP modules' numbers."""
    first_mtp = model.num_layers + sum(c.mtp for c in chunks[: chunks.index(chunk)])
    return [*chunk.layers, *range(first_mtp, first_mtp + chunk.mtp)]


def _moe_layer_work(model: ModelConfig, layout: PlanLayout, shapes: ActivationLayout, chunks: list[Chunk],
                    a: Assumptions) -> MoeLayerWork | None:
    """One MoE layer's work in one micro-batch, as `_rank_flops` and `_elementwise_bytes` count it for the
    step: forward, then backward (2x forward, context-parallel attention 2.5x) with the layer's recomputation
    (selective: its regions; full: its forward again)."""
    count = sum(c.moe_layers + c.mtp for c in chunks)
    if model.moe is None or count == 0:
        return None
    tokens = layout.micro_batch * layout.seq_length / layout.cp
    regions = _layer_flops(model, layout, True, a)
    policy = layout.recompute
    if policy.granularity == "selective":
        rerun = _selective_recompute(model, regions, set(policy.modules), True, layout.fp8_modules)
    else:
        rerun = {k: v for k, v in regions.items() if k != "mla_up_proj"} if policy.granularity == "full" else {}
    forward: dict[str, float] = {}
    backward: dict[str, float] = {}
    for name, value in regions.items():
        if name != "mla_up_proj":  # part of `attention` in the forward
            kernel = _kernel(name, layout.fp8_modules)
            forward[kernel] = forward.get(kernel, 0.0) + value * tokens
    extra = BLOCKWISE_ATTENTION_BACKWARD - 2 if layout.cp > 1 or layout.blockwise_attention else 0.0
    for kernel, value in forward.items():
        backward[kernel] = (2 + (extra if kernel == "attention" else 0.0)) * value
    for name, value in rerun.items():
        kernel = _kernel(name, layout.fp8_modules)
        backward[kernel] = backward.get(kernel, 0.0) + value * tokens
    saved = layer_activation_bytes(model, shapes, layer_index=model.num_layers)
    return MoeLayerWork(forward, backward, a.elementwise_traffic_per_saved_byte * saved, count)


def _optimizer_bytes(recipe: Recipe, params: RankParams, local: int) -> int:
    """The optimizer state of the rank's FSDP2 shards: AdamW's two moments per element, or under Muon one
    momentum buffer for Muon's matrices and AdamW's two for the rest, each in train.adam_moment_dtype (AdamW's
    step scalars, 4 bytes a tensor, are left out)."""
    moments = ADAM_BYTES[recipe.train.adam_moment_dtype] * local
    if recipe.train.optimizer != "muon":
        return moments
    muon = sum(unit.count * fsdp_rows(t.shape[0], unit.shards)[0] * (t.numel // t.shape[0])
               for unit in params.units for t in unit.tensors if muon_trained(t))
    return moments - ADAM_BYTES[recipe.train.adam_moment_dtype] // 2 * muon


def _activation_bytes(model: ModelConfig, shapes: ActivationLayout, layout: PlanLayout, rank: int,
                      chunks: list[Chunk], memo: PlanMemo | None = None) -> tuple[float, float]:
    """(bytes the rank keeps for backward at its peak: each chunk's, its head's and its MTP modules' times the
    micro-batches in flight there, the shared storages once per micro-batch in flight; the largest transient
    extra of a recomputed group's backward)."""
    activations = transient = 0.0
    counts = in_flight(layout, rank)
    policy = layout.recompute
    for chunk, count in zip(chunks, counts, strict=False):
        # a chunk's bytes depend on its layers only through which are MoE (and, full recompute, their order)
        key = (memo and memo.model_key(model), shapes, policy, tuple(map(model.is_moe_layer, chunk.layers)))
        kept, extra = _memoised(memo, "chunk_bytes", key,
                                lambda chunk=chunk: chunk_activation_bytes(model, shapes, chunk, policy))
        activations += kept * count
        transient = max(transient, extra)
        if chunk.loss:
            activations += _memoised(memo, "shape_bytes", ("head", *key[:2]),
                                     lambda: head_activation_bytes(model, shapes, vocab_parallel=True)) * count
        if chunk.mtp:
            activations += chunk.mtp * _memoised(memo, "shape_bytes", ("mtp", *key[:3]),
                                                 lambda: mtp_activation_bytes(model, shapes, policy)) * count
    activations += other_activation_bytes(model, shapes) * max(counts)
    return activations, transient


def _bytes_per_layer(model: ModelConfig, shapes: ActivationLayout, policy: RecomputePolicy,
                     chunks: list[Chunk]) -> dict[int, float]:
    """{layer: bytes one micro-batch keeps for it}, MTP modules numbered after the decoder layers as measure
    numbers them: what `measure` reports per layer."""
    kind_bytes = {moe: layer_activation_bytes(model, shapes, layer_index=model.num_layers if moe else 0,
                                              policy=policy) for moe in (False, True)}
    per_layer: dict[int, float] = {}
    mtp_index = model.num_layers
    for chunk in chunks:
        if policy.granularity == "full":
            per_layer.update(full_recompute_bytes(model, shapes, chunk.layers, policy)[0])
        else:
            per_layer.update({index: kind_bytes[model.is_moe_layer(index)] for index in chunk.layers})
        for _ in range(chunk.mtp):
            per_layer[mtp_index] = mtp_module_bytes(model, shapes, policy)
            mtp_index += 1
    return per_layer


def _buffer_bytes(recipe: Recipe, shapes: ActivationLayout, layout: PlanLayout, assumptions: Assumptions,
                  chunks: list[Chunk], params: RankParams, param_bytes: int, recompute_transient: float) -> float:
    """Memory beside weights, optimizer and saved activations: the runtime reserve, FSDP's unsharded units and
    gradient buffers, and the largest transient (a MoE dispatch, the loss's logits, a recomputed group)."""
    model = recipe.model
    stage = params.dense + params.experts
    several, parallel = layout.micro_batches > 1, recipe.parallel
    # Reduced once per step (pipelined or not), each unit's unsharded fp32 gradient lives from its first backward
    # to the step's last, while its fp32 shard (the `grads` figure) exists only from that last reduction on:
    # at the peak the rank holds the unsharded gradients instead of the shards, so the buffer is what they hold
    # beyond the shards. Reduced in every backward (per_microbatch), the shards accumulate over the step and one
    # unit's unsharded gradient lives while it reduces.
    held = GRAD_BYTES * (stage - params.local) if several and parallel.grad_reduce == "per_step" else 0.0
    fp8 = fp8_gathered_kinds(recipe)  # gathered at 1 byte, not param_bytes
    saved = param_bytes - 1
    if (layout.pp > 1 or parallel.gathers_per_step) and several:
        # the stage stays gathered (parameter dtype) over the step
        gathered = param_bytes * stage - saved * params.fp8_elements(fp8)
        fsdp = gathered + (held or GRAD_BYTES * params.largest_unit)
    else:
        largest = param_bytes * params.largest_unit - saved * sum(params.largest_gemms.get(kind, 0) for kind in fp8)
        fsdp = assumptions.fsdp_prefetch_units * largest + GRAD_BYTES * params.largest_unit + held
    dispatch = 0.0
    if model.moe is not None and any(c.moe_layers for c in chunks):
        # permuted tokens and the received rows of one layer, live during its dispatch and combine
        dispatch = 2 * shapes.act_bytes * expert_rows(model, shapes) * model.hidden_size
    loss_transient = 0.0
    if any(c.loss for c in chunks):
        # the logits and their fp32 copy; chunked, one chunk's at a time (with its gradient in the activation dtype)
        rows = min(shapes.tokens, layout.loss_chunk_tokens) if layout.loss_chunk_tokens else shapes.tokens
        extra = shapes.act_bytes if layout.loss_chunk_tokens else 0
        loss_transient = (shapes.act_bytes + 4 + extra) * rows * model.padded_vocab_size() / layout.tp
    return assumptions.runtime_reserve_bytes + fsdp + max(dispatch, loss_transient, recompute_transient)


def _elementwise_bytes(model: ModelConfig, shapes: ActivationLayout, layout: PlanLayout, chunks: list[Chunk],
                       assumptions: Assumptions, memo: PlanMemo | None = None) -> float:
    """Memory-bound traffic per step: what the rank's layers would save without recompute, over every
    micro-batch, times the stated traffic per saved byte. The routed experts' silu(gate) and unweighted product
    count as saved: the weighted SwiGLU forms them again in backward instead of keeping them
    (models/moe/weighted_swiglu.py), the same memory-bound work either way."""
    kinds = _memoised(memo, "shape_bytes", ("traffic", memo and memo.model_key(model), shapes),
                      lambda: _traffic_kinds(model, shapes))
    saved = sum(kinds[True] * c.moe_layers + kinds[False] * (len(c.layers) - c.moe_layers) for c in chunks)
    return assumptions.elementwise_traffic_per_saved_byte * saved * layout.micro_batches


def _traffic_kinds(model: ModelConfig, shapes: ActivationLayout) -> dict[bool, float]:
    """{MoE layer: bytes a layer of that kind would save without recompute, the experts' re-formed SwiGLU
    products too}: `_elementwise_bytes`'s per layer."""
    kinds = {moe: layer_activation_bytes(model, shapes, layer_index=model.num_layers if moe else 0)
             for moe in (False, True)}
    if model.moe is not None:
        kinds[True] += 2 * shapes.act_bytes * expert_rows(model, shapes) * model.moe.ffn_hidden_size / shapes.etp
    return kinds


def _moe_sync(model: ModelConfig, layout: PlanLayout, chunks: list[Chunk], assumptions: Assumptions) -> float:
    """Seconds per step the host waits on MoE token counts: once per MoE forward (recompute runs it again)."""
    moe_forwards = 2 if layout.recompute.granularity == "full" or "moe" in layout.recompute.modules else 1
    moe_layers = sum(c.moe_layers + c.mtp * (model.moe is not None) for c in chunks)
    return assumptions.moe_sync_s * moe_layers * moe_forwards * layout.micro_batches


def _compute_seconds(split: dict[str, float], hw: Hardware, a: Assumptions) -> float:
    """Seconds of FLOPs by kind of kernel ({gemm, fp8_gemm, grouped_gemm, fp8_grouped_gemm, attention}) at each
    kind's achieved fraction of the peak."""
    fp8_peak = hw.bf16_flops * a.fp8_gemm_speedup
    return ((split.get("gemm", 0.0) / hw.bf16_flops + split.get("fp8_gemm", 0.0) / fp8_peak) / a.gemm_efficiency
            + (split.get("grouped_gemm", 0.0) / hw.bf16_flops + split.get("fp8_grouped_gemm", 0.0) / fp8_peak)
            / a.grouped_gemm_efficiency
            + split.get("attention", 0.0) / (hw.bf16_flops * a.attention_efficiency))


def paired_phases(recipe: Recipe, layout: PlanLayout, work: MoeLayerWork | None, hw: Hardware,
                  a: Assumptions, *, rank: int = 0) -> PairedPhases | None:
    """What one MoE layer's EP communication hides behind under the recipe's `parallel.ep_overlap`: one MoE
    layer's compute and memory-bound seconds in a micro-batch's forward (a third of its memory-bound traffic:
    each saved byte written and read forward, its gradient and the re-reads backward) and backward; under
    `parallel.split_wgrad` its routed experts' weight-gradient seconds (plan/overlap.py). `rank`: the pipeline
    rank, whose schedule decides which passes are paired."""
    if work is None:
        return None
    elementwise = work.elementwise_bytes / hw.hbm_bytes_per_s
    # split_wgrad: the routed experts' weight gradients, their forward's grouped GEMMs again; in fp8 too at the
    # compute dtype's rate (the experts' fp8 weight gradient runs emulated everywhere: models/fp8/gemm.py)
    delayed = work.forward.get("grouped_gemm", 0.0) + work.forward.get("fp8_grouped_gemm", 0.0)
    delayed = delayed if recipe.parallel.split_wgrad else 0.0
    return PairedPhases(micro_batches=layout.micro_batches, overlapped=recipe.parallel.ep_overlap,
                        forward_compute_s=_compute_seconds(work.forward, hw, a) + elementwise / 3,
                        backward_compute_s=_compute_seconds(work.backward, hw, a) + 2 * elementwise / 3,
                        delayed_wgrad_s=_compute_seconds({"grouped_gemm": delayed}, hw, a),
                        paired_passes=overlapped_pairs(pp=layout.pp, rank=rank, micro_batches=layout.micro_batches)
                        if layout.pp > 1 and recipe.parallel.ep_overlap else None)


def _exposed_comm(plan_rank: RankPlan, phases: PairedPhases | None, layout: PlanLayout, hw: Hardware,
                  a: Assumptions, seconds: dict[str, float]) -> dict[str, ExposedComm]:
    """The rank's dispatcher collectives per <group>/<op> (the keys of its forwards' dispatch bytes): their own
    seconds per step (`seconds`: comm_time's) and the part ep_overlap's pairs hide (plan/overlap.py)."""
    if phases is None or plan_rank.moe_layer is None or not plan_rank.dispatch_forward.bus:
        return {}
    forward = comm_time(plan_rank.dispatch_forward, layout, hw, a)["total"]
    own = {key: seconds[key] for key in forward}
    return exposed_comm(own, forward, phases, layers=plan_rank.moe_layer.count)


def offload_copies(m: ModelConfig, layout: PlanLayout, hw: Hardware, a: Assumptions,
                   plan_rank: RankPlan) -> dict:
    """The copies of activation offloading on the host link, per layer of one micro-batch: `copy_s` (its
    offloaded bytes one way at `hw.host_link_bytes_per_s`), `forward_s` (the layer's forward compute, behind which
    its copy out runs: the pool copies a layer's saves out while the next layer computes) and `backward_s` (twice
    that, behind which the copy back of the layer before it runs: the pool prefetches one layer ahead). The
    link is full duplex, so the two directions do not share it. `exposed_s`: per step, every micro-batch's
    excess of each copy over the compute it hides behind; None where the hardware table has no host link."""
    link = hw.host_link_bytes_per_s
    tokens = layout.micro_batch * layout.seq_length / layout.cp
    seconds: dict[bool, float] = {}
    for moe in {m.is_moe_layer(i) for i in plan_rank.offloaded_bytes_per_layer}:
        split: dict[str, float] = {}
        for region, flops in _layer_flops(m, layout, moe, a).items():
            if region != "mla_up_proj":  # part of `attention`
                kernel = _kernel(region, layout.fp8_modules)
                split[kernel] = split.get(kernel, 0.0) + flops * tokens
        seconds[moe] = _compute_seconds(split, hw, a)
    layers, exposed = {}, 0.0
    for layer, moved in plan_rank.offloaded_bytes_per_layer.items():
        if not moved:
            continue
        forward = seconds[m.is_moe_layer(layer)]
        copy = moved / link if link else None
        layers[layer] = {"bytes": moved, "copy_s": copy, "forward_s": forward, "backward_s": 2 * forward}
        if copy is not None:
            exposed += max(0.0, copy - forward) + max(0.0, copy - 2 * forward)
    return {"host_link_bytes_per_s": link, "per_layer": layers,
            "exposed_s": exposed * layout.micro_batches if link else None}


def _time(plan_rank: RankPlan, layout: PlanLayout, hw: Hardware, a: Assumptions, local_params: float,
          phases: PairedPhases | None = None,
          offload_exposed: float = 0.0) -> tuple[dict[str, float], dict[str, ExposedComm]]:
    """The step time's parts, and the dispatcher collectives' own and hidden seconds."""
    compute = _compute_seconds(plan_rank.flops_split, hw, a)
    elementwise = plan_rank.elementwise_bytes / hw.hbm_bytes_per_s
    comm = comm_time(plan_rank.comm, layout, hw, a)
    comm_total = sum(comm["total"].values())
    dispatch = _exposed_comm(plan_rank, phases, layout, hw, a, comm["total"])
    # ep_overlap hides the dispatchers' collectives behind the paired micro-batch's compute, at most that
    # compute (plan/overlap.py); the assumed overlap fractions hide the other collectives (their own streams:
    # FSDP2's, the pipeline's) behind the rank's compute, at most all of it (docs/plan.md, "Step time")
    ep_hidden = sum(c.hidden_s for c in dispatch.values())
    exposed = comm_total - ep_hidden - min(sum(comm["hideable"].values()), compute + elementwise)
    busy = compute + elementwise + exposed + plan_rank.moe_sync + offload_exposed
    bubble = busy * (layout.pp - 1) / (layout.vpp * layout.micro_batches) if layout.pp > 1 else 0.0
    if layout.pp > 1 and layout.pp_schedule == "dualpipev":  # its own order's idle time (plan/overlap.py)
        bubble = busy * dualpipev_bubble(pp=layout.pp, micro_batches=layout.micro_batches)
    optimizer = a.optimizer_bytes_per_param * local_params / hw.hbm_bytes_per_s
    return {"compute": compute, "elementwise": elementwise, "comm_exposed": exposed, "comm_total": comm_total,
            "ep_comm_hidden": ep_hidden, "moe_sync": plan_rank.moe_sync, "offload_exposed": offload_exposed,
            "bubble": bubble,
            "optimizer": optimizer, "step": busy + bubble + optimizer}, dispatch


def _candidate_ranks(per_rank: list[list[Chunk]]) -> list[int]:
    """The pipeline ranks that can be the most loaded: the first (most micro-batches in flight), the last (head,
    loss, MTP) and those holding the most layers."""
    most = max(sum(len(c.layers) for c in chunks) for chunks in per_rank)
    heavy = [r for r, chunks in enumerate(per_rank) if sum(len(c.layers) for c in chunks) == most]
    return sorted({0, len(per_rank) - 1, *heavy[:1], *heavy[-1:]})


def estimate(recipe: Recipe, hardware: Hardware, assumptions: Assumptions | None = None, *,
             every_rank: bool = True, comm: bool = True, memo: PlanMemo | None = None) -> Plan:
    """Plan `recipe` (its layout, batch and precision) on `hardware`. `every_rank` False plans only the
    pipeline ranks that can be the most loaded (what `--search` needs); `comm` False leaves communication out,
    so the step time is a lower bound (communication only adds to it) and the memory is the plan's. `memo`:
    figures shared with the other plans made with it (`PlanMemo`: one search's), the same results."""
    a = assumptions or Assumptions()
    # train.fp8.recipe auto: what this GPU runs (the engine resolves it from the device the same way)
    auto = recipe.train.fp8.recipe == "auto"
    recipe = with_fp8_resolved(recipe, capability=hardware.compute_capability, from_table=False)
    m = recipe.model
    layout = PlanLayout.from_recipe(recipe)
    # a V (dualpipev) places the stages on other ranks than the interleaved order does
    per_rank = _memoised(memo, "chunks", (memo and memo.model_key(m), layout.pp, layout.vpp, layout.pp_layout,
                                          layout.pp_schedule == "dualpipev"), lambda: rank_chunks(layout, m))
    indices = range(len(per_rank)) if every_rank else _candidate_ranks(per_rank)
    ranks = [_plan_rank(recipe, layout, a, r, per_rank[r], detail=every_rank, comm=comm, memo=memo)
             for r in indices]
    return _assembled(recipe, hardware, layout, a, ranks, [_rank_time(recipe, layout, hardware, a, r) for r in ranks],
                      every_rank=every_rank, auto=auto)


def with_communication(bound: Plan, *, slower_than: float | None = None) -> Plan | None:
    """The plan `estimate(..., every_rank=False)` gives, from that call's plan without communication (`comm`
    False): its ranks' memory and FLOPs kept, their communication added (`plan --search` plans whole only the
    layouts whose bound can still enter its best). With `slower_than`: None as soon as one rank's step time
    reaches it (the step is the slowest rank's, so the whole plan's would too), the rank slowest without
    communication first, and before its whole communication the cheaper bound of its dispatchers' forwards
    (`_forwards_bound`)."""
    recipe, layout, a, hw = bound.recipe, bound.layout, bound.assumptions, bound.hardware
    order = sorted(range(len(bound.ranks)), key=lambda i: bound.ranks[i].rank != bound.time_rank)
    ranks: list[RankPlan | None] = [None] * len(bound.ranks)
    timed: list[tuple | None] = [None] * len(bound.ranks)
    for i in order:
        if slower_than is not None and _forwards_bound(bound.ranks[i], recipe, layout, hw, a) >= slower_than:
            return None
        rank = _with_comm(bound.ranks[i], recipe, layout, a, bound.ranks[i].chunks)
        ranks[i], timed[i] = rank, _rank_time(recipe, layout, hw, a, rank)
        if slower_than is not None and timed[i][2][0]["step"] >= slower_than:
            return None
    return _assembled(recipe, hw, layout, a, ranks, timed, every_rank=False, auto=bound.fp8_auto)


def _forwards_bound(bound: RankPlan, recipe: Recipe, layout: PlanLayout, hw: Hardware, a: Assumptions) -> float:
    """A lower bound of the rank's step time with its communication, from the dispatchers' forward bytes alone
    (a share of its collectives' bytes, under the same keys): without ep_overlap and split_wgrad nothing hides
    the dispatchers' collectives (comm_time hides none of an EP group's), so those seconds are exposed whatever
    the rest adds, and adding bytes never lowers `_time`'s exposed seconds (each key's hideable part is at most
    its own). 0 where something could hide them."""
    if recipe.model.moe is None or recipe.parallel.ep_overlap or recipe.parallel.split_wgrad:
        return 0.0
    shapes = _activation_layout(recipe, layout, a)
    forwards = replace(bound, comm=dispatch_forward(recipe, layout, shapes, bound.chunks))
    return _time(forwards, layout, hw, a, bound.local_params)[0]["step"]


def _rank_time(recipe: Recipe, layout: PlanLayout, hw: Hardware, a: Assumptions, rank: RankPlan) -> tuple:
    """(what the rank's MoE layers hide their EP comm behind, its offloading's copies, `_time`'s parts and
    dispatcher collectives)."""
    phases = paired_phases(recipe, layout, rank.moe_layer, hw, a, rank=rank.rank)
    copies = offload_copies(recipe.model, layout, hw, a, rank)
    return phases, copies, _time(rank, layout, hw, a, rank.local_params, phases, copies["exposed_s"] or 0.0)


def _assembled(recipe: Recipe, hardware: Hardware, layout: PlanLayout, a: Assumptions, ranks: list[RankPlan],
               timed: list[tuple], *, every_rank: bool, auto: bool) -> Plan:
    """The Plan of the planned `ranks` and their `_rank_time`s: the fullest rank's memory, the slowest's time."""
    m = recipe.model
    tokens = layout.global_batch * layout.seq_length
    model_flops = 3 * forward_flops_per_token(m, seq_length=layout.seq_length) * tokens
    megatron_flops = 3 * forward_flops_per_token(m, seq_length=layout.seq_length, causal=True) * tokens
    # executed FLOPs of the whole step: every pipeline rank's, times the ranks of its stage
    if every_rank:
        executed = sum(r.flops["total"] for r in ranks) * layout.ranks_per_stage
    else:  # the planned ranks stand for all (search ranks layouts; it does not report executed FLOPs)
        executed = sum(r.flops["total"] for r in ranks) * layout.pp / len(ranks) * layout.ranks_per_stage
    phases, copies, times = zip(*timed, strict=True)
    worst = max(ranks, key=lambda r: r.memory["total"])
    slowest = max(range(len(ranks)), key=lambda i: times[i][0]["step"])
    return Plan(recipe, hardware, layout, a, ranks, worst, model_flops, executed, megatron_flops,
                time=times[slowest][0], time_rank=ranks[slowest].rank, fp8_auto=auto,
                exposed_comm=times[slowest][1], ep_phases=phases[slowest],
                offload_copies={r.rank: c for r, c in zip(ranks, copies, strict=True)})


def _gathered_bytes(recipe: Recipe, layout: PlanLayout, rank: RankPlan) -> int:
    """FSDP2's gathered parameters of the rank, every unit's (measure's `gathered_param_bytes`): none where
    FSDP2 is not applied (one fp32 process, parallel/data_parallel.py)."""
    if layout.world_size == 1 and recipe.train.precision == "fp32":
        return 0
    return rank.params.gathered_bytes(PARAM_BYTES[recipe.train.precision], fp8_gathered_kinds(recipe))


def _routing(recipe: Recipe, layout: PlanLayout) -> dict | None:
    """The spread the plan prices (config/routing_shapes.py): distinct nodes and ranks a token needs in
    expectation under the model's router, and the nodes of the forced pattern measure routes by and the
    hierarchical dispatcher's bytes follow (its integer version for this micro-batch)."""
    moe = recipe.model.moe
    if moe is None:
        return None
    nodes = layout.ep_split[0] if moe.dispatcher == "hierarchical" else 1
    spread = ForcedRouting.of(moe, nodes)
    tokens = int(_activation_layout(recipe, layout, Assumptions()).moe_tokens)
    ranks = layout.ep if moe.num_experts % layout.ep == 0 and _nests(moe, layout.ep) else 1
    return {"nodes": nodes,
            "expected_nodes": sum(d * p for d, p in enumerate(spread.histogram())),
            "forced_nodes": spread.mean_spread(tokens),
            "expected_ranks": sum(d * p for d, p in enumerate(ForcedRouting.of(moe, ranks).histogram()))}


def _nests(moe, domains: int) -> bool:
    groups = moe.router.num_groups or 1
    return groups % domains == 0 or domains % groups == 0


def _offload_json(plan: Plan, rank: RankPlan) -> dict | None:
    """parallel.offload's figures for `rank` (None without offloading): what the host pool holds at the rank's
    peak and the copies on the host link (`offload_copies`)."""
    regions = plan.layout.recompute.offload
    if not regions:
        return None
    copies = plan.offload_copies[rank.rank]
    return {"modules": list(regions), "host_bytes": int(rank.host_bytes),
            "host_link_bytes_per_s": copies["host_link_bytes_per_s"], "exposed_s": copies["exposed_s"],
            "per_layer": {str(k): {**v, "bytes": int(v["bytes"])} for k, v in copies["per_layer"].items()}}


def plan_json(plan: Plan, *, pipeline_rank: int | None = None) -> dict:
    """The JSON of `moe-train plan --json` (docs/interfaces.md, plus extra keys): the most loaded rank's figures,
    or those of a rank of pipeline stage `pipeline_rank` (what `measure --rank` of that stage is held to)."""
    w = plan.worst if pipeline_rank is None else next(r for r in plan.ranks if r.rank == pipeline_rank)
    layout = plan.layout
    return {
        "gpu": plan.hardware.id,
        "world_size": layout.world_size,
        "rank": {"pp": w.rank, "dp": 0, "cp": 0, "tp": 0},
        "memory_bytes": {k: int(v) for k, v in w.memory.items()},
        "device_memory_bytes": int(plan.device_memory),
        "fits": plan.fits,
        "within_margin": plan.tight,
        "flops_per_step": w.flops["total"],
        "flops": w.flops,
        # the fp8 GEMMs' share of flops.total (measure's fp8_gemm_flops): what fp8_gemm_speedup applies to
        "fp8_gemm_flops": w.flops_split["fp8_gemm"] + w.flops_split["fp8_grouped_gemm"],
        "model_flops_per_step": plan.model_flops_per_step,
        "executed_flops_per_step": plan.executed_flops_per_step,
        "comm_bytes": {k: int(v) for k, v in sorted(w.comm.payload.items())},
        "comm_bus_bytes": {k: int(v) for k, v in sorted(w.comm.bus.items())},
        "comm_links": w.comm.links(layout, plan.hardware),
        "activation_bytes_per_layer": {str(k): int(v) for k, v in w.activation_bytes_per_layer.items()},
        "offloaded_bytes_per_layer": {str(k): int(v) for k, v in w.offloaded_bytes_per_layer.items()},
        "offload": _offload_json(plan, w),
        "params": {"dense_per_rank": int(w.params.dense), "experts_per_rank": int(w.params.experts),
                   "local_after_fsdp": w.params.local, "gathered_bytes": _gathered_bytes(plan.recipe, layout, w)},
        "layout": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp, "dp": layout.dp,
                   "ep": layout.ep, "etp": layout.etp, "edp": layout.edp, "dp_replicate": layout.dpr,
                   "sequence_parallel": layout.sequence_parallel, "micro_batch_size": layout.micro_batch,
                   "micro_batches": layout.micro_batches, "recompute": layout.recompute.granularity,
                   "recompute_modules": list(layout.recompute.modules)},
        "step_time_s": plan.step_time,
        "time_s": plan.time,
        # the time rank's dispatcher collectives: own seconds, what ep_overlap hides (measure's exposed_comm keys)
        "exposed_comm": {key: c.to_json() for key, c in plan.exposed_comm.items()},
        "time_rank": {"pp": plan.time_rank, "dp": 0, "cp": 0, "tp": 0},
        "tokens_per_s": plan.tokens_per_s,
        "tflops_per_gpu": plan.tflops_per_gpu,
        "tflops_per_gpu_megatron": plan.tflops_per_gpu_megatron,
        "megatron_flops_per_step": plan.megatron_flops_per_step,
        "routing": _routing(plan.recipe, layout),
        "fp8_recipe": plan.recipe.train.fp8.recipe if plan.recipe.train.precision == "fp8" else None,
        "mfu": plan.mfu,
        "assumptions": plan.assumptions.to_dict(),
    }
