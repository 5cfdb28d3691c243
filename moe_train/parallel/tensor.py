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
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from moe_train.models.decoder import DecoderBlock
from moe_train.models.layout_region import LayoutRegion
from moe_train.models.linear import Linear, linear
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
from moe_train.parallel.layout import wrap_region
from moe_train.parallel.vocab_parallel import VocabParallelLoss

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from moe_train.config import Recipe
    from moe_train.models.fp8.gemm import Fp8Gemm
    from moe_train.models.model import Transformer
    from moe_train.parallel.context import ParallelContext

# Modules whose replicated parameters get a partial gradient on each tp rank carry this attribute (True).
PARTIAL_GRADIENT = "tp_partial_gradient"
PARTIAL_BIAS = "tp_partial_bias"  # a row-parallel Linear whose replicated bias has a partial gradient (SP)
SEQUENCE_SHARD = "tp_sequence_shard"  # on a sequence-gathered activation: this rank's slice of it
SEQUENCE_DIM = -2  # of [b, s, h] activations, and of the [tokens, h] rows inside MoE layers


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class Region:
    """Where activations enter a tensor-parallel region, for the column-parallel GEMMs that read them.

    `enter` runs once per forward of the region's module: under sequence parallelism it all-gathers the
    sequence (its gradient is reduce-scattered once, however many GEMMs read the input), and the gathered
    tensor carries its slice (`SEQUENCE_SHARD`), so that each GEMM reading it keeps only the slice for backward;
    otherwise a copy whose gradient is all-reduced. Not a module: it holds no parameters and no state between
    calls, and is shared by the GEMMs of one region.
    """

    def __init__(self, *, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        self.group = group
        self.sequence_parallel = sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return copy_to_region(x, self.group)
        full = gather_sequence(x, SEQUENCE_DIM, self.group)
        setattr(full, SEQUENCE_SHARD, x)  # lives as long as the gathered tensor, on no module
        return full

    def column(self, x: torch.Tensor, weight: torch.Tensor, fp8: Fp8Gemm | None) -> torch.Tensor:
        shard = getattr(x, SEQUENCE_SHARD, None)
        if shard is not None:
            return column_linear_saving_shard(x, weight, shard, dim=SEQUENCE_DIM, group=self.group, fp8=fp8)
        return linear(x, weight, fp8=fp8)

    def leave_region(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel GEMM's partial sums to the replicated value or this rank's sequence slice of it."""
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, SEQUENCE_DIM, self.group)
        return reduce_from_region(partial, self.group)


# ------------------------------------------------------------------------------------------------ the styles
#
# Each is what a module declares room for (parallel/layout.py): a Linear's `parallel` (its GEMM), or a wrapper
# of a module's declared region (`layout_forward`, MLA's `rope_key_to_heads`). Not a forward hook: a
# recomputed region (parallel/recompute.py) wraps the module's declared forward, and its rerun must repeat
# these collectives; a hook would run outside it.


class ColumnParallel:
    """A Linear's GEMM (`Linear.parallel`) with its weight rows (output features) sharded over tp, and its bias
    with them (GLM-4.5's q/k/v); reads its input from `region`, entering the region itself when
    `enters_region` (a GEMM alone in its region)."""

    def __init__(self, region: Region, *, enters_region: bool) -> None:
        self.region, self.enters_region = region, enters_region

    def __call__(self, module: Linear, x: torch.Tensor) -> torch.Tensor:
        x = self.region.enter(x) if self.enters_region else x
        out = self.region.column(x, _local(module.weight), module.fp8)
        return out if module.bias is None else out + _local(module.bias)


class RowParallel:
    """A Linear's GEMM (`Linear.parallel`) with its weight columns (input features) sharded over tp; ends its
    region."""

    def __init__(self, region: Region) -> None:
        self.region = region

    def __call__(self, module: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.region.leave_region(linear(x, _local(module.weight), fp8=module.fp8))
        # A bias (gpt-oss's o_proj) is whole on every rank and added once, after the reduce; under sequence
        # parallelism each rank adds it to its sequence slice, so its gradient is partial (PARTIAL_BIAS).
        return out if module.bias is None else out + module.bias


def entering(region: Region):
    """A region wrapper for a module whose forward starts a tp region (attention, MLP), or for an activation
    that joins one without a GEMM of its own (MLA's shared rope key, `rope_key_to_heads`): its first argument
    enters once (a gather of the sequence, or a copy)."""

    def wrap(step):
        def run(module: nn.Module, x: torch.Tensor, *args, **kwargs):
            return step(module, region.enter(x), *args, **kwargs)

        return run

    return wrap


def routing_slice(group: dist.ProcessGroup):
    """A MoE layer's `layout_forward` wrapper without sequence parallelism: it routes this rank's slice of the
    replicated micro-batch and gathers the outputs again, so each token is routed (and counted) once."""

    def wrap(step):
        def run(module: nn.Module, hidden: torch.Tensor, *args, **kwargs):
            mine = scatter_sequence(hidden, SEQUENCE_DIM, group)
            return gather_replicated(step(module, mine, *args, **kwargs), SEQUENCE_DIM, group)

        return run

    return wrap


# -------------------------------------------------------------------------------------------------- the plan
#
# Each module kind's submodules and the style each takes. COLUMN reads the input its module's region entered
# once; COLUMN_ENTERING is alone in its region and enters it itself; ROW ends the region; ENTRY joins the
# region without a GEMM. PARTIAL names the modules whose replicated parameters get a partial gradient on each
# tp rank (summed by `reduce_replicated_gradients`): always, or only under sequence parallelism (computed on a
# sequence slice); `name?` where a module of that kind may lack it.

COLUMN, COLUMN_ENTERING, ROW, ENTRY = "column", "column_entering", "row", "entry"

PLANS: dict[str, dict[str, str]] = {
    "attention": {"q_proj": COLUMN, "k_proj": COLUMN, "v_proj": COLUMN, "o_proj": ROW},
    "mla": {"q_proj|q_b_proj": COLUMN_ENTERING, "kv_b_proj": COLUMN_ENTERING, "rope_key_to_heads": ENTRY,
            "o_proj": ROW},
    "mlp": {"gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW},
    "head": {"lm_head": COLUMN_ENTERING},  # by vocabulary, with the vocabulary-parallel loss
}
ENTERS_ONCE = ("attention", "mlp")  # the module's input enters its one region (the others: each GEMM its own)
PARTIAL = {  # module kind: (always, under sequence parallelism)
    "attention": (("q_norm?", "k_norm?"), ()),  # QK-norm: one weight shared by all heads, each rank some heads
    "mla": ((), ("kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_proj?", "q_a_layernorm?")),  # down projections
    "moe": (("router",), ()),
    "block": ((), ("input_layernorm", "post_attention_layernorm")),
    "model": ((), ("norm?",)),  # a pipeline stage without the loss has no final norm
    "mtp": ((), ("enorm", "hnorm", "eh_proj", "norm")),
}


def _shard_weight(module: Linear, mesh: DeviceMesh, dim: int) -> None:
    """The weight by rows (0, column-parallel, with its bias) or columns (1, row-parallel: its bias stays whole,
    added after the reduce)."""
    if module.bias is not None and dim == 0:
        module.bias = nn.Parameter(distribute_tensor(module.bias.data, mesh, [Shard(0)]))
    module.weight = nn.Parameter(distribute_tensor(module.weight.data, mesh, [Shard(dim)]))


class _Planner:
    """Applies the plan to one model; every name it is given must exist in the module it is resolved in
    (`a|b`: whichever of the two the module has)."""

    def __init__(self, *, mesh: DeviceMesh, sequence_parallel: bool) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.sequence_parallel = sequence_parallel

    def region(self, *, sequence_parallel: bool | None = None) -> Region:
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        return Region(group=self.group, sequence_parallel=sp)

    def apply(self, kind: str, module: nn.Module, region: Region | None = None) -> None:
        """`module`'s plan; `region`: the one its input enters (ENTERS_ONCE kinds; default a new one)."""
        shared = region or self.region()
        for names, style in PLANS[kind].items():
            name = _present(module, names)
            if style == ENTRY:
                entry = _submodule(module, name, LayoutRegion)  # the model declares it (as is, by default)
                wrap_region(entry, entering(shared), reason="tensor parallel: joins the region")
                continue
            target = _submodule(module, name, Linear)
            _shard_weight(target, self.mesh, 1 if style == ROW else 0)
            if style == ROW and target.bias is not None and shared.sequence_parallel:
                setattr(target, PARTIAL_BIAS, True)
            region = shared if kind in ENTERS_ONCE else self.region()
            target.parallel = RowParallel(region) if style == ROW else ColumnParallel(
                region, enters_region=style == COLUMN_ENTERING)
        if kind in ENTERS_ONCE:
            wrap_region(module.layout_forward, entering(shared), reason="tensor parallel: input enters the region")
        if kind in PARTIAL:
            self.partial_gradient(kind, module)
        if getattr(module, "sinks", None) is not None:  # gpt-oss: one sink per head, sharded with the heads
            module.sinks = nn.Parameter(distribute_tensor(module.sinks.data, self.mesh, [Shard(0)]))

    def partial_gradient(self, kind: str, module: nn.Module) -> None:
        always, sliced = PARTIAL[kind]
        for name in (*always, *(sliced if self.sequence_parallel else ())):
            if name.endswith("?"):
                name = name[:-1]
                if getattr(module, name, None) is None:
                    continue
            setattr(_submodule(module, name, nn.Module), PARTIAL_GRADIENT, True)

    def split_moe_tokens(self, layer: MoELayer) -> None:
        """The MoE layer routes this rank's slice of the tokens (counted over the tp group); its shared experts
        are split by ffn features like a dense MLP, on that slice."""
        layer.token_group = self.group
        self.partial_gradient("moe", layer)
        if layer.shared_experts is not None:  # on the layer's token slice, whatever the mode
            self.apply("mlp", layer.shared_experts, self.region(sequence_parallel=True))
        if not self.sequence_parallel:
            wrap_region(layer.layout_forward, routing_slice(self.group), reason="tensor parallel: route a slice")

    def block(self, block: DecoderBlock) -> None:
        attn = _submodule(block, "self_attn", nn.Module)
        self.apply("mla" if isinstance(attn, MLA) else "attention", attn)
        if block.is_moe:
            self.split_moe_tokens(_submodule(block, "ffn", MoELayer))
        else:
            self.apply("mlp", _submodule(block, "ffn", MLP))
        self.partial_gradient("block", block)


def _present(parent: nn.Module, names: str) -> str:
    """The first of `a|b` that `parent` has (or `a`, for `_submodule` to report)."""
    options = names.split("|")
    return next((name for name in options if getattr(parent, name, None) is not None), options[0])


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
        planner.apply("head", model)
        model.tie_weights()  # a tied head is the (now vocabulary-sharded) embedding again
        model.lm_loss = VocabParallelLoss(vocab_size=model.cfg.vocab_size,
                                          padded_vocab_size=model.cfg.padded_vocab_size(), group=planner.group)
    blocks = [*model.layers.values(), *(module.block for module in model.mtp.values())]
    for block in blocks:
        planner.block(block)
    planner.partial_gradient("model", model)
    for module in model.mtp.values():
        planner.partial_gradient("mtp", module)


@torch.no_grad()
def reduce_replicated_gradients(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum over tp the gradients of replicated parameters that each rank computed from part of the data (once
    per step, after the last micro-batch's backward), so every tp rank takes the same optimizer step."""
    grads = [
        _local(param.grad)
        for module in model.modules()
        for name, param in module.named_parameters(recurse=False)
        if (getattr(module, PARTIAL_GRADIENT, False) or (name == "bias" and getattr(module, PARTIAL_BIAS, False)))
        and param.grad is not None
    ]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()

