"""GQA attention (models/attention.py `Attention`): q/k/v/o projections with optional q/k/v biases (GLM-4.5), an
o_proj bias and sinks (gpt-oss), optional QK-norm (Qwen3); sliding windows change which keys are masked, not
what is computed or saved."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from . import rope
from .layout import ActivationLayout
from .parts import CORE_REGION, CoreAttention, Module, Param, RegionEntry, linear
from .saves import FP32, Saved, gemm_input, norm_items, without

NAME = "attention"
CORE = CORE_REGION  # the recompute and offload policies' name for SDPA
# SDPA's saves an offloaded `core_attn` moves: q and k (the rotations' outputs), its output and logsumexp; v stays,
# a transpose of v_proj's output (its storage is held elsewhere)
CORE_MOVED = frozenset({"sdpa.q", "sdpa.k", "sdpa.out", "sdpa.logsumexp"})


def declare(cfg: ModelConfig) -> Module:
    """q, k, v column-parallel (heads over tp, each bias with its rows), o row-parallel (its bias whole, added
    once after the reduce), the sinks with the heads, the QK-norm weights [head_dim] on every rank."""
    h, heads, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.attention_head_dim
    bias = "column" if cfg.attention_bias else None
    params, gemms = [], []
    for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
        p, g = linear(name, rows, h, "column", region=NAME, fp8=NAME, bias=bias)
        params += p
        gemms.append(g)
    p, g = linear("o_proj", h, heads * d, "row", region=NAME, fp8=NAME,
                  bias="sequence" if cfg.attention_output_bias else None)
    params += p
    gemms.append(g)
    if cfg.attention_sinks:
        params.append(Param("sinks", (heads,), "column"))
    if cfg.qk_norm:
        params += [Param("q_norm.weight", (d,), "replicated"), Param("k_norm.weight", (d,), "replicated")]
    core = CoreAttention(heads, kv, d, d)
    return Module(NAME, tuple(params), tuple(gemms), core, tp_entries=(RegionEntry(h, 3),))  # q, k, v read x


def saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """The input norm's output (kept by q/k/v: sequence-sharded under SP, where they gather it again), the
    QK-norms' inputs and rstd, the rotary casts, then SDPA's (flash-style on CPU and GPU) q, k, v, output and fp32
    logsumexp, never an s x s matrix (k and v with their own head count); o_proj keeps a contiguous copy of the
    output."""
    a, t, ts, h, tp = lay.act_bytes, lay.tokens, lay.seq_tokens, cfg.hidden_size, lay.tp
    heads, kv_heads, d = cfg.num_attention_heads / tp, cfg.kv_heads / tp, cfg.attention_head_dim
    fp8 = lay.kept_fp8(NAME)
    column = None if lay.gathers_shards else fp8  # how a column-parallel GEMM keeps its input
    items = gemm_input("attn_input", "attention.input", ts, h, a, column)
    if cfg.qk_norm:
        items += norm_items(NAME, "q_norm", t * heads, d, a)
        items += norm_items(NAME, "k_norm", t * kv_heads, d, a)
    items += rope.saved(cfg, lay)
    items += [
        Saved(NAME, "sdpa.q", a * t * heads * d),
        Saved(NAME, "sdpa.k", a * t * kv_heads * d),
        Saved(NAME, "sdpa.v", a * t * kv_heads * d),
        Saved(CORE, "sdpa.out", a * t * heads * d),
        Saved(CORE, "sdpa.logsumexp", FP32 * t * heads),
        *gemm_input(NAME, "o_proj.input", t, heads * d, a, fp8),
    ]
    return items


def recomputed(items: list[Saved], modules: set[str], cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """`core_attn` run again in backward: SDPA keeps its inputs only (its output and logsumexp go)."""
    return without(items, {"sdpa.out", "sdpa.logsumexp"}) if CORE in modules else items


def moved(region: str, cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """What an offloaded `core_attn` moves (`CORE_MOVED`)."""
    return set(CORE_MOVED) if region == CORE else set()
