"""What the trainer's loop gathers over a run for its Summary: timed throughput, the first and last applied
losses, and the last checkpoint it wrote.

Throughput leaves out the first step a process runs (it warms caches and allocators) unless it is the only one,
so a resumed run's tokens/s is its steady state too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True)
class RunTally:
    first_step: int  # the step the process started from (0 fresh, K resumed)
    last: int  # the step the run stops at, if nothing stops it earlier
    tokens_per_step: int
    saved_step: int | None = None  # the step of the last checkpoint this run holds
    checkpoint: Path | None = None  # the last checkpoint this process wrote
    first_loss: float | None = None
    final_loss: float | None = None
    timed_tokens: int = 0
    timed_seconds: float = 0.0

    def timed(self, step: int, seconds: float) -> None:
        """Count a step's time towards throughput, unless it is this process's first of several."""
        if step > self.first_step + 1 or step == self.last:
            self.timed_tokens += self.tokens_per_step
            self.timed_seconds += seconds

    def applied(self, loss: float) -> None:
        """An applied step's loss (skipped steps do not count)."""
        self.final_loss = loss
        self.first_loss = loss if self.first_loss is None else self.first_loss

    def saved(self, step: int, path: Path) -> None:
        self.saved_step, self.checkpoint = step, path

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds else 0.0
