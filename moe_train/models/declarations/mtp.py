"""A multi-token-prediction module's own parts (models/mtp.py): enorm and hnorm over [embedding; hidden], the
eh_proj (2h -> h) that joins them and its final norm, all whole on every tp rank. Its decoder block is one more
of the model's last kind, and it shares the embedding and the head."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .parts import Module, Param, linear
from .saves import Saved, norm_items

NAME = "mtp"


def declare(cfg: ModelConfig) -> Module:
    h = cfg.hidden_size
    eh_params, eh = linear("eh_proj", h, 2 * h, "sequence", region=NAME)
    params = (Param("enorm.weight", (h,), "sequence"), Param("hnorm.weight", (h,), "sequence"), *eh_params,
              Param("norm.weight", (h,), "sequence"))
    return Module(NAME, params, (eh,))


def saved(cfg: ModelConfig, lay: ActivationLayout, *, block: list[Saved]) -> list[Saved]:
    """One MTP module's saves around its decoder `block`'s (its head and loss aside): the embedding's norm, the
    hidden state's norm (whose input, the main model's final norm output, the head keeps too: counted there),
    the 2h -> h projection's input, and after the block its final norm."""
    a, ts, h = lay.act_bytes, lay.seq_tokens, cfg.hidden_size
    hnorm = norm_items(NAME, "hnorm", ts, h, a)[1:]  # its input is the head's
    items = [*norm_items(NAME, "enorm", ts, h, a), *hnorm, Saved(NAME, "eh_proj.input", a * ts * 2 * h)]
    return [*items, *block, *norm_items(NAME, "norm", ts, h, a)]
