"""Blending several sample sources by weight, as a function of the sample index alone.

A block of BLOCK consecutive samples is assigned to the sources greedily (each next sample goes to the source
furthest behind its share, as Megatron's blended dataset does), and that block repeats: sample i comes from
source choice[i % BLOCK] at its own index (i // BLOCK) * per_block[source] + rank[i % BLOCK]. Proportions are
exact to 1/BLOCK, neighbouring samples interleave the sources, and any index is found in O(1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moe_train.data.sources import SampleSource

BLOCK = 10_000


class BlendedSamples:
    def __init__(self, sources: Sequence[SampleSource], weights: Sequence[float]) -> None:
        shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        counts = np.zeros(len(sources), dtype=np.int64)
        self._choice = np.empty(BLOCK, dtype=np.int64)
        self._rank = np.empty(BLOCK, dtype=np.int64)
        for position in range(BLOCK):
            source = int(np.argmax(shares * (position + 1) - counts))
            self._choice[position], self._rank[position] = source, counts[source]
            counts[source] += 1
        self._per_block = counts
        self._sources = list(sources)

    def __len__(self) -> int:
        return sum(len(source) for source in self._sources)

    def sample(self, index: int) -> np.ndarray:
        block, position = divmod(int(index), BLOCK)
        source = self._choice[position]
        return self._sources[source].sample(block * int(self._per_block[source]) + int(self._rank[position]))
