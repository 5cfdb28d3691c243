"""The model's ends (models/model.py): the embedding, the final norm and the output head with its loss
(models/loss.py), vocabulary-parallel over tp; tied, the head is the embedding's weight."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .parts import Gemm, Module, Param
from .saves import FP32, Saved, gemm_input, norm_items

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


def final_norm_saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """The final norm's input and rstd (models/norm.py), on the sequence region."""
    return norm_items("head", "norm", lay.seq_tokens, cfg.hidden_size, lay.act_bytes)


def head_saved(cfg: ModelConfig, lay: ActivationLayout, *, vocab_parallel: bool) -> list[Saved]:
    """The head's input and the fp32 log-softmax of the loss over the (tp-sharded, `vocab_parallel`) padded
    vocabulary, with the boolean mask of its padding columns (the loss masks padding; the head is never sliced,
    models/model.py). Chunked (`lay.loss_chunk_tokens`): the head's input as the loss reads it (under sequence
    parallelism gathered, every token) and one fp32 log-sum-exp per token, no logits (models/linear.py
    `linear_cross_entropy_sum`, whose GEMMs are never fp8). An fp8 head (train.fp8.modules head) keeps its input
    as fp8 GEMMs do (`gemm_input`), but as a column-parallel GEMM under sequence parallelism (its bf16 shard)."""
    a, h = lay.act_bytes, cfg.hidden_size
    if lay.loss_chunk_tokens:
        return [Saved(HEAD, "head.input", a * lay.tokens * h), Saved(HEAD, "loss.logsumexp", FP32 * lay.tokens)]
    padded = cfg.padded_vocab_size()
    vocab = padded / lay.tp if vocab_parallel and lay.tp > 1 else padded
    fp8 = None if lay.gathers_shards else lay.kept_fp8(HEAD)
    items = gemm_input(HEAD, "head.input", lay.seq_tokens, h, a, fp8)
    items.append(Saved(HEAD, "loss.log_softmax", FP32 * lay.tokens * vocab))
    if padded > cfg.vocab_size:
        items.append(Saved(HEAD, "loss.padding_mask", vocab))
    return items
