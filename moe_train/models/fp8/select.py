"""Which GEMMs run in fp8: `train.fp8.modules` names kinds of GEMM, and this marks the modules of each kind.

The kinds: `attention` (every projection of attention or MLA, its low-rank down projections included),
`mlp` (dense MLPs), `shared_experts`, `experts` (the routed experts' grouped GEMMs), `head` (the output head;
never by default: its logits feed the loss, and DeepSeek-V3 keeps it in bf16 too). MTP's blocks are decoder
blocks and follow the same kinds; MTP's eh_proj, the router (fp32) and the embedding never run in fp8.

With `train.fp8.saved_inputs: fp8` the GEMMs keep their inputs in fp8 for backward (gemm.py), but for the shared
experts' gate and up: they read the post-attention norm's output, which the router keeps in bf16 anyway (it
is no fp8 GEMM), so an fp8 copy would add to it; they keep that storage instead, as a bf16-saving GEMM does.

Marks are attributes (`Linear.fp8`, `GroupedExperts.fp8`), not module swaps: tensor parallelism swaps the
Linear classes for its column/row styles and FSDP2 wraps the blocks, and both keep an instance attribute, so
the GEMMs inside every layout see the same marks (a torchao Float8Linear swap would be bypassed by the
tensor-parallel styles, which call the GEMM site on their local shards). Backend te marks them with a `TeGemm`
(models/fp8/te.py), which has the same calls.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from moe_train.models.fp8.gemm import Fp8Gemm
from moe_train.models.fp8.te import TeGemm
from moe_train.models.linear import Linear
from moe_train.models.mlp import MLP
from moe_train.models.moe import MoELayer

if TYPE_CHECKING:
    from torch import nn

    from moe_train.config.schema import Fp8Config
    from moe_train.models.model import Transformer


def _mark_linears(module: nn.Module, gemm: Fp8Gemm | TeGemm) -> int:
    count = 0
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.fp8 = gemm
            count += 1
    return count


def apply_fp8(model: Transformer, fp8: Fp8Config) -> dict[str, int]:
    """Mark the GEMMs of the kinds `fp8.modules` names; returns how many modules of each kind were marked."""
    gemm = (TeGemm(recipe=fp8.recipe) if fp8.backend == "te"
            else Fp8Gemm(recipe=fp8.recipe, saved_inputs=fp8.saved_inputs))
    kinds = set(fp8.modules)
    marked = dict.fromkeys(sorted(kinds), 0)
    blocks = [*model.layers.values(), *(module.block for module in model.mtp.values())]
    for block in blocks:
        if "attention" in kinds:
            marked["attention"] += _mark_linears(block.self_attn, gemm)
        if isinstance(block.ffn, MLP) and "mlp" in kinds:
            marked["mlp"] += _mark_linears(block.ffn, gemm)
        if isinstance(block.ffn, MoELayer):
            if "shared_experts" in kinds and block.ffn.shared_experts is not None:
                shared = block.ffn.shared_experts
                marked["shared_experts"] += _mark_linears(shared, gemm)
                if isinstance(gemm, Fp8Gemm):
                    shared.gate_proj.fp8 = shared.up_proj.fp8 = replace(gemm, saved_inputs="bf16")
            if "experts" in kinds:
                block.ffn.experts.fp8 = gemm
                marked["experts"] += 1
    if "head" in kinds and model.lm_head is not None:
        model.lm_head.fp8 = gemm
        marked["head"] += 1
    return marked
