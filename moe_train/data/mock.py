"""The `mock` source: seeded synthetic tokens for throughput runs, with no files and no set-up cost.

Each sample is drawn from a generator seeded by (seed, stream, index), so it depends on nothing else, like the
real sources. Tokens are uniform over the vocabulary minus EOD; EOD ends a document with probability
1 / MEAN_DOCUMENT per position, so `data.reset_at_eod` has document boundaries to work on.
"""

from __future__ import annotations

import numpy as np

from moe_train.data.gpt import seeded_rng

MEAN_DOCUMENT = 512


class MockSamples:
    def __init__(self, *, seq_length: int, vocab_size: int, eod: int, seed: int, stream: int, length: int) -> None:
        self._seq_length, self._vocab_size, self._eod = seq_length, vocab_size, eod
        self._entropy = (seed, stream)
        self._length = length

    def __len__(self) -> int:
        return self._length

    def sample(self, index: int) -> np.ndarray:
        rng = seeded_rng(*self._entropy, int(index))
        tokens = rng.integers(0, self._vocab_size - 1, self._seq_length + 1, dtype=np.int64)
        tokens[tokens >= self._eod] += 1  # skip over the EOD id
        tokens[rng.random(self._seq_length + 1) < 1 / MEAN_DOCUMENT] = self._eod
        return tokens
