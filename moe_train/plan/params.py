"""Parameter counts from a model section, without building the model (the login node has no torch).

Counts use the unpadded vocabulary, as published model cards do; `padded=True` counts what the engine
allocates. `active` counts the parameters one token passes through (top-k routed experts, not all of them).
The matrix counts (`attention_matrices`, `ffn_matrices`) are also what the FLOPs formula multiplies
(moe_train/plan/flops.py): one multiply-add per weight per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config.schema import ModelConfig


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int
    embedding: int
    mtp: int


def attention_matrices(m: ModelConfig) -> int:
    """Weights of the attention projections (GQA: q, k, v, o; MLA: q down/up or q, kv down/up, o)."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.family == "deepseek_v3":
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (h + heads * qk_dim) * m.q_lora_rank if m.q_lora_rank else h * heads * qk_dim
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h
    d = m.attention_head_dim
    return h * heads * d + 2 * h * m.kv_heads * d + heads * d * h


def _attention_norms(m: ModelConfig) -> int:
    if m.family == "deepseek_v3":
        return (m.q_lora_rank or 0) + m.kv_lora_rank
    return 2 * m.attention_head_dim if m.qk_norm else 0


def ffn_matrices(m: ModelConfig, *, moe_layer: bool, active: bool) -> int:
    """Weights of one layer's MLP: dense SwiGLU, or router + routed experts (top_k of them when `active`) +
    shared expert."""
    h = m.hidden_size
    if not moe_layer:
        return 3 * h * m.ffn_hidden_size
    moe = m.moe
    experts = moe.top_k if active else moe.num_experts
    return moe.num_experts * h + experts * 3 * h * moe.ffn_hidden_size + 3 * h * moe.shared_expert_ffn_hidden_size


def _layer(m: ModelConfig, *, moe_layer: bool, active: bool) -> int:
    """Parameters of one decoder layer: attention, its norms, the two pre-norms and the MLP."""
    return attention_matrices(m) + _attention_norms(m) + 2 * m.hidden_size + ffn_matrices(
        m, moe_layer=moe_layer, active=active
    )


def count_parameters(m: ModelConfig, *, padded: bool = False, tp: int = 1) -> ParameterCount:
    vocab = m.padded_vocab_size(tp) if padded else m.vocab_size
    embedding = vocab * m.hidden_size * (1 if m.tie_embeddings else 2)
    total = active = embedding + m.hidden_size  # + final norm
    for index in range(m.num_layers):
        total += _layer(m, moe_layer=m.is_moe_layer(index), active=False)
        active += _layer(m, moe_layer=m.is_moe_layer(index), active=True)
    mtp_block = _layer(m, moe_layer=m.moe is not None, active=False)
    mtp = m.mtp_layers * (mtp_block + 2 * m.hidden_size * m.hidden_size + 3 * m.hidden_size)
    return ParameterCount(total=total, active=active, embedding=embedding, mtp=mtp)
