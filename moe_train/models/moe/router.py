"""The router: scores every token against every expert and picks its top-k experts with their weights.

All router math runs in fp32 whatever the model's dtype: the scores decide discrete choices, and bf16 rounding
would flip near-ties between experts from one step (or one layout) to the next. The order of operations follows
transformers' Qwen3MoeTopKRouter (softmax) and DeepseekV3TopkRouter (sigmoid, expert bias, groups), which the
model tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_train.config.routing_shapes import ForcedRouting
from moe_train.config.schema import MoEConfig
from moe_train.models.linear import linear, linear_input_grad, linear_weight_grad


@dataclass
class Routing:
    """One forward's routing decision for T tokens."""

    logits: torch.Tensor  # [T, E] fp32, with grad (z-loss)
    scores: torch.Tensor  # [T, E] fp32 softmax probabilities or sigmoid scores, with grad (aux losses)
    topk_indices: torch.Tensor  # [T, K] int64 chosen experts (global ids: counts, losses, the bias)
    topk_weights: torch.Tensor  # [T, K] fp32 weights applied to the experts' outputs, with grad
    topk_slots: torch.Tensor  # [T, K] int64 the slots holding them (what the dispatcher routes by; see placement)


class Router(nn.Module):
    """Linear scoring (with a trained logit bias: gpt-oss), optional aux-loss-free expert bias, optional
    group-limited top-k.

    `expert_bias` only changes which experts are chosen, never the weights, and never receives a gradient: the
    trainer moves it with `update_expert_bias` after each optimizer step.

    `even_routing` (per router, off in training) replaces the top-k choice by `forced` (config/routing_shapes.py
    `ForcedRouting`): every expert its even share, and over `even_domains` blocks of experts (the hierarchical
    dispatcher's nodes) each token spread over as many as the model's router spreads it in expectation; one
    domain, token t to experts (t*K + j) mod E. `moe-train measure` sets it on the model it measures
    (`Transformer.set_even_routing`): fake tensors carry no values to route on, and a forced spread makes the
    expert loads and dispatch volumes defined. The weights are still the scores of the chosen experts, so the
    forward and backward run the same operations.

    Placement (`set_placement`, models/moe/placement.py): the expert-parallel slot holding each expert. The
    router chooses by global expert id (its weight rows, the bias, the balancing losses and the telemetry are by
    global id) and maps its choices to slots on the way out (`topk_slots`), which is all the dispatchers and the
    grouped experts ever see. Contiguous (no table): slots are the ids. Under even routing the slots are spread
    evenly instead (the host-known counts a dispatcher sizes by are per slot) and the ids mapped back from them.

    `logit_bias` (model.moe.router.logit_bias, a test and benchmark knob) is added to the logits: real routing,
    skewed towards the experts it favours.
    """

    def __init__(self, *, hidden_size: int, cfg: MoEConfig):
        super().__init__()
        routing = cfg.router
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.score_function = routing.score_function
        self.normalize_topk = routing.normalize_topk
        # Group limiting is active only when it can exclude something: several groups, not all of them kept.
        groups, group_top_k = routing.num_groups or 1, routing.group_top_k or routing.num_groups or 1
        _check_routing(cfg, groups, group_top_k)
        self.num_groups = groups if group_top_k < groups else None
        self.group_top_k = group_top_k
        self.scaling_factor = routing.topk_scaling_factor
        self.even_routing = False
        self.forced = ForcedRouting.of(cfg)
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        # gpt-oss: a trained logit bias (transformers' router.bias). Its softmax over the top-k logits is this
        # router's softmax scores renormalised over the top k (normalize_topk), the same numbers.
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if routing.learned_bias else None
        if routing.expert_bias:
            # fp32 whatever the model dtype: updates of 1e-3 would vanish in bf16 next to scores near 1.
            self.register_buffer("expert_bias", torch.empty(cfg.num_experts, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias = None
        self.logit_bias = routing.logit_bias
        self.placement: tuple[int, ...] | None = None  # the slot of each expert; None: contiguous

    def set_placement(self, slot_of_expert: list[int] | None) -> None:
        """Route to these slots (None: contiguous). The tables are non-persistent buffers, so they follow the
        module's device; `reset_placement` refills them after a materialisation zeroes every buffer."""
        self.placement = None if slot_of_expert is None else tuple(slot_of_expert)
        for name in ("slot_of_expert", "expert_of_slot"):
            self._buffers.pop(name, None)
        if self.placement is not None:
            device = self.weight.device
            self.register_buffer("slot_of_expert", torch.empty(self.num_experts, dtype=torch.int64, device=device),
                                 persistent=False)
            self.register_buffer("expert_of_slot", torch.empty(self.num_experts, dtype=torch.int64, device=device),
                                 persistent=False)
            if device.type != "meta":
                self.reset_placement()

    @torch.no_grad()
    def reset_placement(self) -> None:
        if self.placement is None:
            return
        slots = torch.tensor(self.placement, dtype=torch.int64)
        self.slot_of_expert.copy_(slots)
        self.expert_of_slot.copy_(torch.argsort(slots))

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, H] -> Routing."""
        logits = _Fp32Logits.apply(x, self.weight)
        if self.bias is not None:
            logits = logits + self.bias.float()
        if self.logit_bias is not None:
            logits = logits + torch.tensor(self.logit_bias, dtype=logits.dtype, device=logits.device)
        scores = logits.softmax(dim=-1) if self.score_function == "softmax" else logits.sigmoid()
        with torch.no_grad():
            if self.even_routing:
                forced = forced_topk_indices(x.shape[0], self.forced, device=x.device)
                topk_slots = forced
                topk_indices = forced if self.placement is None else self.expert_of_slot[forced]
            else:
                choice = scores if self.expert_bias is None else scores + self.expert_bias
                if self.num_groups is not None:
                    choice = self._mask_groups(choice)
                topk_indices = torch.topk(choice, self.top_k, dim=-1).indices
                topk_slots = topk_indices if self.placement is None else self.slot_of_expert[topk_indices]
        weights = scores.gather(1, topk_indices)
        if self.normalize_topk:
            # The 1e-20 guards all-zero sigmoid scores (as transformers' DeepSeek-V3); it cannot change a sum >= 1e-12.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling_factor
        return Routing(logits=logits, scores=scores, topk_indices=topk_indices, topk_weights=weights,
                       topk_slots=topk_slots)

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the group_top_k groups whose two best (biased) scores sum highest; others become -inf.

        DeepSeek-V3 limits each token to a few expert groups (nodes, in its deployment) to bound communication.
        """
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.num_groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        group_idx = torch.topk(group_scores, self.group_top_k, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(tokens, -1)


class _Fp32Logits(torch.autograd.Function):
    """x [T, H] @ weight [E, H]^T in fp32 whatever their dtypes, keeping x and the weight for backward as they
    are and widening them again there: autograd would keep the fp32 copies (4 T H bytes, and 4 E H of a bf16
    weight). Widening bf16 to fp32 is exact, so the backward's operands are the same numbers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = linear_input_grad(grad, weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = linear_weight_grad(grad, x.float()).to(weight.dtype)
        return grad_x, grad_weight


def even_topk_indices(tokens: int, top_k: int, num_experts: int, *, device: torch.device) -> torch.Tensor:
    """[T, K] int64: token t's experts are (t*K + j) mod E, distinct for K <= E; every expert gets T*K/E slots
    (+-1) without reading any tensor value."""
    slots = torch.arange(tokens, device=device).unsqueeze(1) * top_k + torch.arange(top_k, device=device)
    return slots % num_experts


def forced_topk_indices(tokens: int, forced: ForcedRouting, *, device: torch.device) -> torch.Tensor:
    """[T, K] int64 `forced.indices(tokens)`: a host-built constant copied to the device (no value is read
    back); one domain, the arange form."""
    if forced.domains == 1:
        return even_topk_indices(tokens, forced.top_k, forced.num_experts, device=device)
    return torch.tensor(forced.indices(tokens), dtype=torch.int64, device=device).view(tokens, forced.top_k)


def even_counts(tokens: int, top_k: int, num_experts: int) -> list[int]:
    """Slots per expert of `even_topk_indices(tokens, top_k, num_experts)`, computed on the host: slot s
    (token s // K) goes to expert s mod E. What a dispatcher needs for its split sizes without a device read."""
    slots = tokens * top_k
    return [slots // num_experts + (expert < slots % num_experts) for expert in range(num_experts)]


def count_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 count of each expert id in `indices` (a scatter-add: unlike bincount, no device-host sync)."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=indices.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def _check_routing(cfg: MoEConfig, num_groups: int, group_top_k: int) -> None:
    """Refuse routing settings that would silently pick -inf experts (the recipe rules report them earlier)."""
    experts, k = cfg.num_experts, cfg.top_k
    if k > experts:
        raise ValueError(f"model.moe.top_k ({k}) exceeds model.moe.num_experts ({experts})")
    if experts % num_groups:
        raise ValueError(f"model.moe.num_experts ({experts}) is not divisible by router.num_groups ({num_groups})")
    if group_top_k > num_groups:
        raise ValueError(f"model.moe.router.group_top_k ({group_top_k}) exceeds router.num_groups ({num_groups})")
    if k > group_top_k * (experts // num_groups):
        raise ValueError(
            f"model.moe.top_k ({k}) exceeds the experts of router.group_top_k groups "
            f"({group_top_k} x {experts // num_groups})"
        )
