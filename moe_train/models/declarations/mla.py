"""Multi-head latent attention (models/mla.py `MLA`, DeepSeek-V3): q through a low-rank latent (or one q_proj),
a joint kv latent with the decoupled rope key, the kv up projection and o_proj."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from . import attention, rope
from .layout import ActivationLayout
from .parts import CoreAttention, Module, Param, RegionEntry, linear
from .saves import FP32, Saved, gemm_input, kept_as_input, norm_items, without

NAME = "attention"
UP, DOWN = "mla_up_proj", "mla_down_proj"  # the parts of its FLOPs a recompute policy names
SDPA = frozenset({"sdpa.q", "sdpa.k", "sdpa.v", "sdpa.out", "sdpa.logsumexp"})  # what the up region's rerun forms


def declare(cfg: ModelConfig) -> Module:
    """The latent (down) projections and their norms are whole on every tp rank and run on the sequence region;
    the up projections are column-parallel after the region's entry, o_proj row-parallel."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    parts = []
    if cfg.q_lora_rank:
        parts += [linear("q_a_proj", cfg.q_lora_rank, h, "sequence", region=DOWN, fp8=NAME),
                  ((Param("q_a_layernorm.weight", (cfg.q_lora_rank,), "sequence"),), None),
                  linear("q_b_proj", heads * qk, cfg.q_lora_rank, "column", region=UP, fp8=NAME)]
    else:
        parts.append(linear("q_proj", heads * qk, h, "column", region=NAME, fp8=NAME))
    parts += [linear("kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, "sequence", region=DOWN,
                     fp8=NAME),
              ((Param("kv_a_layernorm.weight", (cfg.kv_lora_rank,), "sequence"),), None),
              linear("kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, "column",
                     region=UP, fp8=NAME),
              linear("o_proj", h, heads * cfg.v_head_dim, "row", region=NAME, fp8=NAME)]
    params = tuple(p for ps, _ in parts for p in ps)
    gemms = tuple(g for _, g in parts if g is not None)
    core = CoreAttention(heads, heads, qk, cfg.v_head_dim, rerun_by=(attention.CORE, UP))
    # the up projections' entries (q's latent, or x where q has no latent; the kv latent), and the shared rope
    # key joining the heads (`MLA.rope_key_to_heads`), which no GEMM reads
    entries = (RegionEntry(cfg.q_lora_rank or h, 1, UP), RegionEntry(cfg.kv_lora_rank, 1, UP),
               RegionEntry(cfg.qk_rope_head_dim, 0))
    return Module(NAME, params, gemms, core, tp_entries=entries)


def saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """The latent projections run on the sequence region (sharded under SP); the up projections after the
    all-gather keep only that shard (parallel/tensor.py). Where the device's fused kernel needs one head width
    (the kernel table's `mla_value`: the CPU), v (or q and k) is zero-padded to it, so SDPA's q, k, v and output
    are all max(qk, v) wide; elsewhere q and k are qk wide, v and the output v wide."""
    a, t, ts, h, tp = lay.act_bytes, lay.tokens, lay.seq_tokens, cfg.hidden_size, lay.tp
    heads = cfg.num_attention_heads / tp
    fp8 = lay.kept_fp8(NAME)
    column = None if lay.gathers_shards else fp8  # how a column-parallel GEMM keeps its input
    qk, v, r = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    items = gemm_input("attn_input", "attention.input", ts, h, a, fp8)  # the input norm's output
    if cfg.q_lora_rank:
        items += norm_items("mla_latent", "q_a_layernorm", ts, cfg.q_lora_rank, a)
        items += gemm_input("mla_latent", "q_b_proj.input", ts, cfg.q_lora_rank, a, column)
    kvl = cfg.kv_lora_rank
    # The norm's input is a view of kv_a_proj's whole output (latent + rope key): it keeps that storage.
    items += norm_items("mla_latent", "kv_a_layernorm", ts, kvl, a, storage_width=kvl + r)
    items += gemm_input("mla_latent", "kv_b_proj.input", ts, kvl, a, column)
    items += rope.saved(cfg, lay)
    qk_width, v_width = (max(qk, v), max(qk, v)) if lay.mla_value_padded else (qk, v)
    items += [
        Saved(UP, "sdpa.q", a * t * heads * qk_width),
        Saved(UP, "sdpa.k", a * t * heads * qk_width),
        Saved(UP, "sdpa.v", a * t * heads * v_width),
        Saved(attention.CORE, "sdpa.out", a * t * heads * v_width),
        Saved(attention.CORE, "sdpa.logsumexp", FP32 * t * heads),
        *gemm_input(NAME, "o_proj.input", t, heads * v, a, fp8),
    ]
    return items


def recomputed(items: list[Saved], modules: set[str], cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """`mla_up_proj` run again in backward: the up projections, rotary embeddings and attention, so SDPA's q, k,
    v, output and logsumexp go; the region keeps its inputs: the latents (already kept by the up projections, in
    bf16 where those kept them in fp8), the rotary tables (in bf16 the layer's casts, already an item) and the
    shared rope key: under SP the gathered key (a x T x r, a storage of its own), without SP a view of kv_a_proj's
    output, whose whole storage the kv norm keeps already. Otherwise `core_attn` as GQA's."""
    if UP not in modules:
        return attention.recomputed(items, modules, cfg, lay)
    a, ts = lay.act_bytes, lay.seq_tokens
    out = without(items, set(SDPA))  # the rotary casts are its inputs
    if cfg.q_lora_rank:
        out = kept_as_input(out, "mla_latent", "q_b_proj.input", a * ts * cfg.q_lora_rank)
    out = kept_as_input(out, "mla_latent", "kv_b_proj.input", a * ts * cfg.kv_lora_rank)
    if lay.gathers_shards:
        out.append(Saved(UP, "mla_up_proj.rope_key", a * lay.tokens * cfg.qk_rope_head_dim))
    return out


def moved(region: str, cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """Offloaded `core_attn`: GQA's, and v where it is a tensor of its own (zero-padded: the CPU row of the kernel
    table; unpadded it is a transpose of kv_b_proj's output, kept). `mla_up_proj`: those, and under sequence
    parallelism the up projections' inputs (their sequence shards, kept by the column-parallel GEMMs inside the
    region); without it those are the norms' saves, outside."""
    if region not in (attention.CORE, UP):
        return set()
    out = set(attention.CORE_MOVED) | ({"sdpa.v"} if lay.mla_value_padded else set())
    if region == UP and lay.gathers_shards:
        out |= {"q_b_proj.input", "kv_b_proj.input"}
    return out
