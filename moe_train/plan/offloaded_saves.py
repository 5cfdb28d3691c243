"""What activation offloading (`parallel.offload.modules`, parallel/offload.py) moves off the device: the saved
items of plan/saved_tensors.py (after selective recompute) that leave a layer when its forward returns (no torch).

The pool moves a storage that one of the named regions saved and that nothing else holds when the layer's
forward returns; it leaves on the device every storage something else keeps too (a save outside the regions,
another tensor on the same storage, a tensor Python holds). The second rule is what makes the list below more
than the regions' items: a save that is a *view* (a reshape or transpose of another op's output) shares its
storage with the tensor it views, so it stays. What that leaves, region by region (`_moved`):

- core_attn: SDPA's q and k (the rotations' outputs), its output and logsumexp. v stays where it is a transpose
  of v_proj's output (GQA; MLA without padding, the CUDA row of the kernel table); MLA's zero-padded v (the CPU
  row) is a tensor of its own and moves.
- mla_up_proj: core_attn's items, and under sequence parallelism the up projections' inputs (their sequence
  shards, kept by the column-parallel GEMMs inside the region); without it those are the norms' saves, outside.
- layernorm: the post-attention norm's input (the residual after attention) and both reciprocal rms; the input
  norm's input is the layer's own argument, which the caller holds.
- mlp: gate, up and silu(gate); under sequence parallelism its input too (the column-parallel GEMMs' shard);
  the down projection's input is a view (the GEMM flattens the tokens), kept. With fp8 GEMMs
  (train.fp8.modules mlp) the other way round: they keep their inputs as they came (or their fp8 copies) and
  return views of their flat outputs, so the input, silu(gate) and the down projection's input move, gate and
  up stay.
- shared_experts: gate, up, silu(gate) and the down projection's input (they run on flat rows); their input is
  the router's, saved outside. With fp8 GEMMs only silu(gate) and the down projection's input (gate and up are
  views).
- moe_act: the experts' gate and up outputs (the weighted SwiGLU keeps nothing else of its own); the rows' weights
  are a view of the dispatched weights and the weighted product is the down projection's input, saved outside.
- moe: everything the layer saves but its input (the norm's output, flattened: a view), the rows' routing
  weights (a view), one of the dispatch's two permutation indices (a view of the other), the router's scores
  where the sequence-level balancing loss saves a per-sequence view of them, and, under tensor or expert
  parallelism, the experts' input rows (then what the dispatch's collectives hand over, kept by them too)
  unless the experts keep an fp8 copy of them, and with fp8 shared experts their gate and up (views).

Held to measure exactly (tests/test_plan_measure.py) for every region in fp32 and bf16, with and without tensor
and sequence parallelism, expert parallelism, recompute of other regions and fp8 GEMMs (rowwise, inputs kept
in fp8 or in bf16).

plan/estimate.py takes these bytes out of the device-resident activation memory, reports them per layer as
measure does (`offloaded_bytes_per_layer`) and prices their copies on the hardware table's host link.
"""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .saved_tensors import ActivationLayout, Saved

_ATTENTION = {"sdpa.q", "sdpa.k", "sdpa.out", "sdpa.logsumexp"}
_SWIGLU = ("gate", "up", "silu")


def _with_scales(names: set[str]) -> set[str]:
    return names | {f"{n}.scale" for n in names}


def _moved(region: str, cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """The item names an offloaded `region` moves (see the module docstring)."""
    mla = cfg.family == "deepseek_v3"
    attention = _ATTENTION | ({"sdpa.v"} if mla and lay.mla_value_padded else set())
    if region == "core_attn":
        return attention
    if region == "mla_up_proj":
        return attention | ({"q_b_proj.input", "kv_b_proj.input"} if lay.gathers_shards else set())
    if region == "layernorm":
        return {"post_attention_layernorm.input", "input_layernorm.rstd", "post_attention_layernorm.rstd"}
    if region == "mlp":
        if "mlp" in lay.fp8_gemms:  # fp8 GEMMs keep their inputs whole and return views
            return _with_scales({"mlp.input", "mlp.silu", "mlp.down_input"})
        return {f"mlp.{n}" for n in _SWIGLU} | ({"mlp.input"} if lay.gathers_shards else set())
    if region == "shared_experts":
        if "shared_experts" in lay.fp8_gemms:
            return _with_scales({"shared_experts.silu", "shared_experts.down_input"})
        return _with_scales({f"shared_experts.{n}" for n in (*_SWIGLU, "down_input")})
    if region == "moe_act":
        return {"experts.gate_up"}
    raise ValueError(f"unknown offload region {region!r}")


def _moe_kept(cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """The items of a MoE layer that offloading the whole layer leaves on the device (module docstring)."""
    router = cfg.moe.router
    kept = {"router.input", "experts.probs", "dispatch.order"}
    if router.load_balancing == "seq_aux_loss" and router.aux_loss_coeff > 0:
        kept.add("router.scores")
    if (lay.tp > 1 or lay.ep > 1) and lay.kept_fp8("experts") is None:  # an fp8 copy is the GEMM's own
        kept.add("experts.input")
    if "shared_experts" in lay.fp8_gemms:  # views of the fp8 GEMMs' flat outputs
        kept |= {"shared_experts.gate", "shared_experts.up"}
    return kept


def offloaded_items(items: list[Saved], modules: tuple[str, ...], cfg: ModelConfig,
                    lay: ActivationLayout) -> list[Saved]:
    """The items of one layer (`items`: what it saves under the recompute policy) that the offloaded `modules`
    move to the host pool. A region inside another offloaded one adds nothing (the pool wraps it once)."""
    whole_moe = "moe" in modules and any(i.region == "moe" for i in items)  # a MoE layer, offloaded whole
    inside_moe = ("moe", "moe_act", "shared_experts") if whole_moe else ("moe",)  # "moe" names no dense region
    names = set().union(*(_moved(r, cfg, lay) for r in modules if r not in inside_moe))
    if whole_moe:
        kept = _moe_kept(cfg, lay)
        names |= {i.name for i in items if i.region in ("moe", "moe_act", "shared_experts") and i.name not in kept}
    return [i for i in items if i.name in names]
