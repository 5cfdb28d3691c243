"""Every assumption of the planner, named, with its default and why (docs/plan.md discusses each).

`plan --set-assumption NAME=VALUE` is not offered on purpose: the defaults are what docs/plan.md calibrates
against published throughput; the Python API (`estimate(recipe, assumptions=Assumptions(...))`) takes others.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Assumptions:
    # ---- compute: achieved fraction of the data-sheet dense peak
    gemm_efficiency: float = 0.70
    """Large dense GEMMs (projections, dense MLPs, the head) in bf16 reach ~70% of peak on H100/B200."""
    grouped_gemm_efficiency: float = 0.55
    """Grouped expert GEMMs: ragged, often skinny (ffn 768-2048) matrices run well below dense GEMMs."""
    attention_efficiency: float = 0.50
    """Flash attention forward+backward; backward is the slower half (~50% of peak)."""
    fp8_gemm_speedup: float = 1.5
    """train.precision fp8: GEMMs run this much faster than bf16 (not the data-sheet 2x: quantisation, scaling
    and bf16 attention/elementwise remain)."""
    # ---- memory-bound work
    elementwise_traffic_per_saved_byte: float = 6.0
    """Norms, SwiGLU, rotary, softmax, permutation and residual adds are memory-bound: each byte a layer saves
    for backward stands for about this many bytes of HBM traffic over its forward and backward."""
    optimizer_bytes_per_param: float = 32.0
    """AdamW step per local (sharded) parameter: read/write fp32 master, m and v, read the fp32 gradient."""
    # ---- communication
    nvlink_efficiency: float = 0.75
    """Achieved fraction of the NVLink per-GPU bandwidth for collectives (NCCL bus bandwidth)."""
    network_efficiency: float = 0.75
    """Achieved fraction of the per-GPU network bandwidth (InfiniBand/RoCE) across nodes."""
    tp_overlap: float = 0.0
    """TP/SP collectives sit on the critical path (no comm-GEMM overlap assumed)."""
    ep_overlap: float = 0.3
    """Part of the MoE all-to-all hidden behind other micro-batches' compute or the shared expert."""
    dp_overlap: float = 0.9
    """FSDP all-gathers and reduce-scatters are prefetched and overlap compute except at the step's edges."""
    pp_overlap: float = 1.0
    """Pipeline sends overlap compute; the schedule's bubble is counted separately."""
    # ---- memory
    moe_imbalance: float = 1.0
    """Rows on the most loaded expert rank over the even share (1.0: forced even routing, as published runs)."""
    memory_margin: float = 0.10
    """A plan within this fraction of device memory fits but is flagged: fragmentation and transient spikes."""
    runtime_reserve_bytes: float = 3.0e9
    """CUDA context, NCCL buffers and the allocator's own slack, per GPU."""
    fsdp_prefetch_units: int = 2
    """Unsharded layers' parameters live at once under FSDP2 (the current one and the prefetched next)."""
    fsdp_reduce_every_micro_batch: bool = True
    """FSDP2 reduce-scatters gradients after each micro-batch's backward (torchtitan's default), so gradients
    stay sharded; False: once per step, holding unsharded fp32 gradients between micro-batches."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2 frees unsharded parameters after forward and all-gathers them again in backward."""

    def to_dict(self) -> dict:
        return asdict(self)
