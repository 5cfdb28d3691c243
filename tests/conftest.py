"""Fixtures shared by the test files."""

from __future__ import annotations

import os

import pytest

# One intra-op thread in the test process and the processes it starts, as each rank takes (parallel/bootstrap.py),
# set before any test module imports torch: the suite runs on 2 cores shared with other jobs, where torch's
# default of a thread per core oversubscribes them; the fast tier took 3x the CPU time and up to 6x the wall time
# that way under load (docs/testing.md, issue 31). A caller's own OMP_NUM_THREADS is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def no_process_group():
    """This process's default process group slot, free: measure (real at world size 1, or --fake with its own
    fake group) takes it, and an earlier in-process run may have left one (see test_measure)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
