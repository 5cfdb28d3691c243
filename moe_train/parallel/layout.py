"""The one place parallel/ changes how a model module runs: through the points the module declares.

The model's modules declare where a layout acts, in their own files, with the single-process behaviour as the
default: a `LayoutRegion` of a forward step (models/layout_region.py), which a layout wraps with `wrap_region`,
and plain attributes it reads (`Linear.parallel`, `MoELayer.dispatcher`, `Transformer.stage`, ...: the
"Extension points" of docs/interfaces.md). No class is swapped and no method rebound anywhere else in
moe_train/ (tests/test_structure.py scans for it), so `type(module)` is the model's class under every layout
(FSDP2's `fully_shard` excepted: torch's own `FSDP<class>` subclass, the model's class its base).

What each layout puts in a region, outermost last (the order of `parallelize`):
- tensor parallelism (parallel/tensor.py): Attention's and MLP's `layout_forward` enter the tp region with their
  input (a sequence all-gather under SP, else a copy); a MoE layer's, without SP, routes this rank's slice;
- recomputation (parallel/recompute.py): the selected regions checkpointed (RMSNorm's and CoreAttention's
  `layout_forward` for layernorm and core_attn, MLA's `layout_up_attend`, GroupedExperts' `layout_activation`,
  the dense MLP's, the MoE layer's and the shared experts' `layout_forward`);
- offloading (parallel/offload.py): the same regions inside the pool's saved-tensor hooks, and each decoder
  block's `layout_forward` as one pass of the pool;
- compile (parallel/compile.py): a MoE layer's `layout_forward` eager where a recomputation reruns it.

The rewrite that remains, because the point is FSDP2's and not the model's (`replace_fsdp_post_backward`):
under parallel.split_wgrad the experts unit's post-backward must wait for the delayed weight gradients, and
FSDP2 offers no hook for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.models.layout_region import LayoutRegion, Wrapper


def wrap_region(region: LayoutRegion, wrapper: Wrapper, *, reason: str) -> None:
    """Run `region`'s step through `wrapper` (around what earlier layouts put there); `reason` names the layout
    (kept on the region: `region.wrappers`)."""
    region.wrap(wrapper, reason=reason)


def replace_fsdp_post_backward(group, wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """FSDP2's param group `group` (a private `FSDPParamGroup`) calls `wrap(post_backward)` instead of its own
    post_backward. FSDP2 calls it by attribute from its hook and its end-of-backward callback, which skips a
    group already past it; torch's own pipelining calls it directly for the same reason (weights split from
    inputs). The one rewrite of an object that is not the model's."""
    group.post_backward = wrap(group.post_backward)
