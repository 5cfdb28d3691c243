"""The model's ends (models/model.py): the embedding, the final norm and the output head with its loss
(models/loss.py), vocabulary-parallel over tp; tied, the head is the embedding's weight."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .parts import Gemm, Module, Param

HEAD = "head"  # the head's train.fp8.modules kind and FLOPs region


def _vocab(cfg: ModelConfig, padded: bool) -> int:
    """`padded`: as allocated (make_vocab_size_divisible_by, never by tp); otherwise the published size."""
    return cfg.padded_vocab_size() if padded else cfg.vocab_size


def embedding(cfg: ModelConfig, *, padded: bool = True) -> Module:
    """A lookup (a gather, no GEMM) over vocabulary rows cut by tp."""
    return Module("embedding", (Param("embed_tokens.weight", (_vocab(cfg, padded), cfg.hidden_size), "column"),))


def final_norm(cfg: ModelConfig) -> Module:
    return Module("norm", (Param("norm.weight", (cfg.hidden_size,), "sequence"),))


def head(cfg: ModelConfig, *, padded: bool = True, tied: bool = False) -> Module:
    """The head's GEMM over the vocabulary (model FLOPs count the published vocabulary: `padded` False); its own
    weight unless `tied` (then the embedding's, which stays bf16 in FSDP2's gather: no fp8 kind)."""
    vocab, h = _vocab(cfg, padded), cfg.hidden_size
    params = () if tied else (Param("lm_head.weight", (vocab, h), "column", "" if cfg.tie_embeddings else HEAD),)
    return Module(HEAD, params, (Gemm("lm_head", vocab, h, HEAD),))
