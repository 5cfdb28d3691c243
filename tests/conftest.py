"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_process_group():
    """This process's default process group slot, free: measure (real at world size 1, or --fake with its own
    fake group) takes it, and an earlier in-process run may have left one (see test_measure)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
