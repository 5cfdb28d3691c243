"""Run a worker script on N real gloo ranks (one process each) and collect what rank 0 wrote.

Each rank is its own process in its own session; the ranks rendezvous through a file store (no free-port
race). A job that outlives `timeout` (a hang: gloo aborts or waits forever on mismatched collectives) has every
process group killed, so no orphaned rank survives the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def run_ranks(worker: str, world: int, spec: dict, tmp_path: Path, *, timeout: float) -> dict:
    """Start `tests/workers/{worker}.py` on `world` ranks with `spec` (JSON); returns rank 0's JSON result."""
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "MOE_TRAIN_TEST_STORE": str(tmp_path / "store")}
    env.pop("SLURM_JOB_NUM_NODES", None)
    env.pop("SLURM_NNODES", None)
    procs = []
    for rank in range(world):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKERS / f"{worker}.py"), str(spec_path), str(result_path)],
            env=rank_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        ))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{worker} on {world} ranks hung (timeout {timeout:.0f} s); every rank killed")
    codes = [proc.returncode for proc in procs]
    if codes != [0] * world:
        tail = "\n".join(f"--- rank {r} (exit {c}) ---\n{o[-3000:]}"
                         for r, (c, o) in enumerate(zip(codes, outputs, strict=True)))
        pytest.fail(f"{worker} failed:\n{tail}")
    return json.loads(result_path.read_text())
