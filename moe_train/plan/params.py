"""Parameter counts from a model section, without building the model (the login node has no torch).

Counts use the unpadded vocabulary, as published model cards do; `padded=True` counts what the engine
allocates. `active` counts the parameters one token passes through (top-k routed experts, not all of them).
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


def _attention(m: ModelConfig) -> int:
    h, heads = m.hidden_size, m.num_attention_heads
    if m.family == "deepseek_v3":
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk_dim
        else:
            q = h * heads * qk_dim
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h
    d = m.attention_head_dim
    norms = 2 * d if m.qk_norm else 0
    return h * heads * d + 2 * h * m.kv_heads * d + heads * d * h + norms


def _layer(m: ModelConfig, moe_layer: bool) -> tuple[int, int]:
    """(total, active) parameters of one decoder layer."""
    h = m.hidden_size
    base = _attention(m) + 2 * h
    if not moe_layer:
        mlp = 3 * h * m.ffn_hidden_size
        return base + mlp, base + mlp
    moe = m.moe
    shared = 3 * h * moe.shared_expert_ffn_hidden_size
    router = moe.num_experts * h
    expert = 3 * h * moe.ffn_hidden_size
    return base + router + shared + moe.num_experts * expert, base + router + shared + moe.top_k * expert


def count_parameters(m: ModelConfig, *, padded: bool = False, tp: int = 1) -> ParameterCount:
    vocab = m.padded_vocab_size(tp) if padded else m.vocab_size
    embedding = vocab * m.hidden_size * (1 if m.tie_embeddings else 2)
    total = active = embedding + m.hidden_size  # + final norm
    for index in range(m.num_layers):
        layer_total, layer_active = _layer(m, m.is_moe_layer(index))
        total += layer_total
        active += layer_active
    mtp_block_total, _ = _layer(m, m.moe is not None)
    mtp = m.mtp_layers * (mtp_block_total + 2 * m.hidden_size * m.hidden_size + 3 * m.hidden_size)
    return ParameterCount(total=total, active=active, embedding=embedding, mtp=mtp)
