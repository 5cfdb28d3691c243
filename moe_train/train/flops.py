"""One FLOPs-per-token formula for every model family: the trainer's MFU and the planner's step time use it.

Counted: every matrix multiply of the forward pass at 2 FLOPs per multiply-add, for one token of a sequence
of `seq_length`:
- attention projections: GQA (q, k, v, o with `kv_heads` key/value heads) or MLA (q through its low-rank
  down/up projections when `q_lora_rank` is set, the joint kv down projection with the decoupled rope key,
  the kv up projection, o);
- attention's quadratic term: QK^T and AV over the full `seq_length` keys. The causal mask is not discounted,
  the way Megatron-LM reports model FLOPs and the way `torch.utils.flop_counter` counts scaled dot-product
  attention, so measured and predicted figures agree;
- SwiGLU MLPs (3 matrices): dense layers, and on MoE layers the router, the `top_k` active routed experts
  and the shared expert;
- the output head over the real vocabulary (the model never computes logits of the padding rows; embedding
  lookups are gathers, not FLOPs);
- each MTP module: its projection of [hidden; embedding] (2h -> h), one more decoder layer of the model's
  last kind, and the shared output head.
Norms, activations, softmax and rotary embeddings are elementwise and left out (a few percent at most).
Training costs 3x the forward pass (backward = 2x forward); recomputation is not model FLOPs.
"""

from __future__ import annotations

from moe_train.config.schema import ModelConfig


def _attention(cfg: ModelConfig, seq_length: int) -> float:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.family == "deepseek_v3":
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        v_dim = cfg.v_head_dim
        if cfg.q_lora_rank:
            q = h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk_dim
        else:
            q = h * heads * qk_dim
        kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + v_dim)
        projections = q + kv + heads * v_dim * h
    else:
        qk_dim = v_dim = cfg.attention_head_dim
        projections = h * heads * qk_dim + 2 * h * cfg.kv_heads * qk_dim + heads * v_dim * h
    quadratic = seq_length * heads * (qk_dim + v_dim)
    return 2.0 * (projections + quadratic)


def _swiglu(hidden: int, ffn: int) -> float:
    return 2.0 * 3 * hidden * ffn


def _ffn(cfg: ModelConfig, layer: int) -> float:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return _swiglu(h, cfg.ffn_hidden_size)
    moe = cfg.moe
    flops = 2.0 * h * moe.num_experts + moe.top_k * _swiglu(h, moe.ffn_hidden_size)
    if moe.shared_expert_ffn_hidden_size:
        flops += _swiglu(h, moe.shared_expert_ffn_hidden_size)
    return flops


def forward_flops_per_token(cfg: ModelConfig, *, seq_length: int) -> float:
    """Forward FLOPs for one token (see the module docstring for what is counted)."""
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    layers = sum(_attention(cfg, seq_length) + _ffn(cfg, i) for i in range(cfg.num_layers))
    mtp_layer = 2.0 * 2 * cfg.hidden_size * cfg.hidden_size + _attention(cfg, seq_length)
    mtp_layer += _ffn(cfg, cfg.num_layers - 1) + head
    return layers + head + cfg.mtp_layers * mtp_layer


def training_flops_per_token(cfg: ModelConfig, *, seq_length: int) -> float:
    """Forward plus backward (2x forward) FLOPs for one trained token."""
    return 3.0 * forward_flops_per_token(cfg, seq_length=seq_length)
