"""The routed experts (models/moe/experts.py `GroupedExperts`, stacks [E, out, in]) with the dispatch and
combine that bring them their rows (models/moe/dispatch_*.py): experts over ep, their width over etp."""

from __future__ import annotations

from moe_train.config.routing_shapes import ForcedRouting, expert_capacity
from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .parts import Gemm, Module, Param
from .saves import INT32, INT64, Saved, gemm_input

NAME = "experts"
REGION = "moe"  # the MoE layer's region; the weighted SwiGLU between the GEMMs is `moe_act`
ACTIVATION = "moe_act"


def declare(cfg: ModelConfig) -> Module:
    """gate and up [E, f, h] (etp cuts f: dim 1), down [E, h, f] (dim 2); gpt-oss's bias stacks [E, f] and
    [E, h]. A token passes through top_k experts of each stack."""
    moe, h = cfg.moe, cfg.hidden_size
    e, f, k = moe.num_experts, moe.ffn_hidden_size, moe.top_k
    params = [Param("gate_proj", (e, f, h), "expert", etp_dim=1, active=k * f * h),
              Param("up_proj", (e, f, h), "expert", etp_dim=1, active=k * f * h),
              Param("down_proj", (e, h, f), "expert", etp_dim=2, active=k * h * f)]
    if moe.expert_biases:
        params += [Param("gate_proj_bias", (e, f), "expert", etp_dim=1, active=k * f),
                   Param("up_proj_bias", (e, f), "expert", etp_dim=1, active=k * f),
                   Param("down_proj_bias", (e, h), "expert", active=k * h)]
    gemms = (Gemm("gate_proj", f, h, NAME, tokens=k, stack=e), Gemm("up_proj", f, h, NAME, tokens=k, stack=e),
             Gemm("down_proj", h, f, NAME, tokens=k, stack=e))
    return Module(NAME, tuple(params), gemms)


def padded_capacity(cfg: ModelConfig, lay: ActivationLayout) -> int | None:
    """The expert capacity where the layer pads to it (`model.moe.pad_to_capacity`): every expert then takes
    exactly that many rows from each rank of its group, whatever the routing; None where the routing decides
    (and under the allgather dispatcher, whose padded gather the plan does not count yet)."""
    moe = cfg.moe
    if not moe.pad_to_capacity or moe.capacity_factor is None or moe.dispatcher == "allgather":
        return None
    return expert_capacity(num_tokens=int(lay.moe_tokens), top_k=moe.top_k, num_experts=moe.num_experts,
                           capacity_factor=moe.capacity_factor)


def expert_rows(cfg: ModelConfig, lay: ActivationLayout) -> float:
    """Rows this rank's grouped experts process for one micro-batch: top_k per routed token at even routing,
    all-gathered over etp, times the stated imbalance (the most loaded rank); padded to capacity, each of its
    E / ep experts takes `capacity` rows from each of the ep ranks (the alltoall dispatcher, or none)."""
    capacity = padded_capacity(cfg, lay)
    if capacity is not None:
        return cfg.moe.num_experts * capacity
    return lay.moe_tokens * cfg.moe.top_k * lay.etp * lay.moe_imbalance


def hierarchical_rows(cfg: ModelConfig, lay: ActivationLayout) -> tuple[int, int]:
    """(rows sent over the network, pairs on this node) of dispatch_hierarchical.py on node 0's first rank, under
    measure's forced routing (the model's router's expected spread over the nodes, `ForcedRouting`): each token
    once per node it needs (this node included) and the (token, expert) pairs that the rank of this local index
    on each node sends here, which this rank permutes and later sums per row;
    padded to capacity c: min(T, E/N c) rows to each node and the node's E/N experts N c pairs each."""
    moe, nodes = cfg.moe, lay.ep_nodes
    tokens, capacity = int(lay.moe_tokens), padded_capacity(cfg, lay)
    if capacity is not None:
        return nodes * min(tokens, moe.num_experts // nodes * capacity), moe.num_experts * capacity
    forced = ForcedRouting.of(moe, nodes)  # measure's routing: the model's router's spread over the nodes
    return sum(forced.domain_tokens(tokens)), nodes * sum(forced.counts(tokens)[: moe.num_experts // nodes])


def saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """The dispatch keeps the permutation (of the rows and of their routing weights); the grouped experts keep
    their input rows, the gate/up output (one storage), the rows' weights cast to the activation dtype and the
    weighted product (the down projection's input): the weights are applied in the activation (Megatron-Core's
    weighted SwiGLU, whose backward forms silu(gate) and the unweighted product again:
    models/moe/weighted_swiglu.py), so the combine is a plain sum that keeps only its indices. Each rank's experts
    see `expert_rows` rows."""
    moe, a, h = cfg.moe, lay.act_bytes, cfg.hidden_size
    t, e, k = lay.moe_tokens, moe.num_experts, moe.top_k
    rows = expert_rows(cfg, lay)
    ffn = moe.ffn_hidden_size / lay.etp
    gathered = moe.dispatcher == "allgather" and lay.ep * lay.etp > 1
    hierarchical = moe.dispatcher == "hierarchical"
    padded = padded_capacity(cfg, lay) is not None
    items: list[Saved] = []
    if hierarchical:
        # the token of each network row (kept by its gather, the weights' gather and the final sum: one storage),
        # and the node's permutation of the pairs it received
        sent, pairs = hierarchical_rows(cfg, lay)
        items += [Saved(REGION, "dispatch.token_ids", INT64 * sent), Saved(REGION, "dispatch.order", INT64 * pairs),
                  Saved(REGION, "dispatch.probs_order", INT64 * pairs)]
    else:
        # The permutation's source index: this rank's slots (t k), the gathered slots routed here (R rows), or
        # padded to capacity the buffer's rows (E x capacity, padding included)
        order = INT64 * (rows if gathered or padded else t * k)
        # the rows' gather and their routing weights' (by the slot, not the token: a second index)
        items += [Saved(REGION, "dispatch.order", order), Saved(REGION, "dispatch.probs_order", order)]
    local = lay.ep // lay.ep_nodes if hierarchical else lay.ep
    if moe.dispatcher in ("alltoall", "hierarchical") and local > 1 and e // lay.ep > 1:
        # received rows (source-major) sorted by local expert, and back: each index_select keeps its index
        items += [Saved(REGION, "dispatch.local_order", INT64 * rows),
                  Saved(REGION, "combine.source_major", INT64 * rows)]
    fp8, rank_experts = lay.kept_fp8(NAME), e / lay.ep
    items += [
        Saved(REGION, "experts.offsets", INT32 * rank_experts),
        *gemm_input(REGION, "experts.input", rows, h, a, fp8, experts=rank_experts),
        Saved(REGION, "experts.gate_up", a * rows * 2 * ffn),
        Saved(REGION, "experts.probs", a * rows),  # the rows' weights cast once (the recomputed region's input too)
        # the weighted SwiGLU keeps only gate, up and the weights (models/moe/weighted_swiglu.py); its output
        # is the down projection's input
        *gemm_input(ACTIVATION, "experts.down_input", rows, ffn, a, fp8, experts=rank_experts),
    ]
    if moe.expert_biases:  # gpt-oss: each row's expert, the index its gate/up/down bias gathers keep (experts.py)
        items.append(Saved(REGION, "experts.bias_index", INT64 * rows))
    # The combine sums the (weighted) expert outputs in fp32 and keeps only indices (permute.py `slot_sum`).
    if gathered:
        # the local rows scatter-added into per-token sums (dispatch_allgather.py): two indices (rows, tokens)
        items.append(Saved(REGION, "combine.indices", 2 * INT64 * rows))
    elif hierarchical:
        # the node's partial sums (dispatch_hierarchical.py `_node_sums`): two indices (rows, network rows; padded,
        # the buffer's rows as they came: one)
        items.append(Saved(REGION, "combine.indices", (1 if padded else 2) * INT64 * pairs))
    else:
        items.append(Saved(REGION, "combine.slot_rows", INT64 * t * k))
    return items


def moved(region: str, cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """Offloaded `moe_act`: the experts' gate and up outputs (the weighted SwiGLU keeps nothing else of its own);
    the rows' weights are a view of the dispatched weights and the weighted product is the down projection's
    input, saved outside."""
    return {"experts.gate_up"} if region == ACTIVATION else set()


def kept_in_offloaded_layer(cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """What offloading the whole MoE layer leaves of these saves: the rows' routing weights (a view), one of the
    dispatch's two permutation indices (a view of the other) and, under tensor or expert parallelism, the
    experts' input rows (then what the dispatch's collectives hand over, kept by them too) unless the experts keep
    an fp8 copy of them."""
    kept = {"experts.probs", "dispatch.order"}
    if (lay.tp > 1 or lay.ep > 1) and lay.kept_fp8(NAME) is None:  # an fp8 copy is the GEMM's own
        kept.add("experts.input")
    return kept
