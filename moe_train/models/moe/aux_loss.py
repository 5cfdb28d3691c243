"""Load-balancing and router losses, as pure functions of the router's outputs.

Each is unweighted (its coefficient is applied by the caller) so that the trainer can also aggregate them across
layers, micro-batches or ranks. Expert counts never carry gradient: the gradient reaches the router through the
scores alone, as in the Switch Transformer and DeepSeek-V3 papers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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


def seq_aux_loss(
    scores: torch.Tensor, topk_indices: torch.Tensor, top_k: int, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences.

    scores [b, s, E] (sigmoid or softmax), topk_indices [b, s, K]. Per sequence of T tokens:
    f_i = E / (K * T) * (times expert i is in a top-k), P_i = mean_t s_i,t / sum_j s_j,t; loss = sum_i f_i P_i
    (1 at perfect balance).

    `group`: ranks that each hold an equal slice of every sequence (sequence parallelism). The counts are summed
    over it and P sums this rank's tokens over the whole sequence length, so the result is this rank's share of
    the loss: the shares add up to the single-device loss, and each rank's gradient reaches its own tokens.
    """
    batch, seq, num_experts = scores.shape
    counts = torch.zeros(batch, num_experts, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(
        1, topk_indices.reshape(batch, -1), torch.ones_like(topk_indices.reshape(batch, -1), dtype=torch.float32)
    )
    scores = scores.float()
    normalised = scores / scores.sum(dim=-1, keepdim=True)
    if group is None or dist.get_world_size(group) == 1:
        f = counts * (num_experts / (top_k * seq))
        return (f * normalised.mean(dim=1)).sum(dim=-1).mean()
    dist.all_reduce(counts, group=group)
    full_seq = seq * dist.get_world_size(group)
    f = counts * (num_experts / (top_k * full_seq))
    return (f * (normalised.sum(dim=1) / full_seq)).sum(dim=-1).mean()


def z_loss(logits: torch.Tensor, *, token_shards: int = 1) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2; keeps router logits small and stable.

    token_shards: the number of ranks holding an equal share of the token set (sequence parallelism); each
    returns its share of the mean (its tokens' sum over the whole set's count)."""
    squares = torch.logsumexp(logits.float(), dim=-1).square()
    if token_shards == 1:
        return squares.mean()
    return squares.sum() / (squares.shape[0] * token_shards)


# ---------------------------------------------------------------------------------- attaching to activations
#
# A balancing loss is not added to the training loss: its gradient is attached to the MoE layer's output
# (Megatron-Core's auto-scaler pattern), so it travels with the forward that produced it. Nothing is kept on
# the module between the forward and the backward, so several micro-batches in flight (pipeline schedules), a
# region recomputed in backward, or a stage that does not hold the loss cannot overwrite or lose it. The step
# sets one scale per step on each model chunk's `StepBalancing` (each micro-batch's share of the step's mean);
# the value at forward time is captured with the forward.


class StepBalancing:
    """What the balancing losses of one model chunk share over the forwards of a training step, owned by the model
    (one object for all its MoE layers) and set by the step with `start_step`:

    - `scale`, the factor on balancing-loss gradients (the step: 1 / (micro-batches x data-parallel ranks), the
      share the language-model loss gives each micro-batch);
    - global_aux_loss's running loads: each layer's tokens per expert (and token count) over the step's
      micro-batches so far, which its loss of the next micro-batch counts over.

    Explicit rather than module state, so no forward reads a value a previous step left behind.
    """

    def __init__(self) -> None:
        self.scale = 1.0
        self._loads: dict[object, torch.Tensor] = {}

    def start_step(self, *, scale: float) -> None:
        """A new step: its gradient scale, and global_aux_loss's running loads back to zero."""
        self.scale = scale
        self._loads.clear()

    def running_load(self, layer: object, totals: torch.Tensor) -> torch.Tensor:
        """Add `totals` ([E + 1] int64: tokens per expert, then tokens) to `layer`'s running load of this step;
        returns the sum so far."""
        previous = self._loads.get(layer)
        self._loads[layer] = totals if previous is None else previous + totals
        return self._loads[layer]


class _AttachLoss(torch.autograd.Function):
    """Identity on `out`; its backward also feeds `scale` as the gradient of the scalar `loss`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def attach_loss(out: torch.Tensor, loss: torch.Tensor, *, scale: float) -> torch.Tensor:
    """`out` unchanged, with `loss` (a scalar computed from this forward alone) differentiated in its backward,
    its gradient `scale`."""
    return _AttachLoss.apply(out, loss, scale)


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
    def forward(ctx, out: torch.Tensor, scores: torch.Tensor, holder: ScoreGradient, scale: float) -> torch.Tensor:
        ctx.scale, ctx.holder, ctx.rows = scale, holder, scores.shape[0]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        per_expert = ctx.holder.per_expert * ctx.scale
        return grad, per_expert.to(torch.float32).expand(ctx.rows, -1), None, None


def attach_score_gradient(out: torch.Tensor, scores: torch.Tensor, holder: ScoreGradient, *,
                          scale: float) -> torch.Tensor:
    """`out` unchanged; its backward sends `holder`'s gradient, times `scale`, to the router scores [T, E]."""
    return _AttachScoreGradient.apply(out, scores, holder, scale)
