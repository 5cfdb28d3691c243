"""Routed experts: E SwiGLU FFNs stored as three stacked weights, run over expert-sorted rows.

gate_proj [E, I, H], up_proj [E, I, H] and down_proj [E, H, I] are separate parameters (not transformers'
fused gate_up_proj [E, 2I, H]): expert tensor parallelism splits I, and a split of a fused [gate; up] tensor
down the middle would hand one rank all the gate rows and the other all the up rows. Expert e of each stack is
`<name>[e]`, so expert parallelism shards dim 0 and the initialisation can draw every expert by its own name.
hf.py converts from and to transformers' per-expert and fused checkpoint layouts.

One grouped GEMM per projection (`models.linear.grouped_mm`) runs all experts at once; where it cannot run
(dtype, device, strides) a loop of per-expert `models.linear.linear` gives the same result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moe_train.models.linear import expert_offsets, grouped_mm, linear

_GROUPED_MM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, *, hidden_size: int, ffn_hidden_size: int) -> bool:
    """Whether torch._grouped_mm runs for these experts.

    CPU: f32/bf16/f16 with every row stride a multiple of 16 bytes. CUDA: bf16 on compute capability >= 9.0
    (Hopper's grouped GEMM), with the same alignment. Under torch.compile (train.compile) bf16 only: the
    fake-tensor kernel compile traces it with rejects other dtypes, whatever the device's kernel takes.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False
    itemsize = dtype.itemsize
    if (hidden_size * itemsize) % 16 or (ffn_hidden_size * itemsize) % 16:
        return False
    if device.type == "cpu":
        return dtype in _GROUPED_MM_CPU_DTYPES
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return False


class GroupedExperts(nn.Module):
    """E SwiGLU experts over rows already sorted by expert (see dispatcher.py): down(silu(gate x) * up x).

    `use_grouped_mm` False forces the loop (benchmarks, and the equivalence test).
    """

    def __init__(self, *, num_experts: int, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.use_grouped_mm = True

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """rows [N, H] (expert e's rows contiguous, in expert order), tokens_per_expert [E] -> [N, H].

        N may be 0 (an expert-parallel rank that received no tokens): the loop then gives every weight a zero
        gradient, which _grouped_mm's backward cannot (it rejects the empty strides), so the ranks' gradient
        reductions still line up.
        """
        local_ffn = self.local_weights()[0].shape[1]  # the FFN dimension this rank holds (I / etp)
        if (
            self.use_grouped_mm
            and rows.shape[0] > 0
            and grouped_mm_supported(rows.dtype, rows.device, hidden_size=self.hidden_size, ffn_hidden_size=local_ffn)
        ):
            return self._grouped(rows, tokens_per_expert)
        return self._loop(rows, tokens_per_expert)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: the region `parallel.recompute`'s moe_act policy recomputes."""
        return F.silu(gate) * up

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) of the experts this rank holds: all of them, or its shard under expert parallelism
        (then DTensors sharded on dim 0, whose local tensors are the rank's experts in order)."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_proj, self.up_proj,
                                                                               self.down_proj))

    def _grouped(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate_proj, up_proj, down_proj = self.local_weights()
        offsets = expert_offsets(tokens_per_expert)
        gate = grouped_mm(rows, gate_proj, offsets)
        up = grouped_mm(rows, up_proj, offsets)
        out = grouped_mm(self.activation(gate, up), down_proj, offsets)
        if out.requires_grad:  # its backward rejects stride-0 gradients, which an out.sum() downstream gives
            out.register_hook(torch.Tensor.contiguous)
        return out

    @torch.compiler.disable  # compiled, each expert's data-dependent rows would be a graph break of its own
    def _loop(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # unbind once: indexing the stacked weight per expert would make each expert's backward allocate (and
        # zero) a gradient the size of all experts.
        outputs = []
        chunks = torch.split(rows, tokens_per_expert.tolist())
        weights = zip(*(w.unbind(0) for w in self.local_weights()), strict=True)
        for chunk, (gate_proj, up_proj, down_proj) in zip(chunks, weights, strict=True):
            outputs.append(linear(self.activation(linear(chunk, gate_proj), linear(chunk, up_proj)), down_proj))
        return torch.cat(outputs)
