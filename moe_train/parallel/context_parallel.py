"""Context parallelism (`parallel.cp`): every sequence is split over the cp ranks, which hold the same parameters.

The split (Megatron-LM's, for causal load balance): the sequence is cut into 2*cp equal chunks and cp rank r
keeps chunks r and 2*cp-1-r, so every rank holds one early and one late chunk and does the same attention work.
The data is cut after everything that needs the whole sequence (train/batch.py: labels, positions, MTP's
shifted inputs and targets), so each rank's labels, RoPE positions and document ids are its tokens' own.

What changes in the model, from outside (`apply_context_parallel`, after tensor parallelism, before recompute):
- each attention's `core_attention` attends through `ContextParallelAttention` (its `parallel`; the exchange in
  parallel/ring_attention.py), which sees the queries of this rank's tokens and the keys and values of the
  whole sequence through a ring of p2p exchanges or one all-gather (`parallel.cp_comm`; the default per
  family: `ParallelConfig.cp_exchange`);
- `attention_mask_of` gives a `ShardMask` (this rank's chunks and, with data.reset_at_eod, its positions);
- MoE layers route their own tokens; their balancing losses count over the micro-batch's shards on every cp
  (and tp) rank (`token_group`): aux_loss and z-loss over the whole micro-batch, seq_aux_loss per sequence over
  its 2*cp chunks (counts summed over cp, each rank's share P over the whole sequence length: the scale
  Megatron-LM PR #5047 fixed);
- the loss's `mean` (MTP) divides by the number of valid targets of all cp ranks (`ContextParallelLoss`), so
  the shares add up to the single-process mean.

The language-model cross-entropy is summed over this rank's tokens and divided by the step's token count as at
cp = 1; the cp ranks' gradients are then summed by FSDP2 over dp x cp (`ParallelContext.fsdp_mesh`), as are the
loss sums and MoE counts in the trainer's one all-reduce of figures (cp rank 0 is not special there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moe_train.models.attention import Attention
from moe_train.models.loss import IGNORE_INDEX
from moe_train.models.mla import MLA
from moe_train.models.moe import MoELayer
from moe_train.parallel.ring_attention import ShardMask, context_parallel_attention

if TYPE_CHECKING:
    from moe_train.config import Recipe
    from moe_train.models.model import Transformer
    from moe_train.parallel.context import ParallelContext


def shard_sequence(x: torch.Tensor, *, cp: int, rank: int) -> torch.Tensor:
    """Chunks `rank` and 2*cp-1-`rank` of the last dimension (the sequence) cut into 2*cp, as one new tensor."""
    chunks = x.unflatten(-1, (2 * cp, x.shape[-1] // (2 * cp)))
    keep = torch.tensor([rank, 2 * cp - 1 - rank], device=x.device)
    return chunks.index_select(-2, keep).flatten(-2)


def chunk_indices(seq_length: int, *, cp: int, rank: int) -> torch.Tensor:
    """Global token indices of a rank's shard, in its order (what `shard_sequence` keeps of 0..s-1)."""
    return shard_sequence(torch.arange(seq_length), cp=cp, rank=rank)


class ContextParallelAttention:
    """`CoreAttention.parallel` under CP: attention across the cp ranks, with the same q, k, v [b, heads, 2c, d]
    and keyword arguments as `attend` there (`scale`, gpt-oss's `window` and `sinks`; grouped-query heads follow
    from the shapes) and a `ShardMask`. Inside CoreAttention's forward, so recomputation and offloading wrap it
    as they wrap SDPA."""

    def __init__(self, *, group: dist.ProcessGroup, comm: str) -> None:
        self.group, self.comm = group, comm

    # Eager inside a compiled block (train.compile): the exchange's point-to-point ops and its hand-written
    # backward are not traceable, so the block's graph breaks around attention instead of failing.
    @torch.compiler.disable
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ShardMask, *,
                 scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return context_parallel_attention(q, k, v, mask, scale=scale, group=self.group, comm=self.comm,
                                          window=window, sinks=sinks)


class ShardMasks:
    """The model's `attention_mask_of` under CP: a `ShardMask` of this rank's chunks, with the positions when
    documents may restart inside a sequence (data.reset_at_eod; without it the positions are 0..s-1 and the
    mask is plain causal, so they are not read)."""

    def __init__(self, *, cp: int, rank: int, documents: bool) -> None:
        self.chunks, self.documents = (rank, 2 * cp - 1 - rank), documents

    def __call__(self, position_ids: torch.Tensor, documents: bool) -> ShardMask:
        return ShardMask(chunks=self.chunks, chunk=position_ids.shape[-1] // 2,
                         positions=position_ids if self.documents else None)


class ContextParallelLoss:
    """The model's loss under CP: sums as the wrapped loss does (this rank's tokens, its head chunked where
    train.loss_chunk_tokens says), means over the valid targets of every cp rank (one all-reduce of the count),
    so MTP's per-rank means add up to the whole sequence's mean."""

    def __init__(self, inner, *, group: dist.ProcessGroup) -> None:
        self.inner, self.group = inner, group

    @property
    def chunk_tokens(self) -> int:
        return self.inner.chunk_tokens

    def head_sum(self, head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner.head_sum(head, hidden, targets)

    def head_mean(self, head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner.head_sum(head, hidden, targets) / self._count(targets)

    def _count(self, targets: torch.Tensor) -> torch.Tensor:
        count = (targets != IGNORE_INDEX).sum()
        dist.all_reduce(count, group=self.group)
        return count.clamp(min=1)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.inner.full_logits(logits)


def apply_context_parallel(model: Transformer, recipe: Recipe, ctx: ParallelContext) -> None:
    """Make `model` (this rank's chunk, on the meta device) attend across the cp ranks; a no-op at cp = 1."""
    cp = ctx.size("cp")
    if cp == 1:
        return
    group = ctx.group("cp")
    comm = recipe.parallel.cp_exchange(recipe.model.family)
    for module in model.modules():
        if isinstance(module, Attention | MLA):
            module.core_attention.parallel = ContextParallelAttention(group=group, comm=comm)
    model.attention_mask_of = ShardMasks(cp=cp, rank=ctx.coord("cp"), documents=recipe.data.reset_at_eod)
    # The balancing losses' token set: the micro-batch, whose tokens lie on every cp and tp rank of it.
    token_group = ctx.group("cp_tp") if ctx.size("tp") > 1 else group
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.token_group = token_group
    if len(model.mtp) > 0:
        model.lm_loss = ContextParallelLoss(model.lm_loss, group=group)
