"""A multi-token-prediction module's own parts (models/mtp.py): enorm and hnorm over [embedding; hidden], the
eh_proj (2h -> h) that joins them and its final norm, all whole on every tp rank. Its decoder block is one more
of the model's last kind, and it shares the embedding and the head."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .parts import Module, Param, linear

NAME = "mtp"


def declare(cfg: ModelConfig) -> Module:
    h = cfg.hidden_size
    eh_params, eh = linear("eh_proj", h, 2 * h, "sequence", region=NAME)
    params = (Param("enorm.weight", (h,), "sequence"), Param("hnorm.weight", (h,), "sequence"), *eh_params,
              Param("norm.weight", (h,), "sequence"))
    return Module(NAME, params, (eh,))
