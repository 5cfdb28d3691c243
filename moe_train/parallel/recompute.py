"""Activation recomputation (`parallel.recompute`): keep a region's input instead of what it saves for
backward, and run the region again in backward (torch.utils.checkpoint, non-reentrant).

- selective: the named modules of every decoder block (MTP blocks included), Megatron-Core's names:
  core_attn (SDPA), layernorm (the block's two norms), mla_up_proj (MLA's up projections, rotary embeddings and
  attention: q, k and v are never stored), mlp (dense MLPs), moe_act (the routed experts' SwiGLU), moe (the whole
  MoE layer: routing, dispatch, experts, shared experts), shared_experts. A region inside another selected
  one is not wrapped again.
- full: the decoder stack of this model chunk (docs/decisions.md: `num_layers` counts per chunk), `uniform` in groups of
  `num_layers` consecutive layers (each group keeps only its input), `block` the first `num_layers` layers one by
  one and the rest not at all. MTP blocks are not part of the stack.

A recomputed region gives the same numbers as its first run (the same ops on the same inputs; collectives of
tensor parallelism run again on every rank in the same order). Nothing is counted twice: MoE telemetry and
the balancing-loss collectives are skipped while recomputing (`models.autograd_phase.in_recomputation`), and the
gradient attached in the first forward is the one the backward uses. Non-reentrant checkpointing does not
re-run a region's last op (its output is already known): docs/parallel.md counts the recompute FLOPs so.
Checkpoint's recompute context marks the rerun (`models.autograd_phase.recomputation`), so code inside a region
can tell (`in_recomputation`): `moe-train measure` books those FLOPs to `recompute`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from moe_train.models.autograd_phase import recomputation
from moe_train.models.decoder import DecoderBlock
from moe_train.models.mla import MLA
from moe_train.models.model import run_layers
from moe_train.parallel.layout import wrap_region

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.layout_region import LayoutRegion
    from moe_train.models.model import Transformer


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """checkpoint's (forward, recomputation) contexts: only the recomputation is marked."""
    return contextlib.nullcontext(), recomputation()


def recomputed(fn: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    """fn(*args, **kwargs), keeping only its inputs for backward, where it runs again (non-reentrant). Traced
    by torch.compile (train.compile, parallel/compile.py), the region becomes part of the compiled graph and
    its partitioner recomputes it inside the compiled backward, where no Python runs again: nothing to mark
    (and compile takes no context function but selective checkpointing's)."""
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts, **kwargs)


def checkpointed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` whose saved tensors are dropped after forward and recomputed in backward."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return recomputed(fn, *args, **kwargs)

    return run


def _recompute(region: LayoutRegion, name: str) -> None:
    """Checkpoint the module's declared region (models/layout_region.py). Not torch's checkpoint_wrapper: a
    wrapper module would rename every parameter below it (`_checkpoint_wrapped_module.`), and checkpoints keep
    the plain model's names."""
    wrap_region(region, checkpointed, reason=f"recompute {name}")


def _selective(block: DecoderBlock, modules: set[str]) -> None:
    attn = block.self_attn
    if isinstance(attn, MLA) and "mla_up_proj" in modules:
        _recompute(attn.layout_up_attend, "mla_up_proj")
    elif "core_attn" in modules:
        _recompute(attn.core_attention.layout_forward, "core_attn")
    if "layernorm" in modules:
        _recompute(block.input_layernorm.layout_forward, "layernorm")
        _recompute(block.post_attention_layernorm.layout_forward, "layernorm")
    if not block.is_moe:
        if "mlp" in modules:
            _recompute(block.ffn.layout_forward, "mlp")
        return
    if "moe" in modules:
        _recompute(block.ffn.layout_forward, "moe")
        return
    if "moe_act" in modules:
        _recompute(block.ffn.experts.layout_activation, "moe_act")
    if "shared_experts" in modules and block.ffn.shared_experts is not None:
        _recompute(block.ffn.shared_experts.layout_forward, "shared_experts")


def run_layers_recomputed(layers: list[DecoderBlock], hidden: torch.Tensor, *args, method: str,
                          num_layers: int) -> torch.Tensor:
    """The decoder stack under full recomputation (see the module docstring for the two methods)."""
    if method == "uniform":
        for start in range(0, len(layers), num_layers):
            hidden = recomputed(run_layers, layers[start: start + num_layers], hidden, *args)
        return hidden
    for index, layer in enumerate(layers):
        hidden = recomputed(layer, hidden, *args) if index < num_layers else layer(hidden, *args)
    return hidden


def apply_recompute(model: Transformer, recipe: Recipe) -> None:
    policy = recipe.parallel.recompute
    if policy.granularity == "full":
        model.run_layers = functools.partial(run_layers_recomputed, method=policy.method,
                                             num_layers=policy.num_layers)
    elif policy.granularity == "selective":
        for block in model.modules():
            if isinstance(block, DecoderBlock):
                _selective(block, set(policy.modules))
