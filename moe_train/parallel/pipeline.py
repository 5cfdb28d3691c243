"""Pipeline parallelism: the first step of `parallelize`, and the schedule that runs the stages.

The recipe's stages (`parallel.pp_layout` in Megatron's notation, or an even split: config/pp_layout.py) are
dealt to pipeline ranks round-robin, virtual stage s on rank s % pp, so a rank holds vpp model chunks. A chunk
is the whole model cut down (`split_model`): the decoder layers of its stage, under their own indices (the
ModuleDict keys, hence the parameter names, are the single-process model's), the embedding where the stage
holds `E`, the final norm, head and MTP modules where it holds `L` (docs/decisions.md: MTP lives on the last stage).
Checkpoints therefore hold the same keys at every pp, and a chunk is parallelised (TP, EP, recompute, FSDP2)
exactly as a whole model is.

The last stage also needs the embedding's weights when it runs MTP (which embeds the tokens ahead) or ties its
head to the embedding. It then keeps its own copy, initialised by the same name, and the two copies' gradients
are summed before every update (`sync_shared_gradients`, over a group of the first and last stage's ranks), as
Megatron-Core does for shared embeddings: both copies take the same step and stay bit-equal; the copy is
counted once in the gradient norm (`duplicate_parameters`) and its checkpoint key is the embedding's own. In a
V (dualpipev) the first and the last stage are both on pipeline rank 0: the rank holds both copies, sums them
in place and needs no group; its checkpoint writes the key once and a load fills both copies
(checkpoint/state.py).

Schedules are torch.distributed.pipelining's, given static stage inputs and outputs (a hidden-state tensor
between stages, the loss terms after the last): 1f1b, gpipe, interleaved_1f1b (vpp > 1), zero_bubble
(torch's interleaved zero-bubble schedule) and dualpipev (torch's DualPipeV with full backwards, vpp 2 in a V;
under `parallel.ep_overlap` its overlapped forward+backward actions run as pairs: parallel/dual_pipe.py).
Every stage receives the micro-batch's token ids, labels and position ids as keyword arguments (the data is
read on every pipeline rank; docs/decisions.md: the last stage reads its input ids from the data), so rotary
tables and document masks are rebuilt per stage and MTP finds its tokens. The loss already divides by the
whole step's tokens and micro-batches, so the schedule sums gradients unscaled (`scale_grads=False`) and FSDP2
reduces them once per step, after the last backward.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from moe_train.config.pp_layout import StageContents, stages_of
from moe_train.models.model import LossTerms, Transformer

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.parallel.context import ParallelContext


def keep_layers(model: Transformer, *, layers: Iterable[int], mtp: Iterable[int]) -> None:
    """Drop every decoder layer of `model` but `layers` and every MTP module but `mtp` (k, not num_layers + k):
    what a stage holds, and what `measure --layers` builds."""
    keep = {str(index) for index in layers}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    keep_mtp = {str(k) for k in mtp}
    for name in list(model.mtp):
        if name not in keep_mtp:
            del model.mtp[name]


def _cut(model: Transformer, stage: StageContents) -> Transformer:
    """`model` (meta) reduced to what `stage` holds, running that stage: the Transformer's own forward reads
    `stage` (models/model.py). Not a wrapper module: a wrapper would prefix every parameter name, and
    checkpoints must hold the single-process model's names."""
    keep_layers(model, layers=stage.layers, mtp=stage.mtp)
    needs_embedding = stage.embedding or (stage.loss and (len(model.mtp) > 0 or model.cfg.tie_embeddings))
    if not needs_embedding:
        model.embed_tokens = None
    if not stage.loss:
        model.norm = None
        model.lm_head = None
    model.stage = stage
    return model


def _copy(model: Transformer) -> Transformer:
    """A deep copy of the unmaterialised model: meta tensors cost nothing to copy; `measure --fake` builds
    with fake tensors, whose copies must stay in the same fake mode."""
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor

    weight = next(model.parameters())
    fake = isinstance(weight, FakeTensor)
    with FakeCopyMode(weight.fake_mode) if fake else contextlib.nullcontext():
        return copy.deepcopy(model)


def split_model(model: Transformer, recipe: Recipe, ctx: ParallelContext) -> list[Transformer]:
    """This rank's chunks of `model` (built on the meta device), in virtual-stage order; [model] without
    pipeline parallelism."""
    if ctx.size("pp") == 1:
        return [model]
    mine = [stage for stage in stages_of(recipe) if stage.rank == ctx.coord("pp")]
    copies = [_copy(model) for _ in mine[1:]] + [model]
    return [_cut(chunk, stage) for chunk, stage in zip(copies, mine, strict=True)]


# ------------------------------------------------------------------------------------ shared embedding


def shared_embedding_group(recipe: Recipe, ctx: ParallelContext) -> dist.ProcessGroup | None:
    """The two-rank group of this rank's first-stage and last-stage peers (same dp, cp, tp coordinates), when
    the last stage keeps a copy of the embedding on another rank than the first stage; None on ranks outside
    it, when there is no copy, and in a V (both stages on pipeline rank 0: `sync_shared_gradients` sums there).

    Every rank calls this (creating process groups is collective); the group is recorded in the context as
    `embedding`, the name its all-reduce goes by in byte counts."""
    m, p, pp = recipe.model, recipe.parallel, ctx.size("pp")
    if pp == 1 or not (m.mtp_layers > 0 or m.tie_embeddings) or p.pp_schedule == "dualpipev":
        return None
    per_stage = ctx.world_size // pp  # pp is the outermost dimension: stage rank r holds ranks [r*n, (r+1)*n)
    pairs = [[offset, (pp - 1) * per_stage + offset] for offset in range(per_stage)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    ctx.named_groups["embedding"] = group
    return group


def _embedding_weight(chunk: Transformer) -> nn.Parameter | None:
    return chunk.embed_tokens.weight if chunk.embed_tokens is not None else None


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a gradient (a DTensor under FSDP2 or TP), in place."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


@torch.no_grad()
def sync_shared_gradients(chunks: list[Transformer], group: dist.ProcessGroup | None) -> None:
    """Sum the embedding's gradient with its last-stage copy's; every copy ends up with the sum. The copies on
    this rank (both in a V) are summed in place, then over `group` when the other copy is on another rank."""
    grads = [_local(weight.grad) for chunk in chunks for weight in [_embedding_weight(chunk)]
             if weight is not None and weight.grad is not None]
    if not grads or (len(grads) == 1 and group is None):
        return
    total = grads[0]
    for other in grads[1:]:  # two copies at most: a + b, the sum a two-rank all-reduce makes
        total.add_(other)
    if group is not None:
        dist.all_reduce(total, group=group)
    for other in grads[1:]:
        other.copy_(total)


def duplicate_parameters(chunks: list[Transformer]) -> list[nn.Parameter]:
    """Parameters that are a copy of another stage's (the last stage's embedding): counted once in the norm."""
    return [
        weight
        for chunk in chunks
        if chunk.stage is not None and not chunk.stage.embedding
        for weight in [_embedding_weight(chunk)]
        if weight is not None
    ]


# ------------------------------------------------------------------------------------------- schedule


def _stage_io(recipe: Recipe, ctx: ParallelContext, stage: StageContents) -> tuple[torch.Tensor, tuple]:
    """Meta tensors of what a stage receives and sends for one micro-batch."""
    train, m = recipe.train, recipe.model
    local = train.seq_length // ctx.size("cp")  # this rank's shard of each sequence under context parallelism
    seq = local // ctx.size("tp") if recipe.parallel.sequence_parallel else local
    dtype = torch.bfloat16 if train.compute_precision == "bf16" else torch.float32
    # Floating-point tensors between stages carry gradients back (the received ones are autograd leaves).
    hidden = torch.empty(train.micro_batch_size, seq, m.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    tokens = torch.empty(train.micro_batch_size, local, dtype=torch.int64, device="meta")
    scalar = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
    inputs = tokens if stage.embedding else hidden
    outputs = (scalar, scalar) if stage.loss else (hidden,)
    return inputs, outputs


class Pipeline:
    """This rank's stages and the recipe's schedule over them. `train` runs one step's forwards and backwards
    (gradients accumulate in the chunks' parameters), `evaluate` forwards only; `loss` receives the last stage's
    loss terms of each micro-batch and returns what backward starts from."""

    def __init__(self, chunks: list[Transformer], recipe: Recipe, ctx: ParallelContext) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )
        from torch.distributed.pipelining.schedules import OVERLAP_F_B

        from moe_train.parallel.dual_pipe import DualPipeVFullBackward, overlapped_forward_backward

        p, train = recipe.parallel, recipe.train
        self.micro_batches = train.global_batch_size // (train.micro_batch_size * ctx.size("dp"))
        self._loss: Callable[[LossTerms], torch.Tensor] | None = None
        num_stages = p.pp * p.vpp
        stages = []
        for chunk in chunks:
            inputs, outputs = _stage_io(recipe, ctx, chunk.stage)
            stages.append(PipelineStage(chunk, chunk.stage.index, num_stages, ctx.device, input_args=inputs,
                                        output_args=outputs, group=ctx.group("pp")))
        self.holds_loss = any(chunk.stage.loss for chunk in chunks)
        single = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
        multi = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zero_bubble": ScheduleInterleavedZeroBubble,
                 "dualpipev": DualPipeVFullBackward}
        kind = p.pp_schedule
        stage_arg = stages[0] if kind in single else stages
        schedule_class = single.get(kind) or multi[kind]
        self.schedule = schedule_class(stage_arg, self.micro_batches, loss_fn=self._micro_batch_loss,
                                       scale_grads=False)
        self.dual_pipe = kind == "dualpipev"
        if p.ep_overlap:  # validate admits it with dualpipev only: its OVERLAP_F_B actions become overlapped pairs
            self.schedule.register_custom_function(OVERLAP_F_B, overlapped_forward_backward(self.schedule))

    def _micro_batch_loss(self, terms: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        return self._loss(LossTerms(*terms))

    def _run(self, run, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
             loss: Callable[[LossTerms], torch.Tensor], mtp: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._loss = loss
        kwargs = {"input_ids": inputs, "labels": labels}
        if positions is not None:
            kwargs["position_ids"] = positions
        if mtp is not None:  # [B, depth, s]: split into micro-batches along dim 0 like the rest
            kwargs["mtp_inputs"], kwargs["mtp_targets"] = mtp
        try:
            run(inputs, target=labels, return_outputs=False, **kwargs)
        finally:
            self._loss = None

    def train(self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
              loss: Callable[[LossTerms], torch.Tensor], mtp: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> None:
        """One step over this rank's samples [B, s], split into the step's micro-batches along dim 0; `mtp`:
        MTP's inputs and targets shifted on the whole sequences (context parallelism)."""
        self._run(self.schedule.step, inputs, labels, positions, loss, mtp)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
                 loss: Callable[[LossTerms], torch.Tensor], mtp: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> None:
        from moe_train.parallel.dual_pipe import evaluating

        with evaluating(self.schedule) if self.dual_pipe else contextlib.nullcontext():
            self._run(self.schedule.eval, inputs, labels, positions, loss, mtp)
