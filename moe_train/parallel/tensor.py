"""Tensor and sequence parallelism (Megatron-LM; Korthikanti et al. 2022): the TP/SP step of `parallelize`.

Over the tp group, each decoder block is split as in Megatron-LM: attention by heads (q/k/v, or MLA's q_b_proj
and kv_b_proj, column-parallel; o_proj row-parallel), dense MLPs and shared experts by ffn features (gate/up
column-parallel, down row-parallel), the embedding and the output head by vocabulary (with a vocabulary-
parallel cross-entropy, so no rank ever holds full-vocabulary logits). Everything else is replicated: norms,
MLA's low-rank down projections and their norms, QK-norm (shared by heads, so it is correct on a head shard),
the router, and the routed experts (sharded only by FSDP/EP, never by tp: that is etp).

Without sequence parallelism the residual stream is replicated: each region starts with a copy whose gradient
is all-reduced and ends with an all-reduce. With it (`parallel.sequence_parallel`) the residual stream, norms,
MLA's down projections and the router hold this rank's slice of the sequence; each region starts with an
all-gather and ends with a reduce-scatter, and a column-parallel GEMM after the all-gather keeps only the
slice for backward (parallel/collectives.py). MoE layers always route this rank's slice of the micro-batch
(without SP the slice is cut from the replicated input and the output gathered again), so no token is routed
twice; their `token_group` is the tp group, over which balancing losses and counts are summed.

Parameters: sharded ones become DTensors on the tp mesh (Shard(0) column-wise and for the vocabulary, Shard(1)
row-wise), which FSDP2 then shards over dp on the 2-D (dp, tp) mesh; replicated ones stay plain tensors. Where
a replicated parameter sees only part of the data on each rank (a sequence slice, or a head shard for
QK-norm), its module is marked and `reduce_replicated_gradients` sums its gradient over tp once per step, so
it stays bit-equal on every tp rank.

DTensor's own styles fit the embedding (RowwiseParallel: a masked lookup and a reduction); the GEMMs use the
small autograd functions of parallel/collectives.py instead, because DTensor's ColwiseParallel keeps the
gathered input for backward (sbh per GEMM whatever t is) and replicated parameters computed on a sequence
slice would need DTensor activations through the whole residual stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from moe_train.models.attention import Attention
from moe_train.models.decoder import DecoderBlock
from moe_train.models.mla import MLA
from moe_train.models.mlp import MLP
from moe_train.models.moe import MoELayer
from moe_train.parallel.collectives import (
    column_linear_saving_shard,
    copy_to_region,
    gather_replicated,
    gather_sequence,
    reduce_from_region,
    reduce_scatter_sequence,
    scatter_sequence,
)
from moe_train.parallel.vocab_parallel import VocabParallelLoss

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from moe_train.config import Recipe
    from moe_train.models.model import Transformer
    from moe_train.parallel.context import ParallelContext

# Modules whose replicated parameters get a partial gradient on each tp rank carry this attribute (True).
PARTIAL_GRADIENT = "tp_partial_gradient"
SEQUENCE_DIM = -2  # of [b, s, h] activations, and of the [tokens, h] rows inside MoE layers


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class Region:
    """Where activations enter a tensor-parallel region, for the column-parallel GEMMs that read them.

    `enter` runs once per forward of the region's module: under sequence parallelism it all-gathers the
    sequence (its gradient is reduce-scattered once, however many GEMMs read the input) and remembers the
    slice, so that each GEMM reading the gathered input keeps only the slice; otherwise a copy whose gradient
    is all-reduced. Not a module: it holds no parameters and is shared by the GEMMs of one region.
    """

    def __init__(self, *, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        self.group = group
        self.sequence_parallel = sequence_parallel
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # (full, slice) during a forward

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return copy_to_region(x, self.group)
        full = gather_sequence(x, SEQUENCE_DIM, self.group)
        self._gathered = (full, x)
        return full

    def leave(self) -> None:
        self._gathered = None

    def column(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._gathered is not None and x is self._gathered[0]:
            return column_linear_saving_shard(x, weight, self._gathered[1], dim=SEQUENCE_DIM, group=self.group)
        return F.linear(x, weight)

    def leave_region(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel GEMM's partial sums to the replicated value or this rank's sequence slice of it."""
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, SEQUENCE_DIM, self.group)
        return reduce_from_region(partial, self.group)


class ColumnParallelLinear(nn.Linear):
    """nn.Linear whose weight rows (output features) are sharded over tp; reads its input from `tp_region`,
    entering the region itself when `enters_region` (a GEMM alone in its region)."""

    tp_region: Region
    enters_region: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _local(self.weight)
        if not self.enters_region:
            return self.tp_region.column(x, weight)
        full = self.tp_region.enter(x)
        try:
            return self.tp_region.column(full, weight)
        finally:
            self.tp_region.leave()


class RowParallelLinear(nn.Linear):
    """nn.Linear whose weight columns (input features) are sharded over tp; ends its region."""

    tp_region: Region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_region.leave_region(F.linear(x, _local(self.weight)))


class _EntersRegion:
    """Mixin for a module whose forward starts a region (attention, MLP): its first argument enters once."""

    tp_region: Region

    def forward(self, x: torch.Tensor, *args, **kwargs):
        full = self.tp_region.enter(x)
        try:
            return super().forward(full, *args, **kwargs)
        finally:
            self.tp_region.leave()


class _RoutesSlice:
    """Mixin for a MoE layer without sequence parallelism: it routes this rank's slice of the replicated
    micro-batch and gathers the outputs again, so each token is routed (and counted) once."""

    tp_group: dist.ProcessGroup

    def forward(self, hidden: torch.Tensor, *args, **kwargs):
        mine = scatter_sequence(hidden, SEQUENCE_DIM, self.tp_group)
        return gather_replicated(super().forward(mine, *args, **kwargs), SEQUENCE_DIM, self.tp_group)


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Give `module` the behaviour of `mixin` in place (parameter names and state stay as they are)."""
    key = (mixin, type(module))
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"TensorParallel{type(module).__name__}", (mixin, type(module)), {})
    module.__class__ = _SUBCLASSES[key]


def _shard_weight(linear: nn.Linear, mesh: DeviceMesh, dim: int) -> None:
    if linear.bias is not None:
        raise ValueError("tensor parallelism of a linear layer with a bias is not built")
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, mesh, [Shard(dim)]))


class _Planner:
    """Applies the plan to one model; every name it is given must exist in the module it is resolved in."""

    def __init__(self, *, mesh: DeviceMesh, sequence_parallel: bool) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.sequence_parallel = sequence_parallel

    def region(self) -> Region:
        return Region(group=self.group, sequence_parallel=self.sequence_parallel)

    def column(self, parent: nn.Module, name: str, region: Region, *, enters: bool) -> None:
        linear = _submodule(parent, name, nn.Linear)
        _shard_weight(linear, self.mesh, 0)
        linear.__class__ = ColumnParallelLinear
        linear.tp_region, linear.enters_region = region, enters

    def row(self, parent: nn.Module, name: str, region: Region) -> None:
        linear = _submodule(parent, name, nn.Linear)
        _shard_weight(linear, self.mesh, 1)
        linear.__class__ = RowParallelLinear
        linear.tp_region = region

    def mlp(self, mlp: MLP, region: Region) -> None:
        """gate/up column-wise, down row-wise, the input entering once."""
        self.column(mlp, "gate_proj", region, enters=False)
        self.column(mlp, "up_proj", region, enters=False)
        self.row(mlp, "down_proj", region)
        mlp.tp_region = region
        _swap_class(mlp, _EntersRegion)

    def partial_gradient(self, parent: nn.Module, *names: str) -> None:
        for name in names:
            setattr(_submodule(parent, name, nn.Module), PARTIAL_GRADIENT, True)

    def attention(self, attn: Attention) -> None:
        region = self.region()
        for name in ("q_proj", "k_proj", "v_proj"):
            self.column(attn, name, region, enters=False)
        self.row(attn, "o_proj", region)
        attn.tp_region = region
        _swap_class(attn, _EntersRegion)
        if attn.q_norm is not None:  # one weight shared by all heads, each rank holding some of them
            self.partial_gradient(attn, "q_norm", "k_norm")

    def mla(self, mla: MLA) -> None:
        """q_b_proj (or q_proj) and kv_b_proj column-wise by heads, each entering its own region from its
        latent; the shared rope key joins the heads' region; o_proj row-wise."""
        query = "q_proj" if mla.q_lora_rank is None else "q_b_proj"
        self.column(mla, query, self.region(), enters=True)
        self.column(mla, "kv_b_proj", self.region(), enters=True)
        self.row(mla, "o_proj", self.region())
        group = self.group
        if self.sequence_parallel:
            mla.rope_key_to_heads = lambda k_rot: gather_sequence(k_rot, SEQUENCE_DIM, group)
            down = ["kv_a_proj_with_mqa", "kv_a_layernorm"]
            if mla.q_lora_rank is not None:
                down += ["q_a_proj", "q_a_layernorm"]
            self.partial_gradient(mla, *down)
        else:
            mla.rope_key_to_heads = lambda k_rot: copy_to_region(k_rot, group)

    def moe(self, moe: MoELayer) -> None:
        moe.token_group = self.group
        self.partial_gradient(moe, "router")
        if moe.shared_experts is not None:  # on the layer's token slice, whatever the mode
            self.mlp(moe.shared_experts, Region(group=self.group, sequence_parallel=True))
        if not self.sequence_parallel:
            moe.tp_group = self.group
            _swap_class(moe, _RoutesSlice)

    def block(self, block: DecoderBlock) -> None:
        attn = _submodule(block, "self_attn", nn.Module)
        if isinstance(attn, MLA):
            self.mla(attn)
        else:
            self.attention(attn)
        if block.is_moe:
            self.moe(_submodule(block, "mlp", MoELayer))
        else:
            self.mlp(_submodule(block, "mlp", MLP), self.region())
        if self.sequence_parallel:
            self.partial_gradient(block, "input_layernorm", "post_attention_layernorm")


def _submodule(parent: nn.Module, name: str, kind: type) -> nn.Module:
    """parent.name, which must exist and be a `kind`: a plan naming what the model does not have is an error."""
    module = getattr(parent, name, None)
    if not isinstance(module, kind):
        raise ValueError(f"tensor-parallel plan: {type(parent).__name__} has no {kind.__name__} named {name!r}")
    return module


def apply_tensor_parallel(model: Transformer, recipe: Recipe, ctx: ParallelContext) -> None:
    """Shard `model` (on the meta device) over the tp mesh; a no-op at tp = 1."""
    if ctx.size("tp") == 1:
        return
    sequence_parallel = recipe.parallel.sequence_parallel
    mesh = ctx.mesh("tp")
    planner = _Planner(mesh=mesh, sequence_parallel=sequence_parallel)
    sequence = Shard(1) if sequence_parallel else Replicate()
    if model.embed_tokens is not None:  # a pipeline stage holds the embedding, the head, both or neither
        parallelize_module(model, mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                                          output_layouts=sequence)})
    if model.lm_head is not None:
        planner.column(model, "lm_head", planner.region(), enters=True)
        model.tie_weights()  # a tied head is the (now vocabulary-sharded) embedding again
        model.lm_loss = VocabParallelLoss(vocab_size=model.cfg.vocab_size,
                                          padded_vocab_size=model.cfg.padded_vocab_size(), group=planner.group)
    blocks = [*model.layers.values(), *(module.block for module in model.mtp.values())]
    for block in blocks:
        planner.block(block)
    if sequence_parallel:
        if model.norm is not None:
            planner.partial_gradient(model, "norm")
        for module in model.mtp.values():
            planner.partial_gradient(module, "enorm", "hnorm", "eh_proj", "norm")


@torch.no_grad()
def reduce_replicated_gradients(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum over tp the gradients of replicated parameters that each rank computed from part of the data (once
    per step, after the last micro-batch's backward), so every tp rank takes the same optimizer step."""
    grads = [
        _local(param.grad)
        for module in model.modules()
        if getattr(module, PARTIAL_GRADIENT, False)
        for param in module.parameters(recurse=False)
        if param.grad is not None
    ]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()

