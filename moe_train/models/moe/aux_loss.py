"""Load-balancing and router losses, as pure functions of the router's outputs.

Each is unweighted (its coefficient is applied by the caller) so that the trainer can also aggregate them across
layers, micro-batches or ranks. Expert counts never carry gradient: the gradient reaches the router through the
scores alone, as in the Switch Transformer and DeepSeek-V3 papers.
"""

from __future__ import annotations

import torch

from moe_train.models.moe.router import count_per_expert


def global_aux_loss(
    probs: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int | torch.Tensor
) -> torch.Tensor:
    """Switch loss with the expert load counted over a (possibly larger) token set.

    probs [T, E] are this process's router probabilities (the gradient path); tokens_per_expert [E] counts top-k
    assignments over the `num_tokens` tokens of the whole set (e.g. all-reduced over ranks or summed over
    micro-batches). Loss = E * sum_e (count_e / num_tokens) * mean_t probs[t, e]; it equals top_k at perfect
    balance, as transformers' Qwen3-MoE loss does.
    """
    num_experts = probs.shape[-1]
    load = tokens_per_expert.detach().to(torch.float32) / num_tokens
    importance = probs.float().sum(dim=0) / probs.shape[0]
    return torch.sum(load * importance) * num_experts


def switch_aux_loss(probs: torch.Tensor, topk_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Qwen3-MoE): probs [T, E], topk_indices [T, K] -> scalar.

    Given the concatenation of all layers' probs and indices it equals transformers' loss for the whole model.
    """
    counts = count_per_expert(topk_indices, num_experts)
    return global_aux_loss(probs, counts, probs.shape[0])


def seq_aux_loss(scores: torch.Tensor, topk_indices: torch.Tensor, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences.

    scores [b, s, E] (sigmoid or softmax), topk_indices [b, s, K]. Per sequence of T tokens:
    f_i = E / (K * T) * (times expert i is in a top-k), P_i = mean_t s_i,t / sum_j s_j,t; loss = sum_i f_i P_i
    (1 at perfect balance).
    """
    batch, seq, num_experts = scores.shape
    counts = torch.zeros(batch, num_experts, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(
        1, topk_indices.reshape(batch, -1), torch.ones_like(topk_indices.reshape(batch, -1), dtype=torch.float32)
    )
    f = counts * (num_experts / (top_k * seq))
    scores = scores.float()
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)
    return (f * p).sum(dim=-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2; keeps router logits small and stable."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


# ---------------------------------------------------------------------------------- attaching to activations
#
# A balancing loss is not added to the training loss: its gradient is attached to the MoE layer's output
# (Megatron-Core's auto-scaler pattern), so it travels with the forward that produced it. Nothing is kept on
# the module between the forward and the backward, so several micro-batches in flight (pipeline schedules), a
# region recomputed in backward, or a stage that does not hold the loss cannot overwrite or lose it. The
# trainer sets one scale per step (each micro-batch's share of the step's mean); the value at forward time is
# captured with the forward.

_scale = 1.0


def set_aux_loss_scale(scale: float) -> None:
    """The factor on balancing-loss gradients of the forwards that follow (the trainer: 1 / (micro-batches x
    data-parallel ranks), the same share the language-model loss gives each micro-batch)."""
    global _scale
    _scale = scale


class _AttachLoss(torch.autograd.Function):
    """Identity on `out`; its backward also feeds `scale` as the gradient of the scalar `loss`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.scale = _scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device)


def attach_loss(out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`out` unchanged, with `loss` (a scalar computed from this forward alone) differentiated in its backward."""
    return _AttachLoss.apply(out, loss)


class ScoreGradient:
    """d(loss)/d(router scores) of a switch-style loss, per expert: coeff * E * load_e / rows.

    Its value depends on expert counts over a token set that may reach beyond this forward (other ranks,
    earlier micro-batches, all layers), known when the forward runs or, for transformers' all-layers loss,
    when the model's forward ends; the backward reads it then. A recomputed forward makes a new, unused one.
    """

    def __init__(self) -> None:
        self.per_expert: torch.Tensor | None = None


class _AttachScoreGradient(torch.autograd.Function):
    """Identity on `out`; its backward gives `scores` the gradient `holder` holds, times the step's scale."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, scores: torch.Tensor, holder: ScoreGradient) -> torch.Tensor:
        ctx.scale, ctx.holder, ctx.rows = _scale, holder, scores.shape[0]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        per_expert = ctx.holder.per_expert * ctx.scale
        return grad, per_expert.to(torch.float32).expand(ctx.rows, -1), None


def attach_score_gradient(out: torch.Tensor, scores: torch.Tensor, holder: ScoreGradient) -> torch.Tensor:
    """`out` unchanged; its backward sends `holder`'s gradient to the router scores [T, E]."""
    return _AttachScoreGradient.apply(out, scores, holder)
