"""Routed experts: E SwiGLU FFNs stored as two stacked weights, run over expert-sorted rows.

The stacked layout is transformers' fused one (gate_up_proj [E, 2I, H] with the gate rows first, down_proj
[E, H, I]), so checkpoints map 1:1. One `torch._grouped_mm` per projection runs all experts at once; where it
cannot run (dtype, device, strides) a loop of per-expert matmuls gives the same result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_GROUPED_MM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, *, hidden_size: int, ffn_hidden_size: int) -> bool:
    """Whether torch._grouped_mm runs for these experts.

    CPU: f32/bf16/f16 with every row stride a multiple of 16 bytes. CUDA: bf16 on compute capability >= 9.0
    (Hopper's grouped GEMM), with the same alignment.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    itemsize = dtype.itemsize
    if (hidden_size * itemsize) % 16 or (ffn_hidden_size * itemsize) % 16:
        return False
    if device.type == "cpu":
        return dtype in _GROUPED_MM_CPU_DTYPES
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward materialises the incoming gradient.

    _grouped_mm's backward rejects stride-0 gradients, which an `out.sum()` (or an expand) downstream produces.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """E SwiGLU experts over rows already sorted by expert (see dispatcher.py).

    `use_grouped_mm` False forces the loop (benchmarks, and the equivalence test).
    """

    def __init__(self, *, num_experts: int, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.use_grouped_mm = True

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """rows [N, H] (expert e's rows contiguous, in expert order), tokens_per_expert [E] -> [N, H]."""
        if self.use_grouped_mm and grouped_mm_supported(
            rows.dtype, rows.device, hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size
        ):
            return self._grouped(rows, tokens_per_expert)
        return self._loop(rows, tokens_per_expert)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: the region `parallel.recompute`'s moe_act policy recomputes."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _grouped(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offsets)
        out = torch._grouped_mm(self.activation(gate_up), self.down_proj.transpose(-2, -1), offs=offsets)
        return _ContiguousGrad.apply(out)

    def _loop(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # unbind once: indexing the stacked weight per expert would make each expert's backward allocate (and
        # zero) a gradient the size of all experts.
        outputs = []
        chunks = torch.split(rows, tokens_per_expert.tolist())
        for chunk, gate_up_proj, down_proj in zip(
            chunks, self.gate_up_proj.unbind(0), self.down_proj.unbind(0), strict=True
        ):
            outputs.append(F.linear(self.activation(F.linear(chunk, gate_up_proj)), down_proj))
        return torch.cat(outputs)
