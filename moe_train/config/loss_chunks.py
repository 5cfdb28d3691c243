"""How many tokens the chunked head + cross-entropy takes at a time (`train.loss_chunk_tokens`), torch-free.

Unchunked, the loss keeps a micro-batch's fp32 log-probabilities over the (tp-sharded) padded vocabulary for
backward: tokens x vocabulary x 4 bytes, ~2.5 GB per 4,096 tokens of Qwen3's 151,936-word vocabulary, plus as
much again while it is computed. Chunked (models/linear.py `linear_cross_entropy_sum`), it keeps one fp32
log-sum-exp per token and holds one chunk's logits at a time, for one more head GEMM (the logits are recomputed
in backward). `null` chunks where that pays: where the unchunked logits of a micro-batch would take more than
`AUTO_MIN_LOGIT_BYTES`, in chunks of `AUTO_CHUNK_TOKENS`. The model (through parallelize) and the planner
both ask here, so they agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_train.config.schema import Recipe

AUTO_MIN_LOGIT_BYTES = 2**30  # 1 GiB of fp32 logits per micro-batch: below it the extra GEMM is not worth it
AUTO_CHUNK_TOKENS = 1024  # one chunk of Qwen3's logits: 0.6 GB fp32 (unsharded), a full-width GEMM still


def loss_chunk_tokens(setting: int | None, *, tokens: float, vocab: float) -> int:
    """Tokens per chunk (0: unchunked) for `setting` (train.loss_chunk_tokens), a rank's head rows per
    micro-batch (`tokens`: micro_batch x seq_length / cp) and its padded vocabulary columns (`vocab`: / tp)."""
    if setting is not None:
        return setting
    return AUTO_CHUNK_TOKENS if 4 * tokens * vocab > AUTO_MIN_LOGIT_BYTES else 0


def recipe_loss_chunk_tokens(recipe: Recipe) -> int:
    """The recipe's tokens per chunk on each rank (the same on every rank of a layout)."""
    p, t = recipe.parallel, recipe.train
    return loss_chunk_tokens(t.loss_chunk_tokens, tokens=t.micro_batch_size * t.seq_length / p.cp,
                             vocab=recipe.model.padded_vocab_size() / p.tp)
