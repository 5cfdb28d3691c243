"""One FLOPs-per-token formula for every model family: the trainer's MFU and the planner's step time use it.

Counted: every matrix multiply of the forward pass at 2 FLOPs per multiply-add, for one token of a sequence
of `seq_length`:
- attention projections: GQA (q, k, v, o with `kv_heads` key/value heads) or MLA (q through its low-rank
  down/up projections when `q_lora_rank` is set, the joint kv down projection with the decoupled rope key,
  the kv up projection, o);
- attention's quadratic term: QK^T and AV over the full `seq_length` keys. The causal mask is not discounted,
  the way `torch.utils.flop_counter` counts scaled dot-product attention, so measured and predicted figures
  agree (`causal=True`: Megatron-Core's convention, half of s x s, which its published TFLOP/s use); attention
  sinks (a logit in the normaliser, no key) and sliding windows (their masked keys are computed) add none;
- SwiGLU MLPs (3 matrices): dense layers, and on MoE layers the router, the `top_k` active routed experts
  and the shared expert;
- the output head over the real vocabulary (model FLOPs: the model also computes the padding columns, masked in
  the loss, which executed FLOPs count as 2 * h * (padded - vocab) per token per head; embedding lookups are
  gathers, not FLOPs);
- each MTP module: its projection of [hidden; embedding] (2h -> h), one more decoder layer of the model's
  last kind, and the shared output head.
Norms, activations, softmax and rotary embeddings are elementwise and left out (a few percent at most).
Training costs 3x the forward pass (backward = 2x forward); recomputation is not model FLOPs.
"""

from __future__ import annotations

import functools

from moe_train.config.schema import ModelConfig
from moe_train.models.declarations import embedding as ends
from moe_train.models.declarations import mtp
from moe_train.models.declarations.layer import attention_module, decoder_layer
from moe_train.models.declarations.parts import CORE_REGION, CoreAttention
from moe_train.plan.params import attention_matrices, ffn_matrices


def _core(core: CoreAttention, seq_length: int, *, causal: bool = False, padded: bool = False) -> float:
    """Multiply-adds of QK^T and AV per token over `seq_length` keys (`causal`: half of them); `padded`: at the
    one head width the kernel runs both at."""
    qk, v = (core.padded_dim, core.padded_dim) if padded else (core.qk_dim, core.v_dim)
    return attended_keys(core, seq_length, causal) * core.heads * (qk + v)


def _attention(cfg: ModelConfig, seq_length: int, causal: bool = False) -> float:
    """Projections (2 FLOPs per weight) plus QK^T and AV over `seq_length` keys (`causal`: half of them)."""
    return 2.0 * (attention_matrices(cfg) + _core(attention_module(cfg).core, seq_length, causal=causal))


def attended_keys(core: CoreAttention, seq_length: int, causal: bool = False) -> float:
    """Keys a query's QK^T and AV run over: `seq_length`, or half of it (`causal`). gpt-oss's sinks join the
    softmax's normaliser through its log-sum-exp (models/blockwise_attention.py), no key; its sliding windows
    mask keys without skipping them, so the count is the same (measure's FLOP counter agrees)."""
    return seq_length * (0.5 if causal else 1.0)


def _ffn(cfg: ModelConfig, layer: int) -> float:
    return 2.0 * ffn_matrices(cfg, moe_layer=cfg.is_moe_layer(layer), active=True)


def _gemm_flops(module) -> float:
    return 2.0 * sum(g.weights for g in module.gemms)


@functools.lru_cache(maxsize=256)
def forward_flops_per_token(cfg: ModelConfig, *, seq_length: int, causal: bool = False) -> float:
    """Forward FLOPs for one token (see the module docstring for what is counted). `causal`: Megatron-Core's
    convention (its published TFLOP/s), the causal mask's half of the s x s scores (s / 2 keys a query)."""
    head = _gemm_flops(ends.head(cfg, padded=False))
    layers = sum(_attention(cfg, seq_length, causal) + _ffn(cfg, i) for i in range(cfg.num_layers))
    mtp_layer = _gemm_flops(mtp.declare(cfg)) + _attention(cfg, seq_length, causal)
    mtp_layer += _ffn(cfg, cfg.num_layers - 1) + head
    return layers + head + cfg.mtp_layers * mtp_layer


def training_flops_per_token(cfg: ModelConfig, *, seq_length: int) -> float:
    """Forward plus backward (2x forward) FLOPs for one trained token."""
    return 3.0 * forward_flops_per_token(cfg, seq_length=seq_length)


def layer_flops_by_region(cfg: ModelConfig, *, layer: int, seq_length: int, executed: bool = False,
                          mla_value_padded: bool = True) -> dict[str, float]:
    """Forward FLOPs per token of one decoder layer, by the region a recompute policy names.

    Regions: `attention` (projections), `core_attn` (QK^T and AV), `mla_up_proj` and `mla_down_proj` (the parts
    of `attention` that MLA's up and down projections are; the down projections are replicated over tp), `mlp`
    (dense), `router`, `experts` (top_k routed), `shared_experts`. `executed` counts what runs rather than model
    FLOPs: MLA's SDPA runs q, k, v zero-padded to one head width where the device's kernel needs one
    (`mla_value_padded`: the kernel table's `mla_value`, moe_train/kernels.py).
    """
    return dict(_regions(cfg, cfg.is_moe_layer(layer), seq_length, executed and mla_value_padded))


@functools.lru_cache(maxsize=1024)
def _regions(cfg: ModelConfig, moe_layer: bool, seq_length: int, padded: bool) -> tuple[tuple[str, float], ...]:
    """Layers of one kind have the same FLOPs: computed once per kind. Each module's GEMMs count under its
    name and, where a GEMM names a part of it (MLA's up and down projections), under that part too."""
    out: dict[str, float] = {}
    for module in decoder_layer(cfg, moe_layer=moe_layer):
        for g in module.gemms:
            for region in {module.name, g.region}:
                out[region] = out.get(region, 0.0) + 2.0 * g.weights
        if module.core is not None:
            out[CORE_REGION] = 2.0 * _core(module.core, seq_length, padded=padded)
    return tuple(out.items())
