"""Multi-head latent attention (models/mla.py `MLA`, DeepSeek-V3): q through a low-rank latent (or one q_proj),
a joint kv latent with the decoupled rope key, the kv up projection and o_proj."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from . import rope
from .layout import ActivationLayout
from .parts import CoreAttention, Module, Param, linear
from .saves import FP32, Saved, gemm_input, norm_items

NAME = "attention"
UP, DOWN = "mla_up_proj", "mla_down_proj"  # the parts of its FLOPs a recompute policy names


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
    return Module(NAME, params, gemms, CoreAttention(heads, qk, cfg.v_head_dim))


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
        Saved("core_attn", "sdpa.out", a * t * heads * v_width),
        Saved("core_attn", "sdpa.logsumexp", FP32 * t * heads),
        *gemm_input(NAME, "o_proj.input", t, heads * v, a, fp8),
    ]
    return items
