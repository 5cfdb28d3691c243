"""A long run on a real one-node SLURM cluster (tests/slurm_cluster.py; skipped with the reason where it cannot
start), with the real trainer on 2 gloo ranks:
- preempted: the batch shell gets the notice (`scancel --signal=USR1 --batch`, what SLURM does `--signal` seconds
  before the time limit), the ranks save and exit 0, the job requeues itself and resumes from that checkpoint
  (`--restart`: resume required), finishes, and its loss sequence equals an uninterrupted run's; a finished run
  is neither requeued nor started again;
- crashed: a rank SIGKILLed mid-step fails the job within 60 s, the dead rank named in the log, no requeue.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

from moe_train.config import load_recipe
from moe_train.train.loop import Trainer

pytestmark = pytest.mark.timeout(240)

STEPS = 10
SHRINK = ["model.num_layers=2", "train.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=2",
          "train.warmup_steps=1", "train.precision=fp32", "train.eval_interval=null", "checkpoint.interval=null",
          "logging.interval=1", f"train.steps={STEPS}"]


def submit(cluster, tmp_path: Path, recipe: str, run_dir: Path, *extra: str) -> str:
    sets = [*SHRINK, "launch.gpus_per_node=2", f"run_dir={run_dir}", *extra]
    result = subprocess.run([sys.executable, "-m", "moe_train.cli.main", "submit", recipe,
                             *(arg for value in sets for arg in ("--set", value))],
                            env=cluster.env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return re.search(r"submitted job (\d+)", result.stdout).group(1)


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]


def wait_for_steps(cluster, job_id: str, run_dir: Path, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(train_losses(run_dir)) < count:
        state = cluster.job_state(job_id)
        log = run_dir / "logs" / f"slurm-{job_id}.out"
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} {state}: " + (
            log.read_text() if log.exists() else "")
        assert time.monotonic() < deadline, f"job {job_id}: {count} steps not logged within {timeout}s"
        time.sleep(0.2)


def rank_process(run_dir: Path, rank: int) -> int | None:
    """The pid of the training process of `rank` of the job training `run_dir` (slurmd's descendants, not ours)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            items = environ.read_bytes().split(b"\0")
            if (f"MOE_TRAIN_RUN_DIR={run_dir}".encode() in items and f"RANK={rank}".encode() in items
                    and f"LOCAL_RANK={rank}".encode() in items):
                return int(environ.parent.name)
    return None


def test_a_preempted_ep2_job_saves_requeues_resumes_and_matches_an_uninterrupted_run(slurm_cluster, tmp_path):  # noqa: F811
    run_dir = tmp_path / "ep2"
    job_id = submit(slurm_cluster, tmp_path, "qwen3-moe-tiny", run_dir, "parallel.ep=2",
                    "launch.slurm.signal_seconds=60", "launch.slurm.max_restarts=2")
    log = run_dir / "logs" / f"slurm-{job_id}.out"
    wait_for_steps(slurm_cluster, job_id, run_dir, 2)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    assert slurm_cluster.wait_done(job_id, timeout=180) == "COMPLETED", log.read_text()
    text = log.read_text()
    stopped = int(re.search(r"stopping at step (\d+): preemption notice", text).group(1))
    assert 2 <= stopped < STEPS, text
    checkpoint = run_dir / "checkpoints" / f"step-{stopped:07d}"
    for fragment in (f"checkpoint saved: {checkpoint}", f"preempted at step {stopped}/{STEPS}",
                     "step exited with status 0", f"requeueing job {job_id} (restart 1 of 2)",
                     f"job {job_id} (restart 1)", f"started from {checkpoint} at step {stopped}",
                     f"complete at step {STEPS}/{STEPS}"):
        assert fragment in text, fragment + "\n" + text
    assert text.count("requeueing") == 1 and slurm_cluster.job_field(job_id, "Restarts") == "1"
    assert (run_dir / "COMPLETE").exists() and not (run_dir / "PREEMPT").exists()

    # One history, step by step the uninterrupted run's (the single process; EP2 equals it within 1e-5).
    logged = train_losses(run_dir)
    assert [step for step, _ in logged] == list(range(1, STEPS + 1))
    reference_dir = tmp_path / "reference"
    Trainer(load_recipe("qwen3-moe-tiny", [*SHRINK, f"run_dir={reference_dir}"])).train()
    assert [loss for _, loss in logged] == pytest.approx([loss for _, loss in train_losses(reference_dir)], rel=1e-5)

    # Finished: a resubmission of its script starts nothing and is not requeued.
    again = slurm_cluster.run("sbatch", "--parsable", str(run_dir / "job.sbatch"), cwd=tmp_path).stdout.strip()
    assert slurm_cluster.wait_done(again, timeout=60) == "COMPLETED"
    second = (run_dir / "logs" / f"slurm-{again}.out").read_text()
    assert "not started: the run is complete" in second and "step exited" not in second
    assert slurm_cluster.job_field(again, "Restarts") == "0"
    assert train_losses(run_dir) == logged


def test_a_rank_killed_mid_step_fails_the_job_within_60_s_naming_it_and_it_is_not_requeued(slurm_cluster,  # noqa: F811
                                                                                           tmp_path):
    run_dir = tmp_path / "crash"
    job_id = submit(slurm_cluster, tmp_path, "qwen3-tiny", run_dir, "train.steps=1000")
    wait_for_steps(slurm_cluster, job_id, run_dir, 2)
    target = rank_process(run_dir, 1)
    assert target is not None, "rank 1's process not found"
    os.kill(target, signal.SIGKILL)
    killed = time.time()
    assert slurm_cluster.wait_done(job_id, timeout=90) == "FAILED"
    ended = time.mktime(time.strptime(slurm_cluster.job_field(job_id, "EndTime"), "%Y-%m-%dT%H:%M:%S"))
    assert ended - killed < 60
    text = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", text[text.index("Root Cause"):]), text
    assert "requeueing" not in text and slurm_cluster.job_field(job_id, "Restarts") == "0"
    assert not (run_dir / "COMPLETE").exists()
