"""What the SLURM job tests share (test_slurm_resilience on one node, test_slurm_two_nodes across two): submitting
through the CLI, following a job's training steps, and the two scenarios both files run on their own layout:
a job preempted (the batch shell's notice), requeued and finished, and a rank SIGKILLed mid-step failing the job
fast, named, without a requeue. The scenarios assert what holds on any layout and return the log for the
layout's own checks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import read_metrics


def cli(cluster, cwd: Path, *args: str, sets: list[str]) -> subprocess.CompletedProcess:
    """`moe-train ARGS --set ...` against the cluster (submit, sweep); must exit 0."""
    result = subprocess.run([sys.executable, "-m", "moe_train.cli.main", *args,
                             *(arg for value in sets for arg in ("--set", value))],
                            env=cluster.env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


def job_id_of(result: subprocess.CompletedProcess) -> str:
    return re.search(r"submitted job (\d+)", result.stdout).group(1)


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every train line the run logged so far."""
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir, "train", missing_ok=True)]


def job_log(run_dir: Path, job_id: str) -> Path:
    return run_dir / "logs" / f"slurm-{job_id}.out"


def wait_for_steps(cluster, job_id: str, run_dir: Path, count: int, timeout: float = 150) -> None:
    """Until the job has logged `count` steps; fails at once if it ends first (with its log)."""
    deadline = time.monotonic() + timeout
    while len(train_losses(run_dir)) < count:
        state = cluster.job_state(job_id)
        log = job_log(run_dir, job_id)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} {state}: " + (
            log.read_text() if log.exists() else "")
        assert time.monotonic() < deadline, f"job {job_id}: {count} steps not logged within {timeout}s"
        time.sleep(0.2)


def training_process(run_dir: Path, **environment: str) -> tuple[int, int] | None:
    """(pid, global rank) of a training process of the job training `run_dir` (slurmd's descendants, not ours)
    whose environment holds `environment` (e.g. LOCAL_RANK="1", or SLURMD_NODENAME=a node)."""
    want = {key.encode(): value.encode() for key, value in environment.items()}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            items = dict(item.split(b"=", 1) for item in environ.read_bytes().split(b"\0") if b"=" in item)
            if (items.get(b"MOE_TRAIN_RUN_DIR") == str(run_dir).encode() and b"RANK" in items
                    and b"LOCAL_RANK" in items and all(items.get(k) == v for k, v in want.items())):
                return int(environ.parent.name), int(items[b"RANK"])
    return None


def preempt_and_finish(cluster, job_id: str, run_dir: Path, steps: int, timeout: float = 300) -> tuple[int, str]:
    """Preempt the job once it has logged 2 steps (`scancel --signal=USR1 --batch`: the notice SLURM sends
    `--signal` seconds before the time limit); it must save, requeue itself once, resume where it stopped and
    complete. Returns the step it stopped at and its log."""
    log = job_log(run_dir, job_id)
    wait_for_steps(cluster, job_id, run_dir, 2)
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    assert cluster.wait_done(job_id, timeout=timeout) == "COMPLETED", log.read_text()
    text = log.read_text()
    stopped = int(re.search(r"stopping at step (\d+): preemption notice", text).group(1))
    assert 2 <= stopped < steps, text
    for fragment in (f"requeueing job {job_id} (restart 1 of 2)", f"job {job_id} (restart 1)", f"at step {stopped}",
                     f"complete at step {steps}/{steps}"):
        assert fragment in text, fragment + "\n" + text
    assert text.count("requeueing") == 1 and cluster.job_field(job_id, "Restarts") == "1"
    assert (run_dir / "COMPLETE").exists()
    return stopped, text


def kill_and_expect_fast_failure(cluster, job_id: str, run_dir: Path, pid: int) -> str:
    """SIGKILL training process `pid` of the job: the job must fail within 60 s, not be requeued, not be
    complete. Returns its log."""
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    assert cluster.wait_done(job_id, timeout=90) == "FAILED"
    ended = time.mktime(time.strptime(cluster.job_field(job_id, "EndTime"), "%Y-%m-%dT%H:%M:%S"))
    assert ended - killed < 60
    text = job_log(run_dir, job_id).read_text()
    assert "requeueing" not in text and cluster.job_field(job_id, "Restarts") == "0"
    assert not (run_dir / "COMPLETE").exists()
    return text
