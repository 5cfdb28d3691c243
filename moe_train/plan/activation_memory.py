"""Bytes one rank keeps for backward on the device, per layer, model chunk, head and MTP module, under the
recipe's recompute policy (no torch): the saved items of plan/saved_tensors.py, less what selective recompute
drops (plan/selective_recompute.py) and what activation offloading moves to the host
(plan/offloaded_saves.py), or under full recompute only each checkpointed group's input.
"""

from __future__ import annotations

from moe_train.config.schema import ModelConfig
from moe_train.kernels import kernels_for
from moe_train.models.declarations import embedding as ends
from moe_train.models.declarations import mtp, rope

from .offloaded_saves import offloaded_items
from .recompute_policy import RecomputePolicy, recompute_groups
from .saved_tensors import FP32, INT32, INT64, ActivationLayout, Saved, layer_items
from .selective_recompute import apply_selective


def layer_activation_bytes(
    cfg: ModelConfig, lay: ActivationLayout, *, layer_index: int, policy: RecomputePolicy = RecomputePolicy()
) -> float:
    """Bytes one layer keeps for backward on the device under a selective (or no) policy; full recompute is per
    chunk (see `full_recompute_bytes`)."""
    return _kind_bytes(cfg, lay, cfg.is_moe_layer(layer_index), policy)


def layer_offloaded_bytes(
    cfg: ModelConfig, lay: ActivationLayout, *, layer_index: int, policy: RecomputePolicy = RecomputePolicy()
) -> float:
    """Bytes of one layer's saves that `policy.offload` moves to the host pool (measure's
    `offloaded_bytes_per_layer`)."""
    return _kind_split(cfg, lay, cfg.is_moe_layer(layer_index), policy)[1]


_KIND_CACHE: dict[tuple, tuple[ModelConfig, tuple[float, float]]] = {}


def _split(items: list[Saved], cfg: ModelConfig, lay: ActivationLayout, policy: RecomputePolicy):
    """(bytes of `items` that stay on the device, bytes the offloaded regions move to the host)."""
    moved = sum(i.bytes for i in offloaded_items(items, policy.offload, cfg, lay)) if policy.offload else 0.0
    return sum(i.bytes for i in items) - moved, moved


def _kind_split(cfg: ModelConfig, lay: ActivationLayout, moe_layer: bool,
                policy: RecomputePolicy) -> tuple[float, float]:
    """Layers of one kind (dense or MoE) save the same: computed once per kind (`plan --search` asks often).

    Keyed by the model section's identity (hashing a pydantic model costs more than the formula); the entry
    keeps the section alive so that its id cannot be reused by another."""
    key = (id(cfg), lay, moe_layer, policy)
    hit = _KIND_CACHE.get(key)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    index = cfg.first_k_dense if moe_layer else 0
    items = layer_items(cfg, lay, layer_index=index)
    if policy.granularity == "selective":
        items = apply_selective(items, policy.modules, cfg, lay)
    value = _split(items, cfg, lay, policy)
    if len(_KIND_CACHE) > 8192:
        _KIND_CACHE.clear()
    _KIND_CACHE[key] = (cfg, value)
    return value


def _kind_bytes(cfg: ModelConfig, lay: ActivationLayout, moe_layer: bool, policy: RecomputePolicy) -> float:
    return _kind_split(cfg, lay, moe_layer, policy)[0]


def layer_input_bytes(cfg: ModelConfig, lay: ActivationLayout) -> float:
    """The residual-stream tensor entering a layer: all that full recompute keeps."""
    return lay.act_bytes * lay.seq_tokens * cfg.hidden_size


def full_recompute_bytes(cfg: ModelConfig, lay: ActivationLayout, layers: list[int],
                         policy: RecomputePolicy) -> tuple[dict[int, float], float]:
    """Under full recompute, ({layer: bytes it keeps}, the transient extra of the largest group's recomputed
    forward) for a chunk's `layers`. A checkpointed group (`recompute_groups`) keeps only its input, counted for
    its first layer; layers outside every group (block's after the first num_layers) keep everything."""
    moe = {i: cfg.is_moe_layer(i) for i in layers}
    kinds = {kind: _kind_bytes(cfg, lay, kind, RecomputePolicy()) for kind in set(moe.values())}
    full = {i: kinds[moe[i]] for i in layers}
    kept, transient = dict(full), 0.0
    for group in recompute_groups(layers, policy):
        transient = max(transient, sum(full[i] for i in group))
        kept.update(dict.fromkeys(group, 0.0))
        kept[group[0]] = layer_input_bytes(cfg, lay)
    return kept, transient


def chunk_activation_bytes(cfg: ModelConfig, lay: ActivationLayout, chunk, policy: RecomputePolicy):
    """(bytes kept for backward by one micro-batch's forward of a model chunk (`rank_layout.Chunk`), the transient
    extra while one recomputed group runs its backward)."""
    layers = chunk.layers
    if not layers:
        return 0.0, 0.0
    if policy.granularity != "full":
        counts = {True: chunk.moe_layers, False: len(layers) - chunk.moe_layers}
        return sum(_kind_bytes(cfg, lay, moe, policy) * n for moe, n in counts.items() if n), 0.0
    kept, transient = full_recompute_bytes(cfg, lay, layers, policy)
    return sum(kept.values()), transient


def head_activation_bytes(cfg: ModelConfig, lay: ActivationLayout, *, vocab_parallel: bool,
                          final_norm: bool = True) -> float:
    """Final norm (an MTP module's is its own: `mtp_items`), the head and its loss, as the head declares them
    (models/declarations/embedding.py `head_saved`)."""
    norm = ends.final_norm_saved(cfg, lay) if final_norm else []
    return sum(i.bytes for i in [*norm, *ends.head_saved(cfg, lay, vocab_parallel=vocab_parallel)])


def mtp_items(cfg: ModelConfig, lay: ActivationLayout, policy: RecomputePolicy) -> list[Saved]:
    """One MTP module's saves (its head and loss aside, models/declarations/mtp.py) around one decoder block of
    the last layer's kind (selective recompute applies, full does not: MTP blocks are not part of the stack;
    offloading does, to the block alone)."""
    block = layer_items(cfg, lay, layer_index=cfg.num_layers)
    if policy.granularity == "selective":
        block = apply_selective(block, policy.modules, cfg, lay)
    return mtp.saved(cfg, lay, block=block)


def _mtp_split(cfg: ModelConfig, lay: ActivationLayout, policy: RecomputePolicy) -> tuple[float, float]:
    """(what `mtp_items` keeps on the device, what offloading moves of its block), computed once per model
    section, layout and policy, as `_kind_split`. The offloaded regions are the block's: its items are the only
    ones named as the regions name them."""
    key = (id(cfg), lay, "mtp", policy)
    hit = _KIND_CACHE.get(key)
    if hit is None or hit[0] is not cfg:
        hit = _KIND_CACHE[key] = (cfg, _split(mtp_items(cfg, lay, policy), cfg, lay, policy))
    return hit[1]


def mtp_module_bytes(cfg: ModelConfig, lay: ActivationLayout, policy: RecomputePolicy) -> float:
    """What one MTP module keeps on the device (its head and loss aside)."""
    return _mtp_split(cfg, lay, policy)[0]


def mtp_offloaded_bytes(cfg: ModelConfig, lay: ActivationLayout, policy: RecomputePolicy) -> float:
    """What offloading moves of one MTP module's block to the host pool."""
    return _mtp_split(cfg, lay, policy)[1]


def mtp_activation_bytes(cfg: ModelConfig, lay: ActivationLayout, policy: RecomputePolicy) -> float:
    """One MTP module with its own head loss over the (tp-sharded) vocabulary."""
    return mtp_module_bytes(cfg, lay, policy) + head_activation_bytes(cfg, lay, vocab_parallel=True,
                                                                      final_norm=False)


def other_activation_bytes(cfg: ModelConfig, lay: ActivationLayout) -> float:
    """Storages shared by every layer of one forward: the rotary tables (fp32 cos and sin; in a bf16 run each
    layer keeps its own cast instead: models/declarations/rope.py) and, with packed documents
    (data.reset_at_eod), the attention mask (`document_mask_bytes`)."""
    return sum(i.bytes for i in rope.tables_saved(cfg, lay)) + document_mask_bytes(lay)


# FlexAttention's block size (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE)
FLEX_BLOCK = 128


def document_mask_bytes(lay: ActivationLayout) -> float:
    """The document mask one forward builds and every layer's attention keeps (models/attention.py), in the
    form of the device's kernel (moe_train/kernels.py `documents`): the CPU's additive fp32 mask [b, 1, s, s];
    CUDA's FlexAttention block mask: per row of blocks the counts and per pair of blocks the indices of the
    partial and the full blocks, both ways (int32), and the [b, s] int64 document ids its mask function reads.
    Without packed documents attention is causal and keeps no mask; nor under context parallelism, whose
    attention masks each block from the queries' positions (parallel/ring_attention.py `ShardMask`)."""
    if not lay.documents or lay.cp > 1:
        return 0.0
    seq = lay.seq_length / lay.cp
    if kernels_for(lay.device).documents == "sdpa_additive_mask":
        return FP32 * lay.micro_batch * seq * seq
    blocks = -(-seq // FLEX_BLOCK)
    return lay.micro_batch * (4 * INT32 * (blocks + blocks * blocks) + INT64 * seq)
