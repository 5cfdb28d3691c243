"""The decoder-only Transformer of every family: embedding, blocks, final norm, output head, optional MTP.

forward(input_ids, position_ids=None) returns logits [b, s, vocab_size] (the Python API); given `labels` it
returns the training loss terms instead (`LossTerms`): the summed language-model cross-entropy and, in training
mode, the weighted MTP loss. Both are computed inside forward so that FSDP's unshard hooks cover the embedding
and head they use. Balancing losses never appear here: each MoE layer attaches its loss's gradient to its own
output and counts its telemetry in buffers (models/moe/layer.py); only transformers' all-layers loss is
completed here, once every layer has routed. The optimised loss is lm_sum / tokens + mtp, plus the attached
balancing losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from moe_train.config.pp_layout import StageContents
from moe_train.config.routing_shapes import ForcedRouting
from moe_train.config.schema import ModelConfig
from moe_train.models.attention import attention_mask
from moe_train.models.decoder import DecoderBlock
from moe_train.models.linear import Linear
from moe_train.models.loss import LanguageModelLoss
from moe_train.models.moe.aux_loss import StepBalancing, global_aux_loss
from moe_train.models.moe.dispatch_hierarchical import HierarchicalDispatcher
from moe_train.models.moe.layer import MoELayer, RoutingRecord, RoutingRecords
from moe_train.models.mtp import MTPModule, mtp_shifts
from moe_train.models.norm import RMSNorm
from moe_train.models.rope import RotaryEmbedding


class LossTerms(NamedTuple):
    """One forward's loss terms: `lm_sum` the fp32 cross-entropy summed over the labelled tokens, `mtp` the
    weighted MTP loss averaged over depths (0 without MTP or outside training mode)."""

    lm_sum: torch.Tensor
    mtp: torch.Tensor


class Transformer(nn.Module):
    """Every family's model. Its GEMMs run through models/linear.py. Extension points, the only things
    `moe_train.parallel.parallelize` replaces besides parameters (docs/interfaces.md, "Extension points"):
    `lm_loss` (the loss object: vocabulary-parallel under tp), `run_layers` (how the decoder stack runs:
    recomputed groups under full recomputation), each MoE layer's `dispatcher`, `token_group` and
    `balance_group`, `stage` (a pipeline stage's contents, which forward runs), and the layout points of its
    modules (a Linear's or CoreAttention's `parallel`, their regions: models/layout_region.py, parallel/layout.py);
    `balancing` is what the step sets (`start_step`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        padded_vocab = cfg.padded_vocab_size()
        self.embed_tokens = nn.Embedding(padded_vocab, cfg.hidden_size)
        self.rope = RotaryEmbedding(dim=cfg.rotary_dim, rope=cfg.rope)
        # What the balancing losses of all MoE layers share over a step: the step sets it (`start_step`).
        self.balancing = StepBalancing()
        # A dict keyed by layer index keeps parameter names stable when a pipeline stage drops other layers.
        self.layers = nn.ModuleDict(
            {str(i): DecoderBlock(cfg, layer_index=i, balancing=self.balancing) for i in range(cfg.num_layers)}
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = Linear(cfg.hidden_size, padded_vocab, bias=False)
        self.mtp = nn.ModuleDict(
            {str(k): MTPModule(cfg, layer_index=cfg.num_layers + k, balancing=self.balancing)
             for k in range(cfg.mtp_layers)}
        )
        # all_layers_aux_loss's weighted value, summed over the forwards of a step (telemetry, like the layers').
        self.register_buffer("aux_loss_value", torch.zeros((), dtype=torch.float64), persistent=False)
        # Set from outside by `moe_train.parallel.parallelize`: tensor parallelism swaps in a vocabulary-parallel
        # loss; full recomputation runs the decoder stack in checkpointed groups of layers.
        self.lm_loss = LanguageModelLoss(vocab_size=cfg.vocab_size)
        self.run_layers: Callable[..., torch.Tensor] = run_layers
        # What every attention reads besides q, k, v, from the positions: context parallelism swaps in the mask
        # of this rank's shard of the sequence (parallel/context_parallel.py).
        self.attention_mask_of: Callable[[torch.Tensor, bool], object] = local_attention_mask
        # Set by pipeline parallelism (parallel/pipeline.py): what this chunk of the model holds of the stage
        # layout; forward then runs that stage (None: the whole model).
        self.stage: StageContents | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the head (tie_embeddings); re-run after materialising, which unties. A
        pipeline stage may hold neither, or (the first) only the embedding."""
        if self.cfg.tie_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def set_even_routing(self, even: bool) -> None:
        """Route every token by the forced spread instead of its scores (`Router.even_routing`): `moe-train
        measure` on tensors without values. Under the hierarchical dispatcher the spread is over its nodes
        (as many per token as the model's router reaches in expectation), and the dispatcher sizes its
        network all-to-all from the same pattern."""
        for module in self.modules():
            if isinstance(module, MoELayer):
                dispatcher = module.dispatcher
                nodes = dispatcher.nodes if isinstance(dispatcher, HierarchicalDispatcher) else 1
                module.router.even_routing = even
                module.router.forced = ForcedRouting.of(module.cfg, nodes)
                if isinstance(dispatcher, HierarchicalDispatcher):
                    dispatcher.forced = module.router.forced if even else None

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        mtp_inputs: torch.Tensor | None = None,
        mtp_targets: torch.Tensor | None = None,
    ) -> torch.Tensor | LossTerms | tuple[torch.Tensor, torch.Tensor]:
        """x: token ids [b, s] -> logits [b, s, vocab_size], or LossTerms when labels [b, s] (-100: ignored) are
        given. position_ids [b, s] or [1, s]: default 0..s-1; attention restarts wherever they fall back to 0.
        mtp_inputs, mtp_targets [b, mtp_layers, s]: MTP's shifted tokens and targets when the caller shifted them
        on the whole sequence (context parallelism, `mtp_shifts`); None: shifted here.

        A pipeline stage (`stage` set): x is the previous stage's hidden states (the token ids on the first
        stage), the tokens come as `input_ids`; it returns its hidden states, or on the last stage the loss
        terms as a plain tuple (what the schedule takes)."""
        stage = self.stage
        input_ids = x if input_ids is None else input_ids
        documents = position_ids is not None  # the default positions have no restart: no mask, no read of them
        position_ids = default_positions(input_ids, position_ids)
        context = self.attention_context(position_ids, documents=documents)
        moe_cfg = self.cfg.moe
        # all_layers_aux_loss needs every layer's routing in one forward: refused under pipelining (rules.py)
        collects = stage is None and moe_cfg is not None and moe_cfg.router.load_balancing == "all_layers_aux_loss"
        records = RoutingRecords() if collects else None
        hidden = self.embed_tokens(x) if stage is None or stage.embedding else x
        hidden = self.run_layers(list(self.layers.values()), hidden, *context, records)
        if stage is not None and not stage.loss:
            return hidden
        shifted = None if mtp_inputs is None else (mtp_inputs, mtp_targets)
        out = self.head(hidden, input_ids, position_ids, labels, context, records, shifted)
        return out if stage is None else tuple(out)

    def attention_context(self, position_ids: torch.Tensor, *, documents: bool = True) -> tuple[torch.Tensor, ...]:
        """(cos, sin, mask): what every block's attention reads besides its input. `documents` False: the
        default positions, which have no restart (no mask, and no read of their values)."""
        cos, sin = self.rope(position_ids)
        return cos, sin, self.attention_mask_of(position_ids, documents)

    def head(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None,
        context: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        records: RoutingRecords | None,
        shifted: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | LossTerms:
        """The decoder stack's output to logits, or to the loss terms (MTP included) when labels are given.
        `shifted`: MTP's (inputs, targets) [b, depth, s] shifted by the caller (None: here, `mtp_shifts`)."""
        hidden = self.norm(hidden)
        mtp = torch.zeros((), device=hidden.device)
        if labels is not None and self.training and len(self.mtp) > 0:
            if shifted is None:
                shifted = mtp_shifts(input_ids, labels, position_ids, depth=len(self.mtp))
            mtp = self._forward_mtp(hidden, *shifted, *context, records)
        if records is not None and records.items:
            self._all_layers_aux_loss(records.items)
        if labels is None:
            return self.lm_loss.full_logits(self.lm_head(hidden))
        return LossTerms(self.lm_loss.head_sum(self.lm_head, hidden, labels), mtp)

    def _forward_mtp(
        self,
        hidden: torch.Tensor,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: object,
        records: RoutingRecords | None,
    ) -> torch.Tensor:
        """mtp_loss_weight * mean over depths of each depth's mean cross-entropy on tokens one more ahead;
        inputs and targets [b, depth, s] from `mtp_shifts`."""
        losses = []
        for depth, module in enumerate(self.mtp.values()):
            hidden = module(hidden, self.embed_tokens(inputs[:, depth]), cos, sin, mask, records)
            losses.append(self.lm_loss.head_mean(self.lm_head, hidden, targets[:, depth]))
        return self.cfg.mtp_loss_weight * torch.stack(losses).mean()

    @torch.no_grad()
    def _all_layers_aux_loss(self, records: list[RoutingRecord]) -> None:
        """transformers' Qwen3-MoE load-balancing loss over every layer's rows together, E * sum_e f_e * P_e:
        each layer's router gets d(loss)/d(scores) = coeff * E * f_e / N through its record's holder."""
        router, experts = self.cfg.moe.router, self.cfg.moe.num_experts
        scores = torch.cat([record.scores for record in records])
        counts = torch.stack([record.tokens_per_expert for record in records]).sum(0)
        rows = scores.shape[0]
        for record in records:
            record.gradient.per_expert = router.aux_loss_coeff * experts * counts.float() / rows / rows
        self.aux_loss_value += router.aux_loss_coeff * global_aux_loss(scores, counts, rows).double()


def default_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """position_ids, or 0..s-1 [1, s] when there are none."""
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)


def local_attention_mask(position_ids: torch.Tensor, documents: bool) -> torch.Tensor | None:
    """The mask of a whole sequence (the default `attention_mask_of`): the document mask when positions were
    given, None (plain causal) for the default ones."""
    return attention_mask(position_ids) if documents else None


def run_layers(layers: list[DecoderBlock], hidden: torch.Tensor, *args) -> torch.Tensor:
    """The decoder stack, layer after layer (args: cos, sin, mask, records)."""
    for layer in layers:
        hidden = layer(hidden, *args)
    return hidden
