"""Routed experts: E SwiGLU FFNs stored as three stacked weights, run over expert-sorted rows.

gate_proj [E, I, H], up_proj [E, I, H] and down_proj [E, H, I] are separate parameters (not transformers'
fused gate_up_proj [E, 2I, H]): expert tensor parallelism splits I, and a split of a fused [gate; up] tensor
down the middle would hand one rank all the gate rows and the other all the up rows. Expert e of each stack is
`<name>[e]`, so expert parallelism shards dim 0 and the initialisation can draw every expert by its own name.
hf.py converts from and to transformers' per-expert and fused checkpoint layouts.

One grouped GEMM per projection (`models.linear.grouped_mm`) runs all experts at once. Where it cannot run
(`expert_kernel` says why: dtype, device, compute capability, stride alignment) the device's fallback from the
kernel table (moe_train/kernels.py `experts_fallback`) runs: on CUDA below Hopper a padded batched GEMM, each
expert's rows scattered into [E, capacity, H] and one `models.linear.batched_mm` per projection, sized from a
host-known bound on the rows per expert (the capacity) so that nothing is read back; without such a bound
(dropless routing), and on the CPU, a loop of per-expert `models.linear.linear`, which reads the counts once.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_train.config.schema import ClampedSwiGLU
from moe_train.kernels import kernels_for
from moe_train.models.fp8.gemm import Fp8Gemm
from moe_train.models.layout_region import LayoutRegion
from moe_train.models.linear import batched_mm, expert_offsets, grouped_mm, linear
from moe_train.models.moe.deferred_wgrad import DeferredWeightGrads
from moe_train.models.moe.weighted_swiglu import clamped_weighted_swiglu, weighted_swiglu

_GROUPED_MM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ExpertKernel = Literal["grouped_mm", "padded_bmm", "loop"]


def expert_kernel(dtype: torch.dtype, device: torch.device, *, hidden_size: int,
                  ffn_hidden_size: int) -> tuple[ExpertKernel, str]:
    """(the kernel these experts run, why): torch._grouped_mm where it runs, else the device's fallback.

    torch._grouped_mm needs every row stride a multiple of 16 bytes (hidden and the rank's ffn size times the
    dtype's size: 8 bf16 elements); on the CPU f32/bf16/f16; on CUDA bf16 from the table's compute capability
    (9.0: Hopper's grouped GEMM).
    """
    row = kernels_for(device.type)
    fallback: ExpertKernel = row.experts_fallback
    if not hasattr(torch, "_grouped_mm"):
        return fallback, f"torch {torch.__version__} has no _grouped_mm"
    for name, size in (("hidden_size", hidden_size), ("the rank's ffn_hidden_size", ffn_hidden_size)):
        if size * dtype.itemsize % 16:
            return fallback, (f"{name} {size} x {dtype.itemsize} bytes ({dtype}) is not a multiple of 16 bytes "
                              f"(torch._grouped_mm's stride alignment)")
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return fallback, (f"under torch.compile torch._grouped_mm takes bfloat16, not {dtype} (its fake-tensor "
                          f"kernel, which compile traces with, rejects other dtypes)")
    if device.type == "cpu":
        if dtype not in _GROUPED_MM_CPU_DTYPES:
            return fallback, f"torch._grouped_mm on the CPU takes float32, bfloat16 or float16, not {dtype}"
        return "grouped_mm", "torch._grouped_mm (CPU)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if row.grouped_mm_min_major is not None and major < row.grouped_mm_min_major:
            return fallback, (f"compute capability {major}.{minor} is below {row.grouped_mm_min_major}.0, where "
                              f"torch._grouped_mm runs")
        if dtype != torch.bfloat16:
            return fallback, f"torch._grouped_mm on CUDA takes bfloat16, not {dtype}"
        return "grouped_mm", f"torch._grouped_mm (compute capability {major}.{minor})"
    return fallback, f"no grouped GEMM on {device.type}"


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, *, hidden_size: int, ffn_hidden_size: int) -> bool:
    """Whether torch._grouped_mm runs for these experts (`expert_kernel`'s first answer)."""
    kernel, _ = expert_kernel(dtype, device, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
    return kernel == "grouped_mm"


class WeightedBias(torch.autograd.Function):
    """probs * bias[experts] (each row's expert bias, weighted by its routing weight), keeping probs and the
    index only: autograd's product would keep the gathered [rows, width] bias too, which the backward forms
    again from the bias (a parameter). `adds` False (expert tensor parallelism, every etp rank but the first):
    the term is zero, so the reduce over the etp ranks adds the bias once, while the bias, whole on every etp
    rank (Replicate), still gets its whole gradient on each (their rows' output gradients are the same) and the
    routing weight's share through the bias is given by the adding rank only."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, bias: torch.Tensor, experts, adds: bool) -> torch.Tensor:
        indexed = isinstance(experts, torch.Tensor)
        ctx.save_for_backward(probs, bias, *((experts,) if indexed else ()))
        ctx.experts, ctx.adds = None if indexed else experts, adds
        term = probs * bias[experts]
        return term if adds else torch.zeros_like(term)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, bias, *index = ctx.saved_tensors
        experts = index[0] if index else ctx.experts
        rows_bias = bias[experts]
        grad_probs = (grad * rows_bias).sum_to_size(probs.shape) if ctx.adds and ctx.needs_input_grad[0] else None
        grad_bias = torch.zeros_like(bias)
        if index:
            grad_bias.index_add_(0, experts, grad * probs)
        else:
            grad_bias[experts] += (grad * probs).sum_to_size(rows_bias.shape)
        return grad_probs, grad_bias, None, None


class GroupedExperts(nn.Module):
    """E SwiGLU experts over rows already sorted by expert (see dispatcher.py): down(p * silu(gate x) * up x),
    p each row's routing weight (Megatron-Core's weighted SwiGLU): the combine is then a plain sum, and the
    weights' gradient comes from the product the down projection keeps anyway.

    `use_grouped_mm` False forces the loop (benchmarks, and the equivalence test).
    """

    def __init__(self, *, num_experts: int, hidden_size: int, ffn_hidden_size: int, biases: bool = False,
                 clamp: ClampedSwiGLU | None = None):
        """`biases`: gate, up and down biases per expert (gpt-oss); `clamp`: gpt-oss's clamped SwiGLU."""
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.clamp = clamp
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        if biases:  # named `<stack>_bias`: init.py zeroes them, as transformers does
            self.gate_proj_bias = nn.Parameter(torch.empty(num_experts, ffn_hidden_size))
            self.up_proj_bias = nn.Parameter(torch.empty(num_experts, ffn_hidden_size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        else:
            self.gate_proj_bias = self.up_proj_bias = self.down_proj_bias = None
        self.use_grouped_mm = True
        # Expert tensor parallelism (set by parallel/expert.py): whether this rank's partial output carries the
        # down bias, which the reduce over the etp ranks must sum once (True on etp rank 0 only).
        self.adds_down_bias = True
        self.expert_ids: tuple[int, ...] | None = None  # the expert each row (slot) holds; None: row e is expert e
        self.fp8: Fp8Gemm | None = None  # set by models/fp8/select.py when the routed experts run in fp8
        # parallel.split_wgrad (set by parallel/expert.py): the GEMMs' weight gradients (fp8 ones too) wait for
        # the dispatch's backward collective (deferred_wgrad.py)
        self.deferred_wgrad: DeferredWeightGrads | None = None
        # The moe_act region of recomputation and offloading: the SwiGLU, between the GEMMs.
        self.layout_activation = LayoutRegion(GroupedExperts.activation)

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, *, probs: torch.Tensor,
                capacity: int | None = None) -> torch.Tensor:
        """rows [N, H] (expert e's rows contiguous, in expert order), tokens_per_expert [E], probs [N] (each
        row's routing weight) -> [N, H], each row weighted.

        The weights arrive in fp32 (the router's) and are cast once to the rows' dtype, outside the recomputed
        activation: the product is formed in the dtype the down projection reads, and the cast weights are the
        one storage both the plain and the recomputed activation keep (2 bytes a row in bf16).
        `capacity`: a host-known bound on every expert's rows (the layer's expert capacity, where it bounds what
        this rank's experts receive), which lets the padded batched GEMM run without reading the counts.
        N may be 0 (an expert-parallel rank that received no tokens): the loop then gives every weight a zero
        gradient, which _grouped_mm's backward cannot (it rejects the empty strides), so the ranks' gradient
        reductions still line up.
        """
        local_ffn = self.local_weights()[0].shape[1]  # the FFN dimension this rank holds (I / etp)
        kernel, _ = expert_kernel(rows.dtype, rows.device, hidden_size=self.hidden_size, ffn_hidden_size=local_ffn)
        probs = probs.to(rows.dtype).unsqueeze(-1)
        if kernel == "grouped_mm" and self.use_grouped_mm and rows.shape[0] > 0:
            return self._grouped(rows, tokens_per_expert, probs)
        if kernel == "padded_bmm" and self.use_grouped_mm and capacity is not None and self.fp8 is None:
            return self._padded(rows, tokens_per_expert, probs, capacity)
        return self._loop(rows, tokens_per_expert, probs)

    def activation(self, gate: torch.Tensor, up: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up * probs (probs [rows, 1]): the region `parallel.recompute`'s moe_act policy recomputes.
        Kept for backward: gate, up and probs only (weighted_swiglu.py). gpt-oss's clamped form (`clamp`):
        g = min(gate, limit), (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) * probs, transformers'
        GptOssExperts maths, keeping gate, up and probs too (weighted_swiglu.py)."""
        if self.clamp is None:
            return weighted_swiglu(gate, up, probs)
        return clamped_weighted_swiglu(gate, up, probs, limit=self.clamp.limit, alpha=self.clamp.alpha)

    def local_biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(gate, up, down) biases of the experts this rank holds, or None without biases."""
        if self.gate_proj_bias is None:
            return None
        return tuple(b.to_local() if isinstance(b, DTensor) else b for b in (self.gate_proj_bias, self.up_proj_bias,
                                                                              self.down_proj_bias))

    def _biased(self, gate: torch.Tensor, up: torch.Tensor, biases: tuple[torch.Tensor, ...] | None,
                experts: torch.Tensor | slice | int) -> tuple[torch.Tensor, torch.Tensor]:
        """gate and up with their experts' biases (`experts`: each row's expert, or one expert's index)."""
        if biases is None:
            return gate, up
        return gate + biases[0][experts], up + biases[1][experts]

    def _down_bias(self, out: torch.Tensor, biases: tuple[torch.Tensor, ...] | None, experts, probs: torch.Tensor):
        """The down projection's bias, weighted by the row's routing weight as the product is (transformers:
        (act @ down + bias) * p; ours: down(p * act) + p * bias).

        Under expert tensor parallelism each etp rank's output is a partial sum that the dispatcher's reduce adds
        up, so the bias is added on one etp rank (`adds_down_bias`; `WeightedBias`)."""
        if biases is None:
            return out
        return out + WeightedBias.apply(probs, biases[2], experts, self.adds_down_bias)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) of the experts this rank holds: all of them, or its shard under expert parallelism
        (then DTensors sharded on dim 0, whose local tensors are the rank's experts in order)."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_proj, self.up_proj,
                                                                               self.down_proj))

    def _gemm(self, kind: Literal["grouped", "batched", "linear"], x: torch.Tensor, weight: torch.Tensor,
              offsets: torch.Tensor | None = None) -> torch.Tensor:
        """One of the experts' GEMMs, x @ weight^T: `grouped` over `offsets` (models.linear.grouped_mm),
        `batched` (batched_mm, the padded path, which runs without fp8) or one expert's `linear`, in fp8 with
        `fp8`; under parallel.split_wgrad the same product with its weight gradient delayed
        (deferred_wgrad.py)."""
        if self.deferred_wgrad is not None:
            return self.deferred_wgrad.gemm(kind, x, weight, offsets, fp8=self.fp8)
        if kind == "grouped":
            return grouped_mm(x, weight, offsets, fp8=self.fp8)
        if kind == "batched":
            return batched_mm(x, weight)
        return linear(x, weight, fp8=self.fp8)

    def _grouped(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        gate_proj, up_proj, down_proj = self.local_weights()
        biases = self.local_biases()
        offsets = expert_offsets(tokens_per_expert)
        gate, up = self._gemm("grouped", rows, gate_proj, offsets), self._gemm("grouped", rows, up_proj, offsets)
        experts = None if biases is None else torch.repeat_interleave(
            torch.arange(gate_proj.shape[0], device=rows.device), tokens_per_expert, output_size=rows.shape[0])
        gate, up = self._biased(gate, up, biases, experts)
        down = self._gemm("grouped", self.layout_activation(self, gate, up, probs), down_proj, offsets)
        out = self._down_bias(down, biases, experts, probs)
        if out.requires_grad:  # its backward rejects stride-0 gradients, which an out.sum() downstream gives
            out.register_hook(torch.Tensor.contiguous)
        return out

    def _padded(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                capacity: int) -> torch.Tensor:
        """Each expert's rows scattered into its block of [E, capacity, H] (zeros after them), three batched GEMMs,
        and the real rows gathered back. Sized by the host's `capacity`, so nothing is read from the device; the
        zero rows add nothing to any gradient. A row past its expert's capacity is sent out of range, so the
        index_copy raises (a device-side assert on CUDA) rather than overwrite the next expert's block."""
        gate_proj, up_proj, down_proj = self.local_weights()
        experts, total = gate_proj.shape[0], rows.shape[0]
        starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
        expert = torch.repeat_interleave(torch.arange(experts, device=rows.device), tokens_per_expert,
                                         output_size=total)
        rank = torch.arange(total, device=rows.device) - starts[expert]
        slot = torch.where(rank < capacity, expert * capacity + rank, experts * capacity)
        padded = rows.new_zeros(experts * capacity, rows.shape[1]).index_copy(0, slot, rows)
        padded = padded.view(experts, capacity, rows.shape[1])
        padded_probs = probs.new_zeros(experts * capacity, 1).index_copy(0, slot, probs).view(experts, capacity, 1)
        biases = self.local_biases()
        if biases is not None:  # [E, 1, width]: each expert's bias over its block of rows
            biases = tuple(b.unsqueeze(1) for b in biases)
        gate, up = self._biased(self._gemm("batched", padded, gate_proj), self._gemm("batched", padded, up_proj),
                                biases, slice(None))
        down = self._gemm("batched", self.layout_activation(self, gate, up, padded_probs), down_proj)
        out = self._down_bias(down, biases, slice(None), padded_probs)
        return out.reshape(experts * capacity, -1).index_select(0, slot)

    @torch.compiler.disable  # compiled, each expert's data-dependent rows would be a graph break of its own
    def _loop(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        # unbind once: indexing the stacked weight per expert would make each expert's backward allocate (and
        # zero) a gradient the size of all experts.
        outputs = []
        counts = tokens_per_expert.tolist()
        chunks, chunk_probs = torch.split(rows, counts), torch.split(probs, counts)
        weights = zip(*(w.unbind(0) for w in self.local_weights()), strict=True)
        biases = self.local_biases()
        for e, (chunk, p, (gate_proj, up_proj, down_proj)) in enumerate(zip(chunks, chunk_probs, weights,
                                                                            strict=True)):
            gate, up = self._biased(self._gemm("linear", chunk, gate_proj), self._gemm("linear", chunk, up_proj),
                                    biases, e)
            down = self._gemm("linear", self.layout_activation(self, gate, up, p), down_proj)
            outputs.append(self._down_bias(down, biases, e, p))
        return torch.cat(outputs)
