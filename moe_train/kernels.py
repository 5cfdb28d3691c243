"""The per-device kernel table: which kernel runs each hot op, by device kind, in one place.

The choices differ because the kernels differ: on the CPU, SDPA's flash kernel takes an additive mask (and keeps
only its output and log-sum-exp for backward), and FlexAttention has no backward; on CUDA, SDPA's flash and cuDNN
kernels take no mask at all, so a document mask would send packed sequences to the math kernel, which saves the
[b, h, s, s] scores: FlexAttention's block mask skips the masked blocks instead. Grouped GEMM
(`torch._grouped_mm`) runs on the CPU and on CUDA from compute capability 9.0 (Hopper) in bf16. FP8 GEMMs
(models/fp8/gemm.py) run real where torch has a kernel for the recipe's scales on that device and capability, and
are emulated (quantise, dequantise, bf16 GEMM) elsewhere, by device kind AND compute capability (`fp8_kernel`):
`torch._scaled_mm` takes tensorwise and rowwise scales on the CPU (checked with torch 2.13) and on CUDA from sm89;
DeepSeek-V3's blockwise scales (1 x 128 activations, 128 x 128 weights) on sm90 only (torch's cuBLAS path refuses
them on any other major: "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90"); MX 1 x 32
blocks with E8M0 scales on sm100 (major 10). `torch._scaled_grouped_mm` (the routed experts' forward and input
gradient) takes per-row fp32 scales on sm90 and sm100, so tensorwise (a scale repeated per row) and rowwise run
there; no CPU kernel. It takes e4m3 operands only (`fp8_grouped_formats`), so tensorwise's e5m2 output gradient
is quantised in e4m3 for the experts' input gradient where that kernel runs (`fp8_operand_format`), and stays e5m2
where the product is emulated. The experts' weight gradient stays emulated everywhere: the kernel's 2-D x 2-D form needs
every expert's tokens aligned to 16, which the dispatchers do not pad. The start-up probe
(models/fp8/runtime.py) runs the chosen kernel once and falls back to emulated, with the reason, if it raises.

SDPA's backends, in the order tried (`torch.nn.attention.sdpa_kernel(..., set_priority=True)`): on CUDA cuDNN
first (on Hopper with cuDNN >= 9.10 it takes head dims up to 256, and a value head dim other than q/k's), then
flash (one head dim for q, k and v, at most 256), then the memory-efficient kernel (q/k's dim and v's may
differ), the math kernel last (it saves the scores: only for what no fused kernel takes, fp32 on old parts).
The CPU has its flash kernel and math. The value dim decides MLA's padding (`mla_value`): the CPU's flash
kernel refuses a v head dim other than q/k's (torch 2.13: "Flash attention requires q,k,v to have the same last
dimension"), so MLA zero-pads v to it there; on CUDA cuDNN, the memory-efficient kernel and FlexAttention take
v as it is (torch's sdp_utils and flex_attention's checks), so the padding's extra bytes and FLOPs are not spent.

Readers: moe_train/models/attention.py (`documents`, `sdpa_backends`, `sinks_and_windows`), moe_train/models/fp8/gemm.py
(`fp8_linear`, `fp8_grouped`, through `fp8_kernel`), moe_train/models/mla.py and plan/saved_tensors.py
(`mla_value`), moe_train/models/moe/experts.py (`grouped_mm_min_major`, `experts_fallback`, through
`expert_kernel`), `train.compile`'s default (`compile`: moe_train/parallel/compile.py).
Torch-free: plan and the login half may read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

SdpaBackend = Literal["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
Capability = tuple[int, int]  # CUDA compute capability (major, minor)
Capabilities = tuple[Capability, Capability]  # [low, high)
ANY: Capabilities = ((0, 0), (99, 0))  # every device of the kind (the CPU has no capability)
_SM89_ON, _SM90, _SM100, _SM90_SM100 = ((8, 9), (99, 0)), ((9, 0), (10, 0)), ((10, 0), (11, 0)), ((9, 0), (11, 0))


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """One device kind's choices."""

    documents: Literal["sdpa_additive_mask", "flex_block_mask"]  # attention over packed documents
    causal: Literal["sdpa"]  # attention without restarts: SDPA with is_causal (flash / cuDNN / the CPU's flash)
    # gpt-oss's attention sinks and sliding windows: attention written out through its log-sum-exp, a block of
    # query rows at a time (models/blockwise_attention.py `sink_window_attention`), the sink joined once to each
    # query's normaliser; it keeps q, k, v, the output and the fp32 log-sum-exp, as a fused kernel does, and
    # backward recomputes the scores (2.5x the forward's products). SDPA would take the sink only as a mask
    # column with a gradient, which the CPU's flash kernel refuses (torch 2.13: "No available kernel"), so it
    # ran MATH, which kept the [b, h, s, s + 1] scores and probabilities (1.6x on gpt-oss-tiny at 2 x 64 tokens).
    # The same path on CUDA, not run on a GPU here; FlexAttention (a window mask_mod, the sink through its
    # log-sum-exp) is the fused kernel to build there, and until then packed documents (a block mask) are
    # refused by validate for gpt-oss on CUDA.
    sinks_and_windows: Literal["blockwise_lse"] = "blockwise_lse"
    sdpa_backends: tuple[SdpaBackend, ...]  # SDPA's backends in the order tried (torch's SDPBackend names)
    mla_value: Literal["padded", "own"]  # MLA's v: zero-padded to q/k's head dim, or its own (v_head_dim)
    grouped_mm_min_major: int | None  # compute capability major from which torch._grouped_mm runs; None: always
    experts_fallback: Literal["loop", "padded_bmm"]  # experts where torch._grouped_mm cannot run (dtype, strides)
    compile: bool  # train.compile's default (null)
    # train.fp8.recipe -> the compute capabilities [low, high) whose kernel takes its scales; a recipe not named:
    # emulated. Linear GEMMs: torch._scaled_mm; the routed experts' grouped GEMMs: torch._scaled_grouped_mm.
    fp8_linear: Mapping[str, Capabilities]
    fp8_grouped: Mapping[str, Capabilities]
    # the fp8 formats torch._scaled_grouped_mm takes for either operand (its check: "Expected inputs of E4M3 FP8
    # type"): a recipe operand of another format (tensorwise's e5m2 gradients) is quantised in e4m3 for it
    fp8_grouped_formats: tuple[Literal["e4m3", "e5m2"], ...] = ("e4m3",)


KERNELS: dict[str, Kernels] = {
    "cpu": Kernels(documents="sdpa_additive_mask", causal="sdpa", sdpa_backends=("FLASH_ATTENTION", "MATH"),
                   mla_value="padded", grouped_mm_min_major=None, experts_fallback="loop", compile=False,
                   fp8_linear={"tensorwise": ANY, "rowwise": ANY}, fp8_grouped={}),
    "cuda": Kernels(documents="flex_block_mask", causal="sdpa",
                    sdpa_backends=("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
                    mla_value="own", grouped_mm_min_major=9, experts_fallback="padded_bmm", compile=True,
                    fp8_linear={"tensorwise": _SM89_ON, "rowwise": _SM89_ON, "blockwise": _SM90, "mxfp8": _SM100},
                    fp8_grouped={"tensorwise": _SM90_SM100, "rowwise": _SM90_SM100}),
}


def kernels_for(device_type: str) -> Kernels:
    """The table row of a device kind; a kind without a row (meta, fake tensors' cpu semantics) is the CPU's."""
    return KERNELS.get(device_type, KERNELS["cpu"])


def fp8_operand_format(recipe_format: Literal["e4m3", "e5m2"], device_type: str, *, grouped: bool,
                       real: bool) -> Literal["e4m3", "e5m2"]:
    """The fp8 format an operand is quantised in for its GEMM: the recipe's (`recipe_format`), unless the real
    grouped kernel does not take it (`fp8_grouped_formats`), which then gets e4m3: the format every fp8 kernel
    takes, whose 3 mantissa bits keep more of a gradient than e5m2's 2 (its range, 448, is the scale's to fill)."""
    formats = kernels_for(device_type).fp8_grouped_formats
    return recipe_format if not (grouped and real) or recipe_format in formats else "e4m3"


def fp8_kernel(recipe: str, device_type: str, capability: Capability | None = None, *,
               grouped: bool = False) -> tuple[bool, str]:
    """(real, why): whether `recipe`'s fp8 GEMMs (linear, or the routed experts' `grouped` ones) run torch's
    scaled kernel on this device kind and CUDA compute capability (None: the CPU, or not known), and the reason
    in words for the start-up log. Pure, so each row can be tested without the device."""
    row = kernels_for(device_type)
    table, kernel = (row.fp8_grouped, "torch._scaled_grouped_mm") if grouped else (row.fp8_linear, "torch._scaled_mm")
    where = device_type if capability is None else f"{device_type} sm{capability[0]}{capability[1]}"
    span = table.get(recipe)
    if span is None:
        return False, f"{kernel} has no {recipe} kernel on {device_type}"
    low, high = span
    if span != ANY and (capability is None or not low <= capability < high):
        words = f"from sm{low[0]}{low[1]}" + ("" if high == ANY[1] else f" to below sm{high[0]}{high[1]}")
        return False, f"{kernel} takes {recipe} scales {words}, not on {where}"
    return True, f"{kernel} on {where}"
