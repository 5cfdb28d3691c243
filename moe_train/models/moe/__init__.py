"""Mixture-of-Experts: router, token dispatcher, grouped experts, shared experts, balancing losses and updates."""

from moe_train.models.moe.aux_loss import global_aux_loss, seq_aux_loss, z_loss
from moe_train.models.moe.expert_bias import update_expert_bias
from moe_train.models.moe.layer import MoELayer, RoutingRecord

__all__ = [
    "MoELayer",
    "RoutingRecord",
    "global_aux_loss",
    "seq_aux_loss",
    "update_expert_bias",
    "z_loss",
]
