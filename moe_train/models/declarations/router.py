"""The MoE router (models/moe/router.py): a [E, h] weight (and gpt-oss's logit bias) on every tp rank, run on
the rank's share of the tokens."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .parts import Gemm, Module, Param
from .saves import FP32, INT64, Saved

NAME = "router"
REGION = "moe"  # what its saves belong to: the MoE layer a recompute or offload policy names


def declare(cfg: ModelConfig) -> Module:
    e, h = cfg.moe.num_experts, cfg.hidden_size
    params = [Param("router.weight", (e, h), "replicated")]
    if cfg.moe.router.learned_bias:
        params.append(Param("router.bias", (e,), "replicated"))
    return Module(NAME, tuple(params), (Gemm("router", e, h, NAME),))


def saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """Its input as it is (the norm's output, which the shared experts read too: one storage; its math runs in
    fp32 and its backward widens the kept input again), the fp32 scores [T, E], the top-k indices, the normalised
    top-k weights and their sum, and what the balancing losses keep."""
    moe, a, t = cfg.moe, lay.act_bytes, lay.moe_tokens
    e, k, router = moe.num_experts, moe.top_k, moe.router
    items = [
        Saved(REGION, "router.input", a * t * cfg.hidden_size),
        Saved(REGION, "router.scores", FP32 * t * e),
        Saved(REGION, "router.topk_indices", INT64 * t * k),
        Saved(REGION, "router.topk_sum", FP32 * t),
        Saved(REGION, "router.topk_scores", FP32 * t * k),
    ]
    if router.load_balancing == "seq_aux_loss" and router.aux_loss_coeff > 0:
        items += [
            Saved(REGION, "seq_aux_loss.score_sum", FP32 * t),
            Saved(REGION, "seq_aux_loss.load", FP32 * lay.micro_batch * e),
        ]
    if router.z_loss_coeff > 0:
        items += [Saved(REGION, "z_loss.logits", FP32 * t * e), Saved(REGION, "z_loss.logsumexp", FP32 * t)]
    return items


def kept_in_offloaded_layer(cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """What offloading the whole MoE layer leaves of the router's saves: its input (the norm's output, flattened:
    a view) and the scores where the sequence-level balancing loss saves a per-sequence view of them."""
    router = cfg.moe.router
    seq_aux = router.load_balancing == "seq_aux_loss" and router.aux_loss_coeff > 0
    return {"router.input"} | ({"router.scores"} if seq_aux else set())


def balancing_exchanges(cfg: ModelConfig, lay: ActivationLayout) -> list[tuple[str, float, bool]]:
    """The balancing losses' all-reduces in one forward (models/moe/aux_loss.py), each (over which ranks, bytes,
    whether a recomputation runs it again): `tokens` the micro-batch's tokens on every tp and cp rank (the
    layer's `token_group`: the switch-style losses' expert counts, seq_aux_loss's per-sequence loads), `data`
    global_aux_loss's counts over dp."""
    moe, router = cfg.moe, cfg.moe.router
    if router.aux_loss_coeff <= 0:
        return []
    counts = (moe.num_experts + 1) * INT64  # switch-style losses: the token set's counts
    out = []
    if router.load_balancing in ("aux_loss", "global_aux_loss"):
        out.append(("tokens", counts, False))
    if router.load_balancing == "global_aux_loss":
        out.append(("data", counts, False))
    if router.load_balancing == "seq_aux_loss":
        out.append(("tokens", lay.micro_batch * moe.num_experts * FP32, True))
    return out
