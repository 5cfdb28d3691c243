"""GPT-style samples: windows of seq_length + 1 tokens over documents joined end to end, reshuffled each epoch.

Documents already end in EOD (as `data prepare` and Megatron's preprocessing with --append-eod write them), so
joining them end to end puts an EOD between neighbours. One epoch is a seeded permutation of the documents, cut
into (tokens - 1) // seq_length windows that overlap by one token (the last input's label), visited in a second
seeded permutation. Sample `index` is epoch index // len, window index % len: every sample is a function of the
seed and its index alone, which is what lets any parallel layout see the same data and resume from the step.
"""

from __future__ import annotations

import numpy as np

from moe_train.config.data_files import DataError
from moe_train.data.indexed import IndexedDataset


def seeded_rng(*entropy: int) -> np.random.Generator:
    """A generator determined by a tuple of integers (negative ones allowed: seeds come from recipes)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([e % 2**64 for e in entropy])))


class GPTSamples:
    """Samples over the documents `documents` (indices into `dataset`'s documents); `stream` salts the shuffle
    so that two sources with the same seed (train and valid, or blended datasets) shuffle independently."""

    _EPOCHS_CACHED = 2  # consecutive batches touch at most two epochs

    def __init__(
        self, dataset: IndexedDataset, documents: np.ndarray, *, seq_length: int, seed: int, stream: tuple[int, ...]
    ) -> None:
        starts = dataset.document_token_starts()
        documents = np.asarray(documents, dtype=np.int64)
        self._tokens = dataset.tokens
        self._starts = starts[documents]
        self._lengths = starts[documents + 1] - self._starts
        self._seq_length = seq_length
        self._entropy = (seed, *stream)
        total = int(self._lengths.sum())
        self._windows = max(0, (total - 1) // seq_length)
        if self._windows == 0:
            raise DataError(
                f"{dataset.prefix}: {len(documents)} documents, {total} tokens: fewer than "
                f"train.seq_length + 1 = {seq_length + 1}"
            )
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        """Samples per epoch."""
        return self._windows

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, cumulative token ends in that order, window order) of one epoch."""
        if epoch not in self._epochs:
            rng = seeded_rng(*self._entropy, epoch)
            order = rng.permutation(len(self._lengths))
            ends = np.cumsum(self._lengths[order])
            windows = rng.permutation(self._windows)
            if len(self._epochs) >= self._EPOCHS_CACHED:
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = (order, ends, windows)
        return self._epochs[epoch]

    def sample(self, index: int) -> np.ndarray:
        """Tokens [seq_length + 1] (int64) of sample `index`; indices past len() continue into later epochs."""
        epoch, position = divmod(int(index), self._windows)
        order, ends, windows = self._epoch(epoch)
        start = int(windows[position]) * self._seq_length
        slot = int(np.searchsorted(ends, start, side="right"))  # first document ending after `start`
        offset = start - int(ends[slot] - self._lengths[order[slot]])
        pieces, needed = [], self._seq_length + 1
        while needed:
            document = order[slot]
            begin = int(self._starts[document]) + offset
            take = min(needed, int(self._lengths[document]) - offset)
            pieces.append(self._tokens[begin : begin + take])
            needed -= take
            slot, offset = slot + 1, 0
        return np.concatenate(pieces).astype(np.int64)
