"""The plan of one recipe on one cluster: memory of the most loaded rank, FLOPs, communication and step time.

Each pipeline rank is planned (ranks of one stage are alike under even routing); the reported rank is the one
with the highest peak memory, and the step time is the slowest rank's. Formulas: docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_train.config.hardware import Hardware
from moe_train.config.schema import ModelConfig, Recipe

from .activations import (
    ActivationLayout,
    chunk_activation_bytes,
    expert_rows,
    head_activation_bytes,
    layer_activation_bytes,
    mtp_activation_bytes,
    other_activation_bytes,
)
from .assumptions import Assumptions
from .comm import CommCounter, comm_time
from .flops import forward_flops_per_token, layer_flops_by_region
from .layout import Chunk, PlanLayout, in_flight, rank_chunks
from .params import attention_matrices

PARAM_BYTES = {"bf16": 2, "fp8": 2, "fp32": 4}  # fp8 keeps bf16 weights; the GEMMs quantise on the fly
MASTER_BYTES = 4
GRAD_BYTES = 4  # fp32 gradients, reduced in fp32
ADAM_BYTES = 8  # fp32 m and v


# ----------------------------------------------------------------------------------------------- params


def _layer_params(m: ModelConfig, layer: int, tp: int, ep: int, etp: int) -> tuple[float, float, float]:
    """(dense parameters on one rank, expert parameters on one rank, dense parameters of the whole layer)."""
    h = m.hidden_size
    if m.family == "deepseek_v3":
        replicated = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + (
            h * m.q_lora_rank + m.q_lora_rank if m.q_lora_rank else 0
        )
        sharded = attention_matrices(m) - h * (m.kv_lora_rank + m.qk_rope_head_dim) - (
            h * m.q_lora_rank if m.q_lora_rank else 0
        )
    else:
        replicated = 2 * m.attention_head_dim if m.qk_norm else 0
        sharded = attention_matrices(m)
    replicated += 2 * h
    experts = 0.0
    if m.is_moe_layer(layer):
        moe = m.moe
        replicated += moe.num_experts * h
        sharded += 3 * h * moe.shared_expert_ffn_hidden_size
        experts = moe.num_experts * 3 * h * moe.ffn_hidden_size / (ep * etp)
    else:
        sharded += 3 * h * m.ffn_hidden_size
    return replicated + sharded / tp, experts, replicated + sharded


@dataclass
class RankParams:
    dense: float = 0.0  # on this rank before FSDP sharding (after tp)
    experts: float = 0.0  # on this rank before FSDP sharding (after ep, etp)
    largest_unit: float = 0.0  # the largest FSDP unit (a layer, or the embedding/head), unsharded on this rank


def rank_params(m: ModelConfig, layout: PlanLayout, chunks: list[Chunk]) -> RankParams:
    out = RankParams()
    vocab = m.padded_vocab_size() * m.hidden_size / layout.tp
    kinds = {moe: _layer_params(m, m.num_layers if moe else 0, layout.tp, layout.ep, layout.etp)
             for moe in (False, True)}
    for chunk in chunks:
        for moe, count in ((True, chunk.moe_layers), (False, len(chunk.layers) - chunk.moe_layers)):
            if count:
                dense, experts, _ = kinds[moe]
                out.dense += dense * count
                out.experts += experts * count
                out.largest_unit = max(out.largest_unit, dense + experts)
        if chunk.embedding:
            out.dense += vocab
            out.largest_unit = max(out.largest_unit, vocab)
        if chunk.loss and (not m.tie_embeddings or layout.pp > 1):
            out.dense += vocab + m.hidden_size
            out.largest_unit = max(out.largest_unit, vocab)
        for _ in range(chunk.mtp):
            dense, experts, _ = _layer_params(m, m.num_layers, layout.tp, layout.ep, layout.etp)
            out.dense += dense + 2 * m.hidden_size * m.hidden_size / layout.tp + 3 * m.hidden_size
            out.experts += experts
            if layout.pp > 1 and not chunk.embedding:  # the last stage's own copy of the embedding
                out.dense += vocab
    return out


# ------------------------------------------------------------------------------------------------ plan


@dataclass
class RankPlan:
    rank: int
    params: RankParams
    memory: dict[str, float]
    activation_bytes_per_layer: dict[int, float]
    flops: dict[str, float]
    flops_split: dict[str, float]
    comm: CommCounter
    elementwise_bytes: float
    moe_sync: float  # seconds per step the host waits on MoE token counts


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
    time: dict[str, float] = field(default_factory=dict)

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
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.hardware.bf16_flops if self.hardware.bf16_flops else 0.0


def _activation_layout(recipe: Recipe, layout: PlanLayout, a: Assumptions) -> ActivationLayout:
    return ActivationLayout(
        micro_batch=layout.micro_batch, seq_length=layout.seq_length,
        act_bytes=4 if recipe.train.precision == "fp32" else 2, tp=layout.tp,
        sequence_parallel=layout.sequence_parallel, cp=layout.cp, ep=layout.ep, etp=layout.etp,
        moe_imbalance=a.moe_imbalance, position_batch=layout.micro_batch if recipe.data.reset_at_eod else 1,
    )


def _rank_flops(m: ModelConfig, layout: PlanLayout, chunks: list[Chunk], a: Assumptions) -> tuple[dict, dict]:
    """Executed FLOPs of one rank per step ({forward, backward, recompute, total}) and the same split by kind
    of kernel ({gemm, grouped_gemm, attention}, forward + backward + recompute) for the time model."""
    seq = layout.seq_length
    tokens = layout.micro_batches * layout.micro_batch * seq / layout.cp  # this rank's share of the sequence
    policy = layout.recompute
    fwd = {"gemm": 0.0, "grouped_gemm": 0.0, "attention": 0.0}
    rec = {"gemm": 0.0, "grouped_gemm": 0.0, "attention": 0.0}

    def add(target: dict, kind: str, per_token: float, scale: float = 1.0) -> None:
        target[kind] += per_token * tokens / layout.tp * scale

    def layer(index: int, count: int) -> None:
        if count == 0:
            return
        regions = {k: v * count for k, v in layer_flops_by_region(m, layer=index, seq_length=seq,
                                                                   executed=True).items()}
        moe = "experts" in regions
        for name, value in regions.items():
            if name == "mla_up_proj":
                continue  # part of `attention`
            kind = "attention" if name == "core_attn" else "grouped_gemm" if name == "experts" else "gemm"
            scale = a.moe_imbalance if name == "experts" else 1.0
            add(fwd, kind, value, scale)
        if policy.granularity == "full":
            last = "shared_experts" if moe and regions.get("shared_experts") else ("mlp" if not moe else None)
            for name, value in regions.items():
                if name == "mla_up_proj":
                    continue
                kind = "attention" if name == "core_attn" else "grouped_gemm" if name == "experts" else "gemm"
                # non-reentrant checkpointing stops once the last saved tensor is back: the final down
                # projection (dense MLP or shared expert) does not run again
                value -= value / 3 if name == last else 0.0
                add(rec, kind, value, a.moe_imbalance if name == "experts" else 1.0)
        elif policy.granularity == "selective":
            mods = set(policy.modules)
            if "core_attn" in mods:
                add(rec, "attention", regions["core_attn"])
            if "mla_up_proj" in mods and "mla_up_proj" in regions:
                add(rec, "gemm", regions["mla_up_proj"])
            if "mlp" in mods and "mlp" in regions:
                add(rec, "gemm", regions["mlp"])
            if moe and "moe" in mods:
                add(rec, "gemm", regions["router"] + regions["shared_experts"])
                add(rec, "grouped_gemm", regions["experts"], a.moe_imbalance)
            elif moe and "shared_experts" in mods:
                add(rec, "gemm", regions["shared_experts"])

    moe_layers = sum(c.moe_layers for c in chunks)
    dense_layers = sum(len(c.layers) for c in chunks) - moe_layers
    layer(0, dense_layers)
    layer(m.num_layers, moe_layers)  # m.num_layers: an index past first_k_dense (MoE where the model has MoE)
    for chunk in chunks:
        if chunk.loss:
            add(fwd, "gemm", 2.0 * m.hidden_size * m.vocab_size)
        for _ in range(chunk.mtp):
            layer(m.num_layers, 1)
            add(fwd, "gemm", 2.0 * 2 * m.hidden_size * m.hidden_size + 2.0 * m.hidden_size * m.vocab_size)
    forward = sum(fwd.values())
    recompute = sum(rec.values())
    split = {k: 3 * fwd[k] + rec[k] for k in fwd}
    return {"forward": forward, "backward": 2 * forward, "recompute": recompute,
            "total": 3 * forward + recompute}, split


def _plan_rank(recipe: Recipe, layout: PlanLayout, hw: Hardware, a: Assumptions, rank: int,
               chunks: list[Chunk], *, detail: bool = True) -> RankPlan:
    m = recipe.model
    lay = _activation_layout(recipe, layout, a)
    params = rank_params(m, layout, chunks)
    fsdp_dense = layout.dp * layout.cp
    local = params.dense / fsdp_dense + params.experts / layout.edp
    precision = recipe.train.precision
    param_bytes = PARAM_BYTES[precision]

    per_layer: dict[int, float] = {}
    activations = 0.0
    transient = 0.0
    counts = in_flight(layout, rank)
    kind_bytes = {moe: layer_activation_bytes(m, lay, layer_index=m.num_layers if moe else 0,
                                              policy=layout.recompute) for moe in (False, True)}
    for chunk, count in zip(chunks, counts, strict=False):
        kept, extra = chunk_activation_bytes(m, lay, chunk, layout.recompute)
        if detail:
            per_layer.update({i: kind_bytes[m.is_moe_layer(i)] for i in chunk.layers})
        activations += kept * count
        transient = max(transient, extra)
        if chunk.loss:
            activations += head_activation_bytes(m, lay, vocab_parallel=True) * count
        activations += chunk.mtp * mtp_activation_bytes(m, lay, layout.recompute) * count
    activations += other_activation_bytes(m, lay) * max(counts)

    stage = params.dense + params.experts
    if (layout.pp > 1 or a.fsdp_once_per_step) and layout.micro_batches > 1:
        # the stage stays unsharded (parameter dtype) and accumulates unreduced fp32 gradients all step
        fsdp = param_bytes * stage + GRAD_BYTES * stage
    else:
        fsdp = a.fsdp_prefetch_units * param_bytes * params.largest_unit + GRAD_BYTES * params.largest_unit
        if not a.fsdp_reduce_every_micro_batch and layout.micro_batches > 1:
            fsdp += GRAD_BYTES * stage
    dispatch = 0.0
    if m.moe is not None and any(c.moe_layers for c in chunks):
        # permuted tokens and the received rows of one layer, live during its dispatch and combine
        dispatch = 2 * lay.act_bytes * expert_rows(m, lay) * m.hidden_size
    loss_transient = 0.0
    if any(c.loss for c in chunks):
        loss_transient = (lay.act_bytes + 4) * lay.tokens * m.padded_vocab_size() / layout.tp
    buffers = a.runtime_reserve_bytes + fsdp + max(dispatch, loss_transient, transient)
    memory = {
        "weights": MASTER_BYTES * local,
        "grads": GRAD_BYTES * local,
        "optimizer": ADAM_BYTES * local,
        "activations": activations,
        "buffers": buffers,
    }
    memory["total"] = sum(memory.values())

    flops, split = _rank_flops(m, layout, chunks, a)
    comm = CommCounter.for_rank(recipe, layout, lay, chunks, params, param_bytes, a)
    # memory-bound traffic: what the rank's layers would save without recompute, over every micro-batch
    kinds = {moe: layer_activation_bytes(m, lay, layer_index=m.num_layers if moe else 0) for moe in (False, True)}
    saved = sum(kinds[True] * c.moe_layers + kinds[False] * (len(c.layers) - c.moe_layers) for c in chunks)
    elementwise = a.elementwise_traffic_per_saved_byte * saved * layout.micro_batches
    moe_forwards = 2 if layout.recompute.granularity == "full" or "moe" in layout.recompute.modules else 1
    moe_layers = sum(c.moe_layers + c.mtp * (m.moe is not None) for c in chunks)
    moe_sync = a.moe_sync_s * moe_layers * moe_forwards * layout.micro_batches
    return RankPlan(rank, params, memory, per_layer, flops, split, comm, elementwise, moe_sync)


def _time(plan_rank: RankPlan, layout: PlanLayout, hw: Hardware, a: Assumptions, precision: str,
          local_params: float) -> dict[str, float]:
    gemm_peak = hw.bf16_flops * (a.fp8_gemm_speedup if precision == "fp8" else 1.0)
    split = plan_rank.flops_split
    compute = (split["gemm"] / (gemm_peak * a.gemm_efficiency)
               + split["grouped_gemm"] / (gemm_peak * a.grouped_gemm_efficiency)
               + split["attention"] / (hw.bf16_flops * a.attention_efficiency))
    elementwise = plan_rank.elementwise_bytes / hw.hbm_bytes_per_s
    comm = comm_time(plan_rank.comm, layout, hw, a)
    comm_total = sum(comm["total"].values())
    # communication hides behind compute at most: the overlap fractions cannot hide more than there is
    exposed = comm_total - min(sum(comm["hideable"].values()), compute + elementwise)
    busy = compute + elementwise + exposed + plan_rank.moe_sync
    bubble = busy * (layout.pp - 1) / (layout.vpp * layout.micro_batches) if layout.pp > 1 else 0.0
    optimizer = a.optimizer_bytes_per_param * local_params / hw.hbm_bytes_per_s
    return {"compute": compute, "elementwise": elementwise, "comm_exposed": exposed, "comm_total": comm_total,
            "moe_sync": plan_rank.moe_sync, "bubble": bubble, "optimizer": optimizer,
            "step": busy + bubble + optimizer}


def _candidate_ranks(per_rank: list[list[Chunk]]) -> list[int]:
    """The pipeline ranks that can be the most loaded: the first (most micro-batches in flight), the last (head,
    loss, MTP) and those holding the most layers."""
    most = max(sum(len(c.layers) for c in chunks) for chunks in per_rank)
    heavy = [r for r, chunks in enumerate(per_rank) if sum(len(c.layers) for c in chunks) == most]
    return sorted({0, len(per_rank) - 1, *heavy[:1], *heavy[-1:]})


def estimate(recipe: Recipe, hardware: Hardware, assumptions: Assumptions | None = None, *,
             every_rank: bool = True) -> Plan:
    """Plan `recipe` (its layout, batch and precision) on `hardware`. `every_rank` False plans only the
    pipeline ranks that can be the most loaded (what `--search` needs)."""
    a = assumptions or Assumptions()
    m = recipe.model
    layout = PlanLayout.from_recipe(recipe)
    per_rank = rank_chunks(layout, m)
    indices = range(len(per_rank)) if every_rank else _candidate_ranks(per_rank)
    ranks = [_plan_rank(recipe, layout, hardware, a, r, per_rank[r], detail=every_rank) for r in indices]
    tokens = layout.global_batch * layout.seq_length
    model_flops = 3 * forward_flops_per_token(m, seq_length=layout.seq_length) * tokens
    # executed FLOPs of the whole step: every pipeline rank's, times the ranks of its stage
    if every_rank:
        executed = sum(r.flops["total"] for r in ranks) * layout.dp * layout.cp * layout.tp
    else:  # the planned ranks stand for all (search ranks layouts; it does not report executed FLOPs)
        executed = sum(r.flops["total"] for r in ranks) * layout.pp / len(ranks) * layout.dp * layout.cp * layout.tp
    times = []
    for r in ranks:
        local = r.params.dense / (layout.dp * layout.cp) + r.params.experts / layout.edp
        times.append(_time(r, layout, hardware, a, recipe.train.precision, local))
    worst = max(ranks, key=lambda r: r.memory["total"])
    plan = Plan(recipe, hardware, layout, a, ranks, worst, model_flops, executed)
    plan.time = max(times, key=lambda t: t["step"])
    return plan


def plan_json(plan: Plan) -> dict:
    """The JSON of `moe-train plan --json` (INTERFACES.md, plus extra keys)."""
    w = plan.worst
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
        "model_flops_per_step": plan.model_flops_per_step,
        "executed_flops_per_step": plan.executed_flops_per_step,
        "comm_bytes": {k: int(v) for k, v in sorted(w.comm.payload.items())},
        "comm_bus_bytes": {k: int(v) for k, v in sorted(w.comm.bus.items())},
        "comm_links": w.comm.links(layout, plan.hardware),
        "activation_bytes_per_layer": {str(k): int(v) for k, v in w.activation_bytes_per_layer.items()},
        "params": {"dense_per_rank": int(w.params.dense), "experts_per_rank": int(w.params.experts),
                   "local_after_fsdp": int(w.params.dense / (layout.dp * layout.cp) + w.params.experts / layout.edp)},
        "layout": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp, "dp": layout.dp,
                   "ep": layout.ep, "etp": layout.etp, "edp": layout.edp,
                   "sequence_parallel": layout.sequence_parallel, "micro_batch_size": layout.micro_batch,
                   "micro_batches": layout.micro_batches, "recompute": layout.recompute.granularity,
                   "recompute_modules": list(layout.recompute.modules)},
        "step_time_s": plan.step_time,
        "time_s": plan.time,
        "tokens_per_s": plan.tokens_per_s,
        "tflops_per_gpu": plan.tflops_per_gpu,
        "mfu": plan.mfu,
        "assumptions": plan.assumptions.to_dict(),
    }
