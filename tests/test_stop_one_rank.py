"""Two gloo ranks through `moe-train run --nproc 2`, one of them signalled alone:
- SIGTERM to rank 1's process only stops both ranks at the same step boundary, with one two-rank checkpoint of
  that step (the notice file is shared by all ranks, so a signal is the only stop that reaches one rank alone);
- SIGKILL to rank 1 mid-step (a lost rank: killed, out of memory) ends the whole job non-zero within 60 s, the
  dead rank named in the output, never a hang: the survivor's gloo collective fails on the closed connection and
  torchrun stops the rest (what bounds it otherwise: docs/interfaces.md, lost ranks);
- SIGSTOP to rank 1 (alive but stuck: its connections stay open) ends the job non-zero once the survivor's
  collective outlives `launch.timeout_minutes`, plus torchrun's grace before it SIGKILLs the stuck rank."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import run_cli
from helpers import SHRINK, read_metrics
from helpers import sets as set_args
from processes import descendants, finish, start

from moe_train.checkpoint.layout import latest_checkpoint


def train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir, "train", missing_ok=True)]


def rank_process(launcher: int, rank: int) -> int | None:
    """The pid of the training process of `rank` (torchrun sets RANK in its workers' environment)."""
    for pid in descendants(launcher):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
                return pid
    return None


def signal_rank_1_after_two_steps(run_dir: Path, sig: signal.Signals, *overrides: str,
                                  ) -> tuple[subprocess.CompletedProcess, float]:
    """Train qwen3-tiny on 2 ranks, send `sig` to rank 1 once two steps are logged; (the result, seconds from the
    signal to the end of `moe-train run`)."""
    sets = set_args(*SHRINK, "train.steps=1000", *overrides, f"run_dir={run_dir}")
    process = start([sys.executable, "-m", "moe_train.cli.main", "run", "qwen3-tiny", "--nproc", "2", *sets])
    sent = time.monotonic()
    try:
        deadline = time.monotonic() + 90
        while len(train_steps(run_dir)) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        target = rank_process(process.pid, 1)
        assert target is not None and process.poll() is None, "rank 1 is not running"
        os.kill(target, sig)
        sent = time.monotonic()
    finally:
        done = finish(process, timeout=90)
    return done, time.monotonic() - sent


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_ranks_at_the_same_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done, _ = signal_rank_1_after_two_steps(run_dir, signal.SIGTERM)
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = train_steps(run_dir)[-1]
    assert 2 <= stopped < 1000
    # Rank 0 (which logs) never got a signal: it stopped because rank 1 asked, at the same boundary.
    assert f"stopping at step {stopped}: a stop requested on another rank" in done.stdout
    assert f"preempted at step {stopped}/1000" in done.stdout
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / f"step-{stopped:07d}"
    shards = sorted(p.name for p in latest_checkpoint(run_dir / "checkpoints").glob("*.distcp"))
    assert len(shards) == 2  # both ranks wrote their part of the same step
    assert not (run_dir / "COMPLETE").exists()


@pytest.mark.slow
def test_a_rank_killed_mid_step_ends_the_job_non_zero_within_60_s_naming_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done, seconds = signal_rank_1_after_two_steps(run_dir, signal.SIGKILL)
    assert done.returncode != 0 and seconds < 60, (seconds, done.stderr[-3000:])
    # torchrun's summary: rank 1 is the first failure, killed by signal 9; the survivor names itself and why.
    root_cause = done.stderr[done.stderr.index("Root Cause"):]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", root_cause), done.stderr[-3000:]
    assert re.search(r"error: rank 0: \w+Error: ", done.stderr), done.stderr[-3000:]
    assert not (run_dir / "COMPLETE").exists()


@pytest.mark.slow
def test_a_rank_stuck_alive_ends_the_job_once_the_collective_timeout_passes(tmp_path: Path) -> None:
    """No connection closes, so only the process group's timeout (6 s here) can free rank 0; torchrun then
    SIGTERMs the stopped rank (held pending) and SIGKILLs it after its 30 s grace."""
    run_dir = tmp_path / "run"
    done, seconds = signal_rank_1_after_two_steps(run_dir, signal.SIGSTOP, "launch.timeout_minutes=0.1")
    assert done.returncode != 0, done.stderr[-3000:]
    assert 6 <= seconds < 75, (seconds, done.stderr[-3000:])
    assert re.search(r"error: rank 0: \w+Error: .*[Tt]imed? ?out", done.stderr), done.stderr[-3000:]
    assert re.search(r"exitcode\s*: -9 .*\(SIGKILL\)", done.stderr), done.stderr[-3000:]  # the stuck rank
    assert not (run_dir / "COMPLETE").exists()
    # Hangs explained (issue 24): before the timeout, rank 0 said where it waited, with its stack; the run
    # folder keeps the report and the failure's reason line, which `moe-train runs` shows.
    header = (r"hang report: rank 0, step (\d+): no collective for \d+ s, (in|after entering) \w+ on group \S+ "
              r"#\d+ sizes \[")
    match = re.search(header, done.stderr)
    assert match and int(match.group(1)) >= 3, done.stderr[-3000:]
    report = (run_dir / "logs" / "hang-rank0.txt").read_text()
    assert re.match(header, report) and "(most recent call first)" in report and "in _loop" in report, report
    # Rank 0 waits where rank 1 stopped: inside a step's collectives, or in the stop check between steps.
    assert "in train_step" in report or "in agreed" in report, report
    reason = (run_dir / "FAILED").read_text()
    assert reason.startswith("rank 0: ") and "(last collective: " in reason, reason
    listed = run_cli("runs", str(tmp_path))
    assert re.search(r"^run\s+failed\s", listed.stdout, re.M), listed.stdout
    assert f"run: failed: {reason.strip()}" in listed.stdout
