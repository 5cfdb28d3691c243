"""Stop requests, agreed on by every rank at a step boundary: a signal to any rank, or the preemption notice.

Two sources (docs/interfaces.md, exit codes): SIGINT/SIGTERM delivered to a rank's process (to one rank alone, or to
all by a launcher), and `{run_dir}/PREEMPT`, which the SLURM batch script writes when SLURM announces the end of
the allocation (torchrun forwards no USR1 to the ranks). One rank reads the notice file, the logging rank (a
shared file system shows every rank the same file; a stat per step on every rank of a large job is load on the
metadata server for nothing), and one all-reduce of two flags per step tells every rank what any rank saw, so all
stop at the same step boundary, checkpoint together and exit 0.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import torch
import torch.distributed as dist

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """`with stops:` installs the signal handlers (restoring the previous ones after); `agreed()` at each step
    boundary, on every rank together, returns why to stop, or None."""

    def __init__(self, *, notice: Path, reads_notice: bool, device: torch.device) -> None:
        self.notice = notice
        self.reads_notice = reads_notice
        self.device = device
        self.signal: str | None = None
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum: int, frame) -> None:
        self.signal = signal.Signals(signum).name

    def __enter__(self) -> StopRequests:
        for sig in _SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: the notice file still works
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self) -> str | None:
        """Why every rank stops now (the same decision on all ranks; the reason as this rank knows it)."""
        noticed = self.reads_notice and self.notice.exists()
        flags = torch.tensor([self.signal is not None, noticed], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank of the job, whatever its place in the meshes
        by_signal, by_notice = flags.tolist()
        if self.signal is not None:
            return self.signal
        if noticed:
            return f"preemption notice {self.notice}"
        if by_signal:
            return "a stop requested on another rank"
        if by_notice:
            return "the preemption notice (read by another rank)"
        return None
