"""From a recipe's `data` section to the train and validation sample sources the trainer reads.

Everything that can be wrong with the data (missing or corrupt files, token ids beyond model.vocab_size, too few
documents or tokens, mismatched weights) is found here, before the first step, and raised as one DataError.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moe_train.config.data_files import DataError
from moe_train.data.blend import BlendedSamples
from moe_train.data.builtin import builtin_prefix
from moe_train.data.gpt import GPTSamples, seeded_rng
from moe_train.data.indexed import IndexedDataset
from moe_train.data.mock import MockSamples
from moe_train.data.sources import SampleSource
from moe_train.data.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from moe_train.config.schema import Recipe

# The train/valid split depends on the dataset only, not on train.seed: runs with different seeds are evaluated
# on the same held-out documents.
_SPLIT_SEED = 0x5EED
_TRAIN, _VALID = 0, 1


@dataclass(frozen=True)
class Datasets:
    train: SampleSource
    valid: SampleSource | None  # None when data.valid_fraction == 0
    eod: int
    description: str  # one line for the run's log, e.g. "builtin: 734 documents, 12.1M tokens"


@functools.lru_cache(maxsize=4)
def _tokenizer(spec: str) -> Tokenizer:
    return load_tokenizer(spec)


def eod_id(recipe: Recipe) -> int:
    """The end-of-document id of the recipe's tokenizer (256 for `byte`)."""
    return _tokenizer(recipe.data.tokenizer).eod


def build_datasets(recipe: Recipe, *, cache_dir: str | None = None) -> Datasets:
    """The recipe's train and validation sources; cache_dir holds the builtin corpus (default: cache_root())."""
    data, seq_length, seed = recipe.data, recipe.train.seq_length, recipe.train.seed
    vocab_size = recipe.model.vocab_size
    eod = eod_id(recipe)
    if eod >= vocab_size:
        raise DataError(f"data.tokenizer: its EOD id {eod} is beyond model.vocab_size {vocab_size}")

    if data.source == "mock":
        length = recipe.train.steps * recipe.train.global_batch_size
        mock = functools.partial(MockSamples, seq_length=seq_length, vocab_size=vocab_size, eod=eod, seed=seed)
        valid = mock(stream=_VALID, length=recipe.train.eval_steps * recipe.train.global_batch_size)
        return Datasets(
            train=mock(stream=_TRAIN, length=length),
            valid=valid if data.valid_fraction > 0 else None,
            eod=eod,
            description=f"mock: seeded uniform tokens over a vocabulary of {vocab_size}",
        )

    if data.source == "builtin":
        if data.tokenizer != "byte":
            raise DataError("data.tokenizer: the builtin corpus is byte-tokenized; set data.tokenizer: byte")
        prefixes, weights = [builtin_prefix(cache_dir)], None
    else:
        if not data.paths:
            raise DataError("data.paths: the indexed source needs at least one .bin/.idx prefix")
        prefixes = [_strip_extension(p) for p in data.paths]
        weights = data.weights
        if weights is not None and len(weights) != len(prefixes):
            raise DataError(f"data.weights: {len(weights)} weights for {len(prefixes)} data.paths")
        if weights is not None and any(w <= 0 for w in weights):
            raise DataError("data.weights: every weight must be positive")

    train_parts, valid_parts, documents, tokens = [], [], 0, 0
    for i, prefix in enumerate(prefixes):
        dataset = IndexedDataset(prefix)
        dataset.check_token_range(vocab_size)
        train_docs, valid_docs = _split(dataset, data.valid_fraction)
        common = {"seq_length": seq_length, "seed": seed}
        train_parts.append(GPTSamples(dataset, train_docs, stream=(i, _TRAIN), **common))
        if valid_docs is not None:
            valid_parts.append(GPTSamples(dataset, valid_docs, stream=(i, _VALID), **common))
        documents += dataset.num_documents
        tokens += dataset.num_tokens
    name = "builtin" if data.source == "builtin" else ", ".join(prefixes)
    return Datasets(
        train=_combine(train_parts, weights),
        valid=_combine(valid_parts, weights) if valid_parts else None,
        eod=eod,
        description=f"{name}: {documents} documents, {tokens / 1e6:.1f}M tokens",
    )


def _strip_extension(path: str) -> str:
    """Accept `data/x`, `data/x.bin` and `data/x.idx` alike for the prefix `data/x`."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def _split(dataset: IndexedDataset, valid_fraction: float) -> tuple[np.ndarray, np.ndarray | None]:
    """Disjoint (train, valid) document indices: a seeded random valid_fraction of the documents held out."""
    count = dataset.num_documents
    if valid_fraction == 0:
        return np.arange(count), None
    held_out = max(1, round(valid_fraction * count))
    if held_out >= count:
        raise DataError(
            f"{dataset.prefix}: {count} documents are too few to hold out data.valid_fraction {valid_fraction}"
        )
    order = seeded_rng(_SPLIT_SEED).permutation(count)
    return np.sort(order[held_out:]), np.sort(order[:held_out])


def _combine(parts: list[GPTSamples], weights: tuple[float, ...] | None) -> SampleSource:
    """One source as is; several blended by weight (no weights: in proportion to their sizes)."""
    if len(parts) == 1:
        return parts[0]
    return BlendedSamples(parts, weights if weights is not None else [len(p) for p in parts])
