"""Executed FLOPs of one training step, split into forward, backward and recomputation.

torch.utils.flop_counter's formulas (those FlopCounterMode uses) count matrix multiplies (mm, addmm, bmm, SDPA
kernels) at 2 FLOPs per multiply-add. They lack two kernels this engine runs on CPU, registered here:
- `aten._scaled_dot_product_flash_attention_for_cpu` (and its backward): QK^T and PV over the query/key pairs
  the kernel scores: with `is_causal` each query's keys up to its own (s(s+1)/2 pairs, as a causal flash kernel
  skips the masked blocks; torch's own CUDA formulas count all s x s), with a mask every pair (the kernel scores
  them all);
  query heads may outnumber key/value heads (GQA), each query head costs the same. Backward counts 2x the
  forward (dQ, dK, dV, dS GEMMs), as torch's `sdpa_backward_flop_count` does; the flash kernel's recomputed
  scores are not counted, the same convention as torch's.
- `aten._grouped_mm` (routed experts): 2 x rows x in x out over all groups, whatever the split between
  experts. Its backward calls `_grouped_mm` again (data and weight gradients), counted by the same formula.
Elementwise work (norms, activations, softmax, rotary) is not counted, as in the FLOPs formula.

The optimizer's own products (Muon's Newton-Schulz iterations, train/muon.py) are the phase `optimizer`, kept
out of `total`, which stays the model's forward, backward and recomputation (what plan's FLOPs and MFU count):
the driver runs the update inside `optimizer_step()`. AdamW runs no matmul: 0.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from moe_train.measure.dtensor import on_dtensors, sharding_propagation
from moe_train.measure.layers import LayerTracker

PHASES = ("forward", "backward", "recompute")  # the model's: `total` is their sum
OPTIMIZER = "optimizer"


def _attention_flops(query: torch.Size, key: torch.Size, value: torch.Size, causal: bool = False) -> int:
    """QK^T and PV over the pairs the kernel scores: every pair, or with `is_causal` (queries and keys
    aligned at the start) each query's keys up to its own, sum over q of min(q + 1, keys)."""
    batch, heads, queries, qk_dim = query
    keys, v_dim = key[-2], value[-1]
    pairs = queries * keys
    if causal:
        within = min(queries, keys)
        pairs = within * (within + 1) // 2 + (queries - within) * keys
    return 2 * batch * heads * pairs * (qk_dim + v_dim)


def sdpa_cpu_flops(query, key, value, dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs) -> int:
    """Forward of the CPU flash kernel (shapes in, FLOPs out): a causal call skips the masked pairs."""
    return _attention_flops(query, key, value, bool(is_causal))


def sdpa_cpu_backward_flops(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
                            out_val=None, **kwargs) -> int:
    """Backward of the CPU flash kernel: twice the forward."""
    return 2 * _attention_flops(query, key, value, bool(is_causal))


def grouped_mm_flops(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    """torch._grouped_mm in its four layouts; every row (or column) belongs to exactly one group."""
    if len(mat_a) == 2 and len(mat_b) == 3:  # [M, K] x [G, K, N]: rows split by offsets
        return 2 * mat_a[0] * mat_a[1] * mat_b[2]
    if len(mat_a) == 2 and len(mat_b) == 2:  # [M, K] x [K, N]: K split by offsets (weight gradients)
        return 2 * mat_a[0] * mat_a[1] * mat_b[1]
    if len(mat_a) == 3 and len(mat_b) == 2:  # [G, M, K] x [K, N]: N split by offsets
        return 2 * mat_a[1] * mat_a[2] * mat_b[1]
    return 2 * mat_a[0] * mat_a[1] * mat_a[2] * mat_b[2]  # [G, M, K] x [G, K, N]


CPU_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward_flops,
    torch.ops.aten._grouped_mm: grouped_mm_flops,
}


class PhaseFlopCounter(TorchDispatchMode):
    """FlopCounterMode's formulas plus the ones above, each op's FLOPs added to the phase the layer tracker
    reports. DTensor ops are counted as the local ops they run on this rank's shards (dtensor.py): a
    global-shape count would credit every rank with the whole matmul."""

    def __init__(self, layers: LayerTracker) -> None:
        super().__init__()
        self.layers = layers
        self.formulas = {**flop_registry, **{op: shape_wrapper(fn) for op, fn in CPU_FORMULAS.items()}}
        self.by_phase: dict[str, int] = defaultdict(int)
        self.in_optimizer = False

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Count what runs inside as the optimizer's FLOPs (outside every layer's phase)."""
        self.in_optimizer = True
        try:
            yield
        finally:
            self.in_optimizer = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if on_dtensors(types):
            return NotImplemented
        out = func(*args, **kwargs)
        formula = self.formulas.get(getattr(func, "_overloadpacket", None))
        if formula is not None and not sharding_propagation():
            phase = OPTIMIZER if self.in_optimizer else self.layers.phase()
            self.by_phase[phase] += int(formula(*args, **kwargs, out_val=out))
        return out

    def totals(self) -> dict[str, int]:
        """{"forward", "backward", "recompute", "total", "optimizer"}: total the model's three phases."""
        counts = {phase: self.by_phase.get(phase, 0) for phase in PHASES}
        return {**counts, "total": sum(counts.values()), OPTIMIZER: self.by_phase.get(OPTIMIZER, 0)}
