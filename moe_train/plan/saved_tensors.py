"""What one micro-batch's forward of one layer saves for backward, tensor by tensor, with no recompute (no torch).

The list mirrors what our own modules save (moe_train/models), not a textbook layer: each `Saved` item is one
storage that autograd keeps, found by reading the modules and checked against
`torch.autograd.graph.saved_tensors_hooks` (tests/test_plan.py, world size 1, storages de-duplicated,
parameters excluded). What the code saves, and so what is listed:
- RMSNorm computes in fp32 but keeps its input as it came (bf16 runs: not an fp32 copy) and the fp32
  reciprocal rms per token; its backward forms the normalised value again (models/norm.py).
- A linear layer keeps its input. The norm's output is kept by its first consumer (q/k/v, the dense MLP, the
  shared expert); the router keeps that output too, not an fp32 copy (its math runs in fp32, its backward
  widens the kept input again).
- SDPA (flash-style on CPU and GPU) keeps q, k, v, its output and the fp32 logsumexp: never an s x s matrix.
  GQA keeps k and v with their own head count. Where the device's fused kernel needs one head width (the
  kernel table's `mla_value`: the CPU), MLA zero-pads v (or q and k) to it, so its q, k, v and output are all
  max(qk, v) wide; elsewhere q and k are qk wide, v and the output v wide. o_proj then keeps a contiguous copy
  of the output.
- SwiGLU keeps gate, up, silu(gate) and their product (the down projection's input).
- MoE: the router keeps fp32 scores [T, E], the top-k indices, the normalised top-k weights and their sum;
  the dispatch keeps the permutation (of the rows and of their routing weights); the grouped experts keep their
  input rows, the gate/up output (one storage), the rows' weights cast to the activation dtype, and the weighted
  product (the down projection's input): the weights are applied in the activation (Megatron-Core's weighted
  SwiGLU, whose backward forms silu(gate) and the unweighted product again: models/moe/weighted_swiglu.py), so
  the combine is a plain sum that keeps only its indices.
- Rotary tables: cos/sin are computed once per forward and shared by every layer (counted once, under
  `other`); in a bf16 run FSDP2 hands each layer its own bf16 cast of them, kept by its rotations.
- fp8 GEMMs with `train.fp8.saved_inputs: fp8` keep their input in fp8 instead (`gemm_input`, models/fp8/gemm.py):
  1 byte an element and the fp32 scales of the weight gradient's quantisation (along the tokens), one copy per
  input however many GEMMs read it; the grouped experts' rows with one scale row per block of each expert's
  rows (`grouped_scale_bytes`). Not so: a column-parallel GEMM under sequence parallelism (it keeps its
  sequence shard in bf16 and gathers it again), and the shared experts' gate and up (they read the router's
  input, which stays bf16).

Every item carries the region a recompute policy can drop and how it shards (see `_shard`). Tensor and
sequence parallelism follow Korthikanti et al. (2022): head- and ffn-sharded tensors divide by tp; the rest
(norms, the inputs of column-parallel GEMMs) divide by tp only under sequence parallelism, where a GEMM
after an all-gather keeps only its sequence shard (and all-gathers it again in backward). MoE layers route
a rank's share of the tokens (T / tp); each rank's experts see `top_k` rows per token at even routing (times
`moe_imbalance` on the most loaded rank), all-gathered over etp, with the expert ffn sharded by etp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_train.config.routing_shapes import ForcedRouting, expert_capacity
from moe_train.config.schema import ModelConfig
from moe_train.kernels import kernels_for

FP32 = 4
INT64 = 8
INT32 = 4
FP8 = 1
BLOCKS = {"blockwise": 128, "mxfp8": 32}  # activation blocks along the tokens (models/fp8/scaling.py)


@dataclass(frozen=True)
class Saved:
    """One saved storage: `region` names the code that saves it (what a recompute policy can drop)."""

    region: str
    name: str
    bytes: float


@dataclass(frozen=True)
class ActivationLayout:
    """What shapes one rank's activations: micro-batch, sequence, precision and the sharding of the layer.

    `tokens` is micro_batch * seq_length / cp: the tokens of one micro-batch on this rank.
    """

    micro_batch: int
    seq_length: int
    act_bytes: int = 2
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    ep: int = 1
    etp: int = 1
    moe_imbalance: float = 1.0
    ep_nodes: int = 1  # nodes the ep group spans under the hierarchical dispatcher (`PlanLayout.ep_split`)
    position_batch: int = 1  # rows of position ids: 1 unless documents restart (data.reset_at_eod)
    loss_chunk_tokens: int = 0  # the chunked head + loss (config/loss_chunks.py); 0: unchunked
    documents: bool = False  # data.reset_at_eod: attention restarts at each document (a mask every layer shares)
    device: str = "cpu"  # launch.device: the kernel table's row (MLA's value padding, the document mask's form)
    fp8_kept: str | None = None  # train.fp8.saved_inputs fp8: the recipe whose fp8 inputs the fp8 GEMMs keep
    fp8_modules: tuple[str, ...] = ()  # train.fp8.modules: the GEMM kinds in fp8
    fp8_gemms: tuple[str, ...] = ()  # the GEMM kinds in fp8 whatever they keep (train.fp8.modules under fp8)

    def kept_fp8(self, kind: str) -> str | None:
        """The recipe in which GEMMs of `kind` (train.fp8.modules' names) keep their input, None: as it came."""
        return self.fp8_kept if kind in self.fp8_modules else None

    @property
    def gathers_shards(self) -> bool:
        """Column-parallel GEMMs keep their sequence shard (in bf16) and gather it again in backward."""
        return self.sequence_parallel and self.tp > 1

    @property
    def mla_value_padded(self) -> bool:
        """Whether MLA zero-pads v (or q and k) to one head width: where the device's SDPA kernel needs one."""
        return kernels_for(self.device).mla_value == "padded"

    @property
    def tokens(self) -> float:
        return self.micro_batch * self.seq_length / self.cp

    @property
    def seq_tokens(self) -> float:
        """Tokens a rank holds in the sequence region (norms, residual stream): sharded only under SP."""
        return self.tokens / self.tp if self.sequence_parallel else self.tokens

    @property
    def moe_tokens(self) -> float:
        """Tokens a rank routes: its sequence shard (Megatron-Core requires SP for MoE with tp > 1; without SP
        the tp ranks split the tokens before dispatch)."""
        return self.tokens / self.tp


def norm_items(region: str, prefix: str, tokens: float, width: float, a: int, *, storage_width: float | None = None):
    """RMSNorm: its input as it came (the whole storage it views: `storage_width`), fp32 reciprocal rms per token."""
    return [
        Saved(region, f"{prefix}.input", a * tokens * (storage_width or width)),
        Saved(region, f"{prefix}.rstd", FP32 * tokens),
    ]


def linear_scale_bytes(recipe: str, rows: float, cols: float) -> float:
    """fp32 scales of a GEMM input x [rows, cols] kept as its weight gradient reads it, x^T along the rows: one
    (tensorwise), one per column (rowwise), per column and block of 128 (blockwise) or 32 (MX) rows."""
    if recipe == "tensorwise":
        return FP32
    if recipe == "rowwise":
        return FP32 * cols
    return FP32 * cols * math.ceil(rows / BLOCKS[recipe])


def grouped_scale_bytes(recipe: str, rows: float, cols: float, experts: float) -> float:
    """fp32 scales of the grouped experts' rows [rows, cols] kept along each expert's rows: one (tensorwise), one
    row of scales per expert (rowwise), per block of an expert's rows, at most rows // block + experts of them
    (blockwise, MX; models/fp8/scaling.py `_group_blocks`)."""
    if recipe == "tensorwise":
        return FP32
    if recipe == "rowwise":
        return FP32 * experts * cols
    return FP32 * (math.floor(rows / BLOCKS[recipe]) + experts) * cols


def gemm_input(region: str, name: str, rows: float, cols: float, a: int, recipe: str | None, *,
               experts: float | None = None) -> list[Saved]:
    """A GEMM's input x [rows, cols] as its GEMM keeps it: as it came, or in fp8 (`recipe`) with its scales
    (`{name}.scale`); `experts`: the grouped experts' rows, scaled per expert."""
    if recipe is None:
        return [Saved(region, name, a * rows * cols)]
    scales = (linear_scale_bytes(recipe, rows, cols) if experts is None
              else grouped_scale_bytes(recipe, rows, cols, experts))
    return [Saved(region, name, FP8 * rows * cols), Saved(region, f"{name}.scale", scales)]


def _swiglu(region: str, prefix: str, rows: float, ffn: float, a: int, down: str | None = None) -> list[Saved]:
    """`down`: the recipe in which the down projection keeps its input (the product), None: as it came."""
    return [
        Saved(region, f"{prefix}.gate", a * rows * ffn),
        Saved(region, f"{prefix}.up", a * rows * ffn),
        Saved(region, f"{prefix}.silu", a * rows * ffn),
        *gemm_input(region, f"{prefix}.down_input", rows, ffn, a, down),
    ]


def _rope_casts(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """bf16 runs: FSDP2 casts each layer's floating-point inputs to bf16, the fp32 rotary tables among them, so
    the q and k rotations share one cast cos and sin [position rows, s, rotary_dim / 2] per layer."""
    if lay.act_bytes == FP32:
        return []
    seq = lay.seq_length / lay.cp
    casts = 2 * lay.act_bytes * lay.position_batch * seq * cfg.rotary_dim / 2
    return [Saved("attention", "rope.cos_sin_casts", casts)]


def _attention(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    a, t, ts, h, tp = lay.act_bytes, lay.tokens, lay.seq_tokens, cfg.hidden_size, lay.tp
    heads = cfg.num_attention_heads / tp
    fp8 = lay.kept_fp8("attention")
    column = None if lay.gathers_shards else fp8  # how a column-parallel GEMM keeps its input
    if cfg.family == "deepseek_v3":
        qk, v, r = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
        # The latent projections are replicated over tp and run on the sequence region (sharded under SP); the
        # up projections after the all-gather keep only that shard (parallel/tensor.py).
        items = gemm_input("attn_input", "attention.input", ts, h, a, fp8)  # the input norm's output
        if cfg.q_lora_rank:
            items += norm_items("mla_latent", "q_a_layernorm", ts, cfg.q_lora_rank, a)
            items += gemm_input("mla_latent", "q_b_proj.input", ts, cfg.q_lora_rank, a, column)
        kvl = cfg.kv_lora_rank
        # The norm's input is a view of kv_a_proj's whole output (latent + rope key): it keeps that storage.
        items += norm_items("mla_latent", "kv_a_layernorm", ts, kvl, a, storage_width=kvl + r)
        items += gemm_input("mla_latent", "kv_b_proj.input", ts, kvl, a, column)
        items += _rope_casts(cfg, lay)
        qk_width, v_width = (max(qk, v), max(qk, v)) if lay.mla_value_padded else (qk, v)
        items += [
            Saved("mla_up_proj", "sdpa.q", a * t * heads * qk_width),
            Saved("mla_up_proj", "sdpa.k", a * t * heads * qk_width),
            Saved("mla_up_proj", "sdpa.v", a * t * heads * v_width),
            Saved("core_attn", "sdpa.out", a * t * heads * v_width),
            Saved("core_attn", "sdpa.logsumexp", FP32 * t * heads),
            *gemm_input("attention", "o_proj.input", t, heads * v, a, fp8),
        ]
        return items
    items = gemm_input("attn_input", "attention.input", ts, h, a, column)  # the input norm's output, kept by q/k/v
    d, kv_heads = cfg.attention_head_dim, cfg.kv_heads / tp
    if cfg.qk_norm:
        items += norm_items("attention", "q_norm", t * heads, d, a)
        items += norm_items("attention", "k_norm", t * kv_heads, d, a)
    items += _rope_casts(cfg, lay)
    items += [
        Saved("attention", "sdpa.q", a * t * heads * d),
        Saved("attention", "sdpa.k", a * t * kv_heads * d),
        Saved("attention", "sdpa.v", a * t * kv_heads * d),
        Saved("core_attn", "sdpa.out", a * t * heads * d),
        Saved("core_attn", "sdpa.logsumexp", FP32 * t * heads),
        *gemm_input("attention", "o_proj.input", t, heads * d, a, fp8),
    ]
    return items


def _dense_mlp(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    a, t, fp8 = lay.act_bytes, lay.tokens, lay.kept_fp8("mlp")
    column = None if lay.gathers_shards else fp8
    return gemm_input("mlp_input", "mlp.input", lay.seq_tokens, cfg.hidden_size, a, column) + _swiglu(
        "mlp", "mlp", t, cfg.ffn_hidden_size / lay.tp, a, fp8
    )


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


def _moe(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    moe, a, h = cfg.moe, lay.act_bytes, cfg.hidden_size
    t = lay.moe_tokens
    e, k = moe.num_experts, moe.top_k
    router = moe.router
    # The router keeps its input as it is (the norm's output; the shared expert's input too) and its weight
    # (a parameter), widening both to fp32 again in backward.
    items = [Saved("moe", "router.input", a * t * h)]
    items += [
        Saved("moe", "router.scores", FP32 * t * e),
        Saved("moe", "router.topk_indices", INT64 * t * k),
        Saved("moe", "router.topk_sum", FP32 * t),
        Saved("moe", "router.topk_scores", FP32 * t * k),
    ]
    if router.load_balancing == "seq_aux_loss" and router.aux_loss_coeff > 0:
        items += [
            Saved("moe", "seq_aux_loss.score_sum", FP32 * t),
            Saved("moe", "seq_aux_loss.load", FP32 * lay.micro_batch * e),
        ]
    if router.z_loss_coeff > 0:
        items += [Saved("moe", "z_loss.logits", FP32 * t * e), Saved("moe", "z_loss.logsumexp", FP32 * t)]
    rows = expert_rows(cfg, lay)
    ffn = moe.ffn_hidden_size / lay.etp
    gathered = moe.dispatcher == "allgather" and lay.ep * lay.etp > 1
    hierarchical = moe.dispatcher == "hierarchical"
    if hierarchical:
        # the token of each network row (kept by its gather, the weights' gather and the final sum: one storage),
        # and the node's permutation of the pairs it received
        sent, pairs = hierarchical_rows(cfg, lay)
        items += [Saved("moe", "dispatch.token_ids", INT64 * sent), Saved("moe", "dispatch.order", INT64 * pairs),
                  Saved("moe", "dispatch.probs_order", INT64 * pairs)]
    else:
        # The permutation's source index: this rank's slots (t k), the gathered slots routed here (R rows), or
        # padded to capacity the buffer's rows (E x capacity, padding included)
        padded = padded_capacity(cfg, lay) is not None
        order = INT64 * (rows if gathered or padded else t * k)
        # the rows' gather and their routing weights' (by the slot, not the token: a second index)
        items += [Saved("moe", "dispatch.order", order), Saved("moe", "dispatch.probs_order", order)]
    local = lay.ep // lay.ep_nodes if hierarchical else lay.ep
    if moe.dispatcher in ("alltoall", "hierarchical") and local > 1 and e // lay.ep > 1:
        # received rows (source-major) sorted by local expert, and back: each index_select keeps its index
        items += [Saved("moe", "dispatch.local_order", INT64 * rows),
                  Saved("moe", "combine.source_major", INT64 * rows)]
    fp8, rank_experts = lay.kept_fp8("experts"), e / lay.ep
    items += [
        Saved("moe", "experts.offsets", INT32 * rank_experts),
        *gemm_input("moe", "experts.input", rows, h, a, fp8, experts=rank_experts),
        Saved("moe", "experts.gate_up", a * rows * 2 * ffn),
        Saved("moe", "experts.probs", a * rows),  # the rows' weights cast once (the recomputed region's input too)
        # the weighted SwiGLU keeps only gate, up and the weights (models/moe/weighted_swiglu.py); its output
        # is the down projection's input
        *gemm_input("moe_act", "experts.down_input", rows, ffn, a, fp8, experts=rank_experts),
    ]
    if moe.expert_biases:  # gpt-oss: each row's expert, the index its gate/up/down bias gathers keep (experts.py)
        items.append(Saved("moe", "experts.bias_index", INT64 * rows))
    # The combine sums the (weighted) expert outputs in fp32 and keeps only indices (permute.py `slot_sum`).
    if gathered:
        # the local rows scatter-added into per-token sums (dispatch_allgather.py): two indices (rows, tokens)
        items.append(Saved("moe", "combine.indices", 2 * INT64 * rows))
    elif hierarchical:
        # the node's partial sums (dispatch_hierarchical.py `_node_sums`): two indices (rows, network rows; padded,
        # the buffer's rows as they came: one)
        indices = 1 if padded_capacity(cfg, lay) is not None else 2
        items.append(Saved("moe", "combine.indices", indices * INT64 * pairs))
    else:
        items.append(Saved("moe", "combine.slot_rows", INT64 * t * k))
    if moe.shared_expert_ffn_hidden_size:
        # The shared expert's input is the norm's output, which the router keeps already (one storage).
        # Tensor-parallel like a dense MLP: the tp ranks' token shares gathered, the ffn sharded.
        # Its gate and up keep that storage in fp8 runs too (models/fp8/select.py); the down projection its own.
        items += _swiglu("shared_experts", "shared_experts", lay.tokens, moe.shared_expert_ffn_hidden_size / lay.tp, a,
                         lay.kept_fp8("shared_experts"))
    return items


def layer_items(cfg: ModelConfig, lay: ActivationLayout, *, layer_index: int) -> list[Saved]:
    """Every storage one micro-batch's forward of decoder layer `layer_index` saves, with no recompute."""
    a, ts, h = lay.act_bytes, lay.seq_tokens, cfg.hidden_size
    items = norm_items("input_layernorm", "input_layernorm", ts, h, a)
    items += _attention(cfg, lay)
    items += norm_items("post_attention_layernorm", "post_attention_layernorm", ts, h, a)
    items += _moe(cfg, lay) if cfg.is_moe_layer(layer_index) else _dense_mlp(cfg, lay)
    return items
