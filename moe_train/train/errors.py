"""The trainer's runtime failure: exit code 1, naming the rank and the reason.

Bad input (an invalid recipe, missing data, a checkpoint that cannot be resumed) is reported by the modules
that detect it (RecipeError, DataError, CheckpointError) and exits 2 instead: see `moe_train.train.input_errors`.
"""

from __future__ import annotations


class TrainingError(Exception):
    """Training could not go on (non-finite losses past the limit, a failing collective...)."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank}: {reason}")
        self.rank = rank
        self.reason = reason
