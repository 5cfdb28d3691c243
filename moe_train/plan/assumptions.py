"""Every assumption of the planner, named, with its default and why (docs/plan.md discusses each).

`moe-train plan --assume NAME=VALUE` changes one; the Python API takes `estimate(recipe, hardware,
Assumptions(...))`. The defaults are what docs/plan.md compares with published throughput.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Assumptions:
    # ---- compute: achieved fraction of the data-sheet dense peak
    gemm_efficiency: float = 0.70
    """Large dense GEMMs (projections, dense MLPs, the head) in bf16 reach ~70% of peak on H100/B200."""
    grouped_gemm_efficiency: float = 0.45
    """Grouped expert GEMMs: ragged, skinny (ffn 768-2048) matrices run well below dense GEMMs. Calibrated
    (docs/plan.md) on the published Qwen3-30B-A3B runs."""
    attention_efficiency: float = 0.40
    """Flash attention forward+backward at head dims 128-192; backward is the slower half."""
    fp8_gemm_speedup: float = 1.5
    """train.precision fp8: GEMMs run this much faster than bf16 (not the data-sheet 2x: quantisation, scaling
    and bf16 attention/elementwise remain). Against published end-to-end figures (torchao's float8 README,
    torchtitan, torch.compile on): Llama3-8B on 8 H100s +25% tokens/s tensorwise with fp8 all-gather, +10%
    rowwise; up to 1.5x at 405B on 512 GPUs; torchao's docs: 1.34-1.43x rowwise on 2K H200s. A step whose GEMMs
    are ~60% of its time gets ~1.25x from a 1.5x GEMM speed-up. Not measured here (docs/fp8.md)."""
    # ---- memory-bound work
    elementwise_traffic_per_saved_byte: float = 14.0
    """Norms, SwiGLU, rotary, softmax, permutation and residual adds are memory-bound: each byte a layer saves
    for backward stands for about this many bytes of HBM traffic over its forward and backward (written and
    read once, its gradient written and read, the fp32 copies and permutations around it). Calibrated
    (docs/plan.md) on the published Qwen3-30B-A3B runs."""
    optimizer_bytes_per_param: float = 32.0
    """AdamW step per local (sharded) parameter: read/write fp32 master, m and v, read the fp32 gradient."""
    # ---- communication
    nvlink_efficiency: float = 0.75
    """Achieved fraction of the NVLink per-GPU bandwidth for collectives (NCCL bus bandwidth)."""
    network_efficiency: float = 0.75
    """Achieved fraction of the per-GPU network bandwidth (InfiniBand/RoCE) across nodes."""
    tp_overlap: float = 0.0
    """TP/SP collectives sit on the critical path (no comm-GEMM overlap assumed)."""
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
    fsdp_reshard_after_forward: bool = True
    """Without pipelining, FSDP2 frees unsharded parameters after forward and all-gathers them again in
    backward."""
    moe_sync_s: float = 0.5e-3
    """Each MoE layer forward (and its recompute) waits for the token counts on the host (the all-to-all
    split sizes, the grouped GEMM offsets): the GPU queue drains and refills. Seconds per layer forward."""

    def to_dict(self) -> dict:
        return asdict(self)
