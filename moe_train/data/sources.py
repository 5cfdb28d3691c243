"""What the trainer reads samples from: anything with a length (samples per epoch) and sample(index)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class SampleSource(Protocol):
    def __len__(self) -> int: ...

    def sample(self, index: int) -> np.ndarray:
        """Tokens [seq_length + 1] as int64; any index >= 0 is valid (past len: the next epoch)."""
        ...
