"""The recipe schema: every field a YAML recipe may hold (docs/interfaces.md records each).

Every model forbids unknown keys, so a typo is an error rather than a silently ignored setting. Rules that
relate several fields live in `rules.py`, where all problems can be reported at once instead of stopping at
the first model validator that fails.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt
from pydantic_core import PydanticCustomError

from moe_train.config.mesh_shape import (
    data_parallel_size,
    expert_data_parallel_size,
    ranks_beside_dp,
    ranks_beside_edp,
    stage_ranks,
)


def _number(value: Any) -> Any:
    """A YAML number, not a boolean or a string that pydantic's lax mode would read as one (`true` as 1.0)."""
    if isinstance(value, (bool, str)):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


# Every integer field is a StrictInt: a YAML int, never `true` read as 1 (one head GEMM per token for
# train.loss_chunk_tokens) nor a float or a string. Every float field is a Number: ints welcome, booleans and
# strings not; and no field takes inf or nan (`allow_inf_nan`: a timeout of .inf overflows timedelta at start-up).
Number = Annotated[float, BeforeValidator(_number)]

# Sizes no hardware can hold, refused by the schema (a typo such as 10**12, which the login half's layer-by-
# layer arithmetic would otherwise walk for hours): 100x the deepest published LLM (DeepSeek-V3: 61 layers)
# and 256x the widest expert count (DeepSeek-V3: 256; Kimi K2: 384).
MAX_LAYERS = 10_000
MAX_EXPERTS = 65_536
# So is a cluster bigger than any built: the largest training clusters hold ~100,000 GPUs (far fewer nodes) and
# the largest NVLink domain announced 576. 10**12 nodes otherwise validated as "can train this", and every
# per-rank count of the login half (world size, dp, the batch's divisibility) grew with it.
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 1_024
# Collective timeouts beyond a week are typos too (and past ~1.4e12 minutes, timedelta overflows).
MAX_TIMEOUT_MINUTES = 7 * 24 * 60


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, values are immutable once resolved."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------------- model


class YarnScaling(Section):
    type: Literal["yarn"] = "yarn"
    factor: Number = Field(gt=0)
    original_max_position_embeddings: StrictInt = Field(gt=0)
    beta_fast: Number = 32.0
    beta_slow: Number = 1.0
    mscale: Number = 1.0
    mscale_all_dim: Number = 0.0
    truncate: bool = Field(True, description="Round the ramp's correction dimensions to integers (transformers' "
                           "default); false: gpt-oss's unrounded ramp.")


class RopeConfig(Section):
    theta: Number = Field(10000.0, gt=0)
    scaling: YarnScaling | None = None
    partial_rotary_factor: Number = Field(
        1.0, gt=0, le=1, description="The share of each query/key head that rotates: its first "
        "int(head_dim x factor) features, half-split as transformers' apply_rotary_pos_emb, the rest pass "
        "through (GLM-4.5: 0.5). GQA families only; MLA rotates qk_rope_head_dim.")


class RouterConfig(Section):
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    normalize_topk: bool = Field(True, description="Renormalise the top-k weights to sum to 1.")
    num_groups: StrictInt | None = Field(None, ge=1, description="Group-limited routing: expert groups.")
    group_top_k: StrictInt | None = Field(None, ge=1, description="Groups each token may route into.")
    topk_scaling_factor: Number = Field(1.0, gt=0)
    expert_bias: bool = Field(False, description="Aux-loss-free balancing: a bias used for selection only.")
    learned_bias: bool = Field(False, description="A trained bias added to the router's logits before the choice "
                               "and the scores (gpt-oss's router.bias).")
    bias_update_rate: Number = Field(1e-3, ge=0)
    load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "all_layers_aux_loss", "none"] = Field(
        "aux_loss",
        description="aux_loss: per layer over each micro-batch; seq_aux_loss: per sequence; global_aux_loss: over "
        "the data-parallel group's micro-batches so far; all_layers_aux_loss: transformers' Qwen3-MoE loss over "
        "all layers together (one pipeline stage only).",
    )
    aux_loss_coeff: Number = Field(1e-3, ge=0)
    z_loss_coeff: Number = Field(0.0, ge=0)
    logit_bias: tuple[Number, ...] | None = Field(
        None, description="A test and benchmark knob, not a training setting: one value per expert added to the "
        "router's logits, which skews real routing (bench/bench_routing.py, the placement tests); null: none.")


class ClampedSwiGLU(Section):
    """gpt-oss's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""

    limit: Number = Field(7.0, gt=0)
    alpha: Number = Field(1.702, gt=0)


class MoEConfig(Section):
    num_experts: StrictInt = Field(ge=1, le=MAX_EXPERTS)
    top_k: StrictInt = Field(ge=1)
    ffn_hidden_size: StrictInt = Field(ge=1, description="Hidden size of each routed expert's SwiGLU.")
    shared_expert_ffn_hidden_size: StrictInt = Field(0, ge=0, description="0: no shared expert.")
    expert_biases: bool = Field(False, description="Biases on every routed expert's gate, up and down "
                                "projections (gpt-oss).")
    clamped_swiglu: ClampedSwiGLU | None = Field(None, description="null: the plain SwiGLU; gpt-oss's clamped one.")
    router: RouterConfig = RouterConfig()
    dispatcher: Literal["alltoall", "allgather", "hierarchical"] = Field(
        "alltoall", description="hierarchical: node-aware all-to-all, a token crosses the network once per "
        "destination node and fans out inside it (models/moe/dispatch_hierarchical.py).")
    capacity_factor: Number | None = Field(None, gt=0, description="null: dropless.")
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False
    placement: str = Field(
        "contiguous", description="Which expert-parallel slot holds each expert: contiguous (rank r holds experts "
        "[r E/ep, (r+1) E/ep)) or a placement file (`moe-train experts place`, docs/interfaces.md). A layout "
        "setting: checkpoints keep experts by their global id.")


class ModelConfig(Section):
    family: Literal["qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"]
    num_layers: StrictInt = Field(ge=1, le=MAX_LAYERS)
    hidden_size: StrictInt = Field(ge=1)
    num_attention_heads: StrictInt = Field(ge=1)
    num_query_groups: StrictInt | None = Field(None, ge=1, description="KV heads; null: as many as attention heads.")
    head_dim: StrictInt | None = Field(None, ge=1, description="null: hidden_size / num_attention_heads.")
    ffn_hidden_size: StrictInt = Field(ge=1, description="Dense SwiGLU hidden size (dense layers).")
    vocab_size: StrictInt = Field(ge=1)
    make_vocab_size_divisible_by: StrictInt = Field(128, ge=1)
    max_position_embeddings: StrictInt = Field(4096, ge=1)
    tie_embeddings: bool = False
    qk_norm: bool = True
    attention_bias: bool = Field(False, description="Biases on the q, k and v projections (GLM-4.5); GQA only.")
    norm_eps: Number = Field(1e-6, gt=0)
    init_std: Number = Field(0.02, gt=0)
    rope: RopeConfig = RopeConfig()
    # deepseek_v3 only (multi-head latent attention); dense-first layers and multi-token prediction: deepseek_v3
    # and glm4_moe (FAMILY_FIELDS)
    q_lora_rank: StrictInt | None = Field(None, ge=1)
    kv_lora_rank: StrictInt | None = Field(None, ge=1)
    qk_nope_head_dim: StrictInt | None = Field(None, ge=1)
    qk_rope_head_dim: StrictInt | None = Field(None, ge=1)
    v_head_dim: StrictInt | None = Field(None, ge=1)
    first_k_dense: StrictInt = Field(0, ge=0)
    mtp_layers: StrictInt = Field(0, ge=0, le=MAX_LAYERS)
    mtp_loss_weight: Number = Field(0.3, ge=0)
    # gpt_oss only (FAMILY_FIELDS)
    attention_output_bias: bool = Field(False, description="A bias on o_proj (gpt-oss).")
    attention_sinks: bool = Field(False, description="A learned logit per head joined to every query's softmax, "
                                  "with no value (gpt-oss's sinks).")
    sliding_window: StrictInt | None = Field(None, ge=1, description="Tokens a sliding_attention layer sees, "
                                             "itself included (transformers' sliding_window).")
    layer_types: tuple[Literal["sliding_attention", "full_attention"], ...] | None = Field(
        None, description="Each layer's attention, transformers' layer_types; null: every layer full.")
    moe: MoEConfig | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Features of each query/key head that rotary embeddings turn: MLA's rope part, or the first
        `rope.partial_rotary_factor` of a GQA head (transformers' int(head_dim x factor))."""
        if self.family == "deepseek_v3":
            return self.qk_rope_head_dim
        return int(self.attention_head_dim * self.rope.partial_rotary_factor)

    def attention_window(self, index: int) -> int | None:
        """The sliding window of layer `index` (None: full causal attention)."""
        if self.layer_types is None or self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    def padded_vocab_size(self) -> int:
        """The vocabulary padded to a multiple of make_vocab_size_divisible_by. Never by tp (Megatron-LM pads by
        divisible_by x tp): every layout must have the same parameter shapes to reshard (docs/decisions.md), so
        validate checks that tp divides this size instead."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index >= self.first_k_dense

    def moe_layers_in(self, start: int, stop: int) -> int:
        """How many of the layers [start, stop) are MoE layers (`is_moe_layer`), counted rather than walked."""
        return 0 if self.moe is None else max(0, stop - max(start, self.first_k_dense))


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
DENSE_FIRST_MTP_FIELDS = ("first_k_dense", "mtp_layers", "mtp_loss_weight")
GPT_OSS_FIELDS = ("attention_output_bias", "attention_sinks", "sliding_window", "layer_types")
# The model fields only some families have (a recipe of another family that sets one is refused, rules.py);
# every other field is common to all. GQA's attention_bias and rope.partial_rotary_factor are refused for MLA.
FAMILY_FIELDS = {
    "qwen3": (),
    "qwen3_moe": (),
    "deepseek_v3": MLA_FIELDS + DENSE_FIRST_MTP_FIELDS,
    "glm4_moe": DENSE_FIRST_MTP_FIELDS,
    "gpt_oss": GPT_OSS_FIELDS,
}
FAMILY_ONLY_FIELDS = MLA_FIELDS + DENSE_FIRST_MTP_FIELDS + GPT_OSS_FIELDS
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")


# ------------------------------------------------------------------------------------------------ parallel


RecomputeModule = Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]


class RecomputeConfig(Section):
    granularity: Literal["none", "selective", "full"] = "none"
    modules: tuple[RecomputeModule, ...] = ("core_attn",)
    method: Literal["uniform", "block"] = "uniform"
    num_layers: StrictInt = Field(1, ge=1, description="Full recompute: layers per chunk (uniform) or count (block).")


class OffloadConfig(Section):
    modules: tuple[RecomputeModule, ...] = Field(
        (), description="Activation offloading: the regions (the recompute policy's module names) whose saved "
        "tensors go to host memory after their layer's forward and come back ahead of its backward "
        "(parallel/offload.py). A region is recomputed or offloaded, not both. Does not change a run's numbers.")


class ParallelConfig(Section):
    tp: StrictInt = Field(1, ge=1)
    pp: StrictInt = Field(1, ge=1)
    vpp: StrictInt = Field(1, ge=1, description="Virtual pipeline stages per pipeline rank.")
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe", "zero_bubble", "dualpipev"] = Field(
        "1f1b", description="dualpipev: torch's DualPipeV (vpp 2, the stages in a V: rank r holds stages r and "
        "2 pp - 1 - r), with full backwards; under ep_overlap its paired forward+backward actions run overlapped.")
    pp_layout: str | None = Field(None, description="Megatron notation, e.g. 'Et*3|(tt|)*29m|L'.")
    cp: StrictInt = Field(1, ge=1, description="Context parallelism: each sequence split over cp ranks (2*cp chunks, "
                    "rank r holding chunks r and 2*cp-1-r).")
    cp_comm: Literal["p2p", "allgather"] | None = Field(
        None, description="How attention under cp > 1 exchanges keys and values: p2p (a ring, fully masked "
        "blocks skipped) or allgather. null: the family's default (p2p for GQA, allgather for MLA). Does not "
        "change a run's numbers.")
    ep: StrictInt = Field(1, ge=1)
    etp: StrictInt = Field(1, ge=1)
    dp: StrictInt | None = Field(None, ge=1, description="null: derived from the world size.")
    dp_replicate: StrictInt = Field(
        1, ge=1, description="HSDP: dp splits into dp_replicate replicas (dpr, across nodes) x dp/dp_replicate "
        "shards (dps, within a node); parameters are sharded over dps and replicated over dpr, gradients "
        "reduce-scattered within dps and all-reduced across dpr. Experts replicate over the same dpr. 1: FSDP."
    )
    sequence_parallel: bool = False
    ep_overlap: bool = Field(
        False, description="Overlapped micro-batches (pp = 1): the forward of micro-batch i+1 and the backward of "
        "micro-batch i run as a pair, taking turns at every expert-parallel collective, so each dispatch and "
        "combine of one runs while the other computes (parallel/overlap.py). The same numbers bit for bit."
    )
    split_wgrad: bool = Field(
        False, description="The routed experts' weight gradients delayed to run while the dispatch's backward "
        "all-to-all is in flight (Megatron-Core's --delay-wgrad-compute; models/moe/deferred_wgrad.py), with or "
        "without ep_overlap. The same numbers bit for bit. Needs ep > 1 and pp = 1."
    )
    recompute: RecomputeConfig = RecomputeConfig()
    offload: OffloadConfig = OffloadConfig()
    reshard_after_forward: bool | None = Field(
        None, description="FSDP2: free gathered parameters after each forward (less memory, one more all-gather "
        "per micro-batch). null: yes without pipeline parallelism, no with it (a stage's micro-batches interleave "
        "forwards and backwards, so resharding would gather once per micro-batch)."
    )

    param_gather: Literal["per_microbatch", "per_step"] | None = Field(
        None, description="FSDP2: gather each unit's parameters for every micro-batch (per_microbatch) or once "
        "per step, keeping them unsharded over the step's micro-batches (per_step: more memory, fewer "
        "all-gathers; needs reshard_after_forward false or null). null: per_microbatch without pipeline "
        "parallelism, per_step with it (what torch's schedules do with a stage that does not reshard)."
    )
    grad_reduce: Literal["per_microbatch", "per_step"] = Field(
        "per_step", description="FSDP2: reduce-scatter gradients after every micro-batch's backward into the fp32 "
        "shards (holding one unit's unsharded gradient at a time, and one reduce-scatter per micro-batch) or "
        "once, in the last micro-batch's (holding the stage's unsharded fp32 gradients over the step). Under "
        "pipeline parallelism the same: every stage backward, or once after the schedule's last."
    )

    @property
    def gathers_per_step(self) -> bool:
        """Whether FSDP2 gathers each unit's parameters once per step (`param_gather`, resolved; ep_overlap's
        pairs run two micro-batches through a unit at once, so they keep it gathered, as pipelines do)."""
        return self.param_gather == "per_step" if self.param_gather is not None else self.pp > 1 or self.ep_overlap

    def cp_exchange(self, family: str) -> str:
        """`cp_comm`, or the family's default when null. GQA (qwen3, qwen3_moe): the ring, whose p2p sends of a
        few K/V heads overlap the blocks' compute and never hold the whole sequence's K/V; MLA (deepseek_v3):
        the all-gather, Megatron-Core's choice for MLA (one collective per layer instead of cp-1 dependent
        exchanges of its wide per-head K/V)."""
        if self.cp_comm is not None:
            return self.cp_comm
        return "allgather" if family == "deepseek_v3" else "p2p"

    @property
    def reshards_after_forward(self) -> bool:
        """`reshard_after_forward`, resolved: null frees gathered parameters after forward exactly when they are
        gathered for every micro-batch."""
        return self.reshard_after_forward if self.reshard_after_forward is not None else not self.gathers_per_step

    @property
    def experts_apart(self) -> bool:
        """Whether routed experts are an FSDP2 unit of their own. Parallel folding gives them other ranks than
        the dense parameters (edp != dp) once tp, cp, ep or etp exceed 1, and ep/etp make them DTensors of the
        expert mesh; otherwise edp is dp, rank for rank, and a block gathers and reduces its experts with it:
        one all-gather and one reduce-scatter per block instead of two (torchtitan's choice too; DP=2 steps of
        the default model x0.77-0.95 on gloo, four side-by-side pairs)."""
        return self.tp * self.cp * self.ep * self.etp > 1


# --------------------------------------------------------------------------------------------------- train


FP8_MODULES = ("attention", "mlp", "shared_experts", "experts", "head")


class Fp8Config(Section):
    """train.precision fp8: the scaling recipe, the library and the GEMMs it covers (docs/fp8.md)."""

    recipe: Literal["tensorwise", "rowwise", "blockwise", "mxfp8", "auto"] = Field(
        "tensorwise", description="Scales per tensor, per row, per 1x128/128x128 block (DeepSeek-V3) or per "
        "32-element MX block (E8M0, sm100); auto: blockwise on sm90, mxfp8 on sm100, tensorwise on the CPU "
        "(config/fp8_auto.py).")
    backend: Literal["torchao", "te"] = Field("torchao", description="torchao's scaling at the engine's GEMM site; "
                                              "te: transformer-engine (not built yet).")
    modules: tuple[Literal["attention", "mlp", "shared_experts", "experts", "head"], ...] = Field(
        ("attention", "mlp", "shared_experts", "experts"), description="The GEMMs in fp8; the head is left out "
        "by default.")
    fp8_all_gather: bool = Field(False, description="FSDP2 gathers weights in fp8 (torchao: tensorwise only).")
    saved_inputs: Literal["bf16", "fp8"] = Field(
        "bf16", description="What each fp8 GEMM keeps of its input for backward: bf16 (re-quantised there), or fp8 "
        "data and scales quantised as the weight gradient reads them (Megatron-Core/transformer-engine's and "
        "DeepSeek-V3's). The same numbers bit for bit; fp8 holds about half the bytes.")


class MuonConfig(Section):
    """train.optimizer muon: Newton-Schulz orthogonalised momentum for the hidden matrices (docs/optimizer.md);
    the parameters it leaves out train with AdamW on train's lr, betas, eps and weight_decay."""

    momentum: Number = Field(0.95, ge=0, lt=1, description="The momentum buffer's decay.")
    nesterov: bool = Field(True, description="Orthogonalise grad + momentum * buffer (Nesterov), not the buffer.")
    ns_steps: StrictInt = Field(5, ge=1, le=20, description="Newton-Schulz iterations per matrix.")
    adjust_lr: bool = Field(True, description="Scale each update by 0.2 * sqrt(max(rows, cols)) (Moonlight), so "
                            "its RMS matches AdamW's and AdamW's lr carries over; false: sqrt(max(1, rows/cols)) "
                            "(Keller Jordan's).")
    weight_decay: Number | None = Field(None, ge=0, description="Decoupled decay of the Muon matrices; null: "
                                       "train.weight_decay.")
    exclude: tuple[str, ...] = Field(("embed_tokens", "lm_head", "router", "eh_proj"), description="Module names "
                                     "(any component of a parameter's dotted path) whose matrices train with AdamW.")
    qk_clip: Number | None = Field(None, gt=0, description="MuonClip: after a step, scale down the query and key "
                                  "weights of each head whose largest pre-softmax logit exceeded this; null: off.")


class TrainConfig(Section):
    seq_length: StrictInt = Field(ge=1)
    micro_batch_size: StrictInt = Field(1, ge=1)
    global_batch_size: StrictInt = Field(ge=1)
    steps: StrictInt = Field(ge=1, description="The schedule's horizon; COMPLETE is written when reached.")
    exit_at_step: StrictInt | None = Field(None, ge=1, description="Stop early: checkpoint and exit 0.")
    lr: Number = Field(3e-4, gt=0)
    min_lr: Number = Field(3e-5, ge=0)
    warmup_steps: StrictInt = Field(0, ge=0)
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    wsd_decay_fraction: Number = Field(0.2, gt=0, le=1, description="wsd: share of steps spent decaying.")
    weight_decay: Number = Field(0.1, ge=0)
    adam_beta1: Number = Field(0.9, ge=0, lt=1)
    adam_beta2: Number = Field(0.95, ge=0, lt=1)
    adam_eps: Number = Field(1e-8, gt=0)
    grad_clip: Number | None = Field(1.0, gt=0, description="null: no clipping.")
    precision: Literal["fp32", "bf16", "fp8"] = Field(
        "bf16", description="fp8: bf16 compute around fp8 GEMMs (train.fp8); master weights stay fp32.")
    fp8: Fp8Config = Field(default_factory=Fp8Config, description="Read with precision fp8 only.")
    adam_moment_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="AdamW's two moments stored in bf16 (half their memory; each step computes in fp32, "
        "Megatron-Core's precision-aware optimizer); master weights stay fp32. Muon's momentum follows it.")
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="muon: train.muon's orthogonalised momentum "
                                                "for hidden matrices, AdamW for the rest (docs/optimizer.md).")
    muon: MuonConfig = Field(default_factory=MuonConfig, description="Read with optimizer muon only.")
    seed: StrictInt = 1234
    deterministic: bool = Field(
        False, description="Deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG): "
        "bitwise resume and layout equality on CUDA, at a speed cost (docs/gpu.md).")
    loss_chunk_tokens: StrictInt | None = Field(
        None, ge=0, description="Tokens per chunk of the head GEMM + cross-entropy, which then keeps one fp32 "
        "log-sum-exp per token instead of the logits and recomputes each chunk's logits in backward; 0: "
        "unchunked; null: chunks of 1,024 where a micro-batch's fp32 logits would exceed 1 GiB "
        "(moe_train/config/loss_chunks.py).")
    compile: bool | None = Field(
        None, description="Regional torch.compile of each decoder block; null: on for cuda, off for cpu "
        "(moe_train/kernels.py). Changes no number: an ignored field of the run folder.")
    eval_interval: StrictInt | None = Field(None, ge=1, description="null: no evaluation.")
    eval_steps: StrictInt = Field(1, ge=1)
    on_nonfinite: Literal["skip", "stop"] = "skip"
    loss_spike_threshold: Number | None = Field(
        None, gt=1, description="Reject a step whose loss is over this factor x the mean of the last "
        "loss_spike_window applied steps' losses; null: no spike check.")
    loss_spike_window: StrictInt = Field(20, ge=1, description="Applied steps the loss-spike check averages over.")
    on_loss_spike: Literal["skip", "stop"] = Field("skip", description="A rejected spike: skip it or stop.")
    max_skipped_steps: StrictInt = Field(10, ge=0, description="Skipped steps (non-finite or spikes) tolerated per "
                                         "run.")

    @property
    def compute_precision(self) -> Literal["fp32", "bf16"]:
        """The dtype activations and non-fp8 GEMMs compute in: bf16 around fp8's GEMMs."""
        return "fp32" if self.precision == "fp32" else "bf16"


# ---------------------------------------------------------------------------------------------------- data


class DataConfig(Section):
    source: Literal["builtin", "mock", "indexed"] = "builtin"
    paths: tuple[str, ...] = Field((), description="indexed: .bin/.idx prefixes (without extension).")
    weights: tuple[Number, ...] | None = Field(None, description="Blending weights, one per path.")
    tokenizer: str = Field("byte", description="'byte' or a tokenizer.json path.")
    valid_fraction: Number = Field(0.0, ge=0, lt=1)
    reset_at_eod: bool = False


# ---------------------------------------------------------------------------------------------- checkpoint


class CheckpointConfig(Section):
    dir: str | None = Field(None, description="null: {run_dir}/checkpoints.")
    interval: StrictInt | None = Field(None, ge=1, description="Steps between checkpoints; null: only at the end.")
    keep: StrictInt | None = Field(2, ge=1, description="Newest checkpoints kept; null: all.")
    resume: str = Field("auto", description="auto | required | never | a checkpoint path.")
    init_from: str | None = Field(None, description="A model-only checkpoint (e.g. from convert from-hf).")
    async_save: bool = Field(False, description="Write checkpoints in the background (the last one and a "
                             "preemption's stay synchronous).")


class WandbConfig(Section):
    project: str = Field(description="The W&B project.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "offline", description="offline: no network, files under {logging.dir}/wandb (`wandb sync` uploads them).")


class LoggingConfig(Section):
    dir: str | None = Field(None, description="null: {run_dir}.")
    interval: StrictInt = Field(1, ge=1)
    tensorboard: bool = False
    wandb: WandbConfig | None = Field(None, description="Weights & Biases logging beside metrics.jsonl.")
    routing_trace: bool = Field(False, description="Write tokens per expert per MoE layer per step to the run "
                                "folder's routing.jsonl (what `experts place` and `plan --routing` read).")


# -------------------------------------------------------------------------------------------------- launch


class SlurmConfig(Section):
    # `time: 60` (minutes) is as valid to SLURM as `time: "01:00:00"`.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False,
                              coerce_numbers_to_str=True)

    partition: str | None = None
    account: str | None = None
    time: str | None = Field(None, description="Wall-clock limit, e.g. '04:00:00'.")
    job_name: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = True
    cpus_per_gpu: StrictInt | None = Field(
        None, ge=1, description="CPU cores per GPU rank (cuda: --cpus-per-task = gpus_per_node x this); null: the "
        "hardware table's cpus_per_gpu of launch.gpu.")
    extra_sbatch: tuple[str, ...] = Field((), description="Extra #SBATCH directives, e.g. '--mem=0'.")
    signal_seconds: StrictInt = Field(120, ge=0, description="Preemption notice this long before the time limit.")
    requeue: bool = True
    max_restarts: StrictInt = Field(3, ge=0)
    container_image: str | None = None


class LaunchConfig(Section):
    device: Literal["cpu", "cuda"] = "cpu"
    gpu: str = Field("cpu", description="An id of the hardware table (moe-train validate lists them).")
    nodes: StrictInt = Field(1, ge=1, le=MAX_NODES, description="Nodes of the job (at most 100,000).")
    gpus_per_node: StrictInt = Field(1, ge=1, le=MAX_GPUS_PER_NODE,
                                     description="Ranks per node, also on CPU (at most 1,024).")
    timeout_minutes: Number = Field(10.0, gt=0, le=MAX_TIMEOUT_MINUTES,
                                    description="Timeout of a training step's collectives (at most a week).")
    startup_timeout_minutes: Number = Field(
        30.0, gt=0, le=MAX_TIMEOUT_MINUTES, description="Timeout of collectives until the first step has run "
        "(rendezvous, NCCL set-up, checkpoint load, first step; at most a week).")
    env: dict[str, str] = Field(default_factory=dict)
    setup: tuple[str, ...] = Field((), description="Shell lines run before the job (trusted, not quoted).")
    cluster: str | None = Field(None, description="A cluster profile name or path supplying launch defaults.")
    slurm: SlurmConfig = SlurmConfig()

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


# -------------------------------------------------------------------------------------------------- recipe


class Recipe(Section):
    name: str = Field(min_length=1)
    extends: str | None = None
    run_dir: str = "runs/{name}"
    provenance: dict[str, Any] | None = None
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    launch: LaunchConfig = LaunchConfig()

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    def layout_dp(self) -> int | None:
        """Data-parallel size (config/mesh_shape.py `data_parallel_size`): None when the world size does not
        divide by pp*cp*tp (the rules report that)."""
        return data_parallel_size(self.world_size, self.parallel)

    def layout_edp(self) -> int | None:
        """Expert data-parallel size (config/mesh_shape.py `expert_data_parallel_size`): None when dp is undefined
        or ep*etp does not divide dp*cp*tp (the rules report which)."""
        return expert_data_parallel_size(self.layout_dp(), self.parallel)

    @property
    def dp(self) -> int:
        """`layout_dp()` of a recipe whose layout is valid (every loaded recipe): raises ValueError otherwise."""
        dp = self.layout_dp()
        if dp is None:
            raise ValueError(f"no data-parallel size: world size {self.world_size} is not divisible by pp*cp*tp = "
                             f"{ranks_beside_dp(self.parallel)}")
        return dp

    @property
    def edp(self) -> int:
        """`layout_edp()` of a recipe whose layout is valid (every loaded recipe): raises ValueError otherwise."""
        edp = self.layout_edp()
        if edp is None:
            raise ValueError(f"no expert data-parallel size: dp*cp*tp = {stage_ranks(self.dp, self.parallel)} is not "
                             f"divisible by ep*etp = {ranks_beside_edp(self.parallel)}")
        return edp

    def resolved_run_dir(self) -> str:
        return self.run_dir.replace("{name}", self.name)

    def checkpoint_dir(self) -> str:
        return (self.checkpoint.dir or "{run_dir}/checkpoints").replace("{run_dir}", self.resolved_run_dir())

    def logging_dir(self) -> str:
        return (self.logging.dir or "{run_dir}").replace("{run_dir}", self.resolved_run_dir())
