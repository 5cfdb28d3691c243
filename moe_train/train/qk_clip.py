"""QK-clip (MuonClip, Kimi K2): after each optimizer step, shrink the query and key weights of every attention
head whose largest pre-softmax logit in that step exceeded `train.muon.qk_clip`.

A head h with maximum logit m_h > t gets eta_h = t / m_h, split evenly between its two sides so that its logits
scale by eta_h:
- grouped-query attention: the query rows of head h and the key rows of its group times sqrt(eta), eta the
  smallest of the group's (a key head serves several query heads; Megatron-Core's rule);
- MLA: the head's query nope rows (q_proj or q_b_proj) and its key nope rows (kv_b_proj) times sqrt(eta), its
  query rope rows times eta, and the one rope key all heads share (kv_a_proj_with_mqa) left alone, as Kimi K2
  does. Values are never touched.
A head at or under the threshold is multiplied by nothing (bit for bit unchanged). The maxima come from the
step's forwards (models/attention.py `head_max_logits`, beside the attention call: its cost is stated there),
the largest over the step's micro-batches and, by one all-reduce (MAX) over dp, over the data-parallel ranks,
so every replica clips alike; under tensor parallelism each rank measured its own heads and one all-gather over
tp gives every rank all of them. A step that is not applied (bad_steps.py) keeps its maxima for the next one.
QK-norm models are refused (rules.py): the norm after the projections would undo the scaling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from moe_train.models.attention import Attention
from moe_train.models.mla import MLA

if TYPE_CHECKING:
    from moe_train.parallel.context import ParallelContext


def _scale_rows(weight: torch.Tensor, row_scale: torch.Tensor) -> None:
    """weight [rows, in] *= row_scale [rows] (whole), whatever the weight's sharding: the scale enters as a
    replicated DTensor and each rank multiplies its own rows."""
    scale = row_scale.to(weight.dtype)[:, None]
    if isinstance(weight, DTensor):
        scale = DTensor.from_local(scale, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim, run_check=False)
    weight.mul_(scale)


def clip_attention(module: nn.Module, eta: torch.Tensor) -> None:
    """Scale `module`'s query and key weights for per-head factors `eta` [heads] (1: untouched), by the rules of
    the module docstring."""
    root = eta.sqrt()
    if isinstance(module, Attention):
        groups = module.k_proj.weight.shape[0] // module.head_dim
        group_root = eta.view(groups, -1).amin(dim=1).sqrt()
        per_head = group_root.repeat_interleave(eta.numel() // groups)
        _scale_rows(module.q_proj.weight.data, per_head.repeat_interleave(module.head_dim))
        _scale_rows(module.k_proj.weight.data, group_root.repeat_interleave(module.head_dim))
        return
    nope, rope, v_dim = module.nope_dim, module.rope_dim, module.v_dim
    q_rows = torch.cat([root[:, None].expand(-1, nope), eta[:, None].expand(-1, rope)], dim=1).reshape(-1)
    q_proj = module.q_proj if module.q_lora_rank is None else module.q_b_proj
    _scale_rows(q_proj.weight.data, q_rows)
    kv_rows = torch.cat([root[:, None].expand(-1, nope), torch.ones_like(root)[:, None].expand(-1, v_dim)], dim=1)
    _scale_rows(module.kv_b_proj.weight.data, kv_rows.reshape(-1))


class QKClip:
    """An optimizer step post-hook over one model chunk's attention modules (train/build.py registers it)."""

    def __init__(self, chunk: nn.Module, *, threshold: float, ctx: ParallelContext) -> None:
        self.threshold = threshold
        self.modules = [m for m in chunk.modules() if isinstance(m, Attention | MLA)]
        self.dp = ctx.group("dp") if ctx.size("dp") > 1 else None
        self.tp = ctx.group("tp") if ctx.size("tp") > 1 else None
        for module in self.modules:
            module.measures_max_logits = True

    def head_maxima(self) -> list[torch.Tensor]:
        """Each module's maxima over every head of the model, agreed by every rank of the stage (collective)."""
        local = torch.stack([m.max_logits for m in self.modules])  # [layers, this rank's heads]
        if self.dp is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.dp)
        if self.tp is not None:
            shards = [torch.empty_like(local) for _ in range(dist.get_world_size(self.tp))]
            dist.all_gather(shards, local, group=self.tp)
            local = torch.cat(shards, dim=1)  # tp shards heads in rank order
        return list(local.unbind(0))

    @torch.no_grad()
    def __call__(self, optimizer, args, kwargs) -> None:
        if not self.modules or any(m.max_logits is None for m in self.modules):
            return
        for module, maxima in zip(self.modules, self.head_maxima(), strict=True):
            eta = torch.where(maxima > self.threshold, self.threshold / maxima, torch.ones_like(maxima))
            clip_attention(module, eta)
            module.max_logits = None
