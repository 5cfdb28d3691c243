"""`moe-train runs`: what the run folders under a root hold, and which of their jobs SLURM still knows.

Status comes from the files the run writes (COMPLETE, metrics.jsonl) and the job ids that `submit` and `sweep`
recorded in submissions.jsonl, looked up with one `squeue` call for all runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from moe_train.run_files import (
    CHECKPOINTS_DIR,
    COMPLETE_FILE,
    FAILED_FILE,
    LOGS_DIR,
    METRICS_FILE,
    RECIPE_FILE,
    SUBMISSIONS_FILE,
)

SKIP_DIRS = {CHECKPOINTS_DIR, LOGS_DIR}
TAIL_BYTES = 65536


@dataclass(frozen=True)
class RunStatus:
    run_dir: Path
    status: str
    job_id: str | None
    step: int | None
    loss: float | None
    elapsed_s: float | None = None  # from the latest launch (recipe.yaml's provenance time) to the last metrics line
    tokens_per_s: float | None = None  # of the last logged step
    reason: str | None = None  # why a failed run failed: the FAILED file's line


def find_runs(root: Path) -> list[Path]:
    """Folders under `root` (itself included) that hold a recipe.yaml, sweep points included, sorted."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        if RECIPE_FILE in files:
            found.append(Path(folder))
    return found


def last_train_record(path: Path) -> dict | None:
    """The last `kind: train` line of metrics.jsonl, reading only the end of a possibly long file."""
    if not path.is_file():
        return None
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - TAIL_BYTES))
        lines = handle.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a partial first line of the tail, or a line being written
        if isinstance(record, dict) and record.get("kind") == "train":
            return record
    return None


def launched_at(run_dir: Path) -> float | None:
    """UNIX time of the latest launch: recipe.yaml's `provenance.time` (prepare_run_dir writes it)."""
    match = re.search(r"^provenance:\n(?:[ ]+.*\n)*?[ ]+time: '?([0-9T:+.-]+)'?$",
                      (run_dir / RECIPE_FILE).read_text(errors="replace"), re.M)
    if match is None:
        return None
    try:
        return datetime.fromisoformat(match.group(1)).timestamp()
    except ValueError:
        return None


def elapsed_seconds(run_dir: Path) -> float | None:
    """Wall time from the latest launch to the last metrics.jsonl write (queue wait included); None before a
    step of this launch was logged."""
    metrics, start = run_dir / METRICS_FILE, launched_at(run_dir)
    if start is None or not metrics.is_file():
        return None
    elapsed = metrics.stat().st_mtime - start
    return elapsed if elapsed >= 0 else None


def last_submission(run_dir: Path) -> dict | None:
    path = run_dir / SUBMISSIONS_FILE
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def queue_states() -> dict[str, str]:
    """Job id -> state of every job SLURM has queued or running (array tasks one per line); {} without SLURM."""
    if shutil.which("squeue") is None:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    states = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def run_status(run_dir: Path, queue: dict[str, str]) -> RunStatus:
    """complete | running | queued | <state> (other live SLURM states) | failed | stopped | submitted | new."""
    record = last_train_record(run_dir / METRICS_FILE) or {}
    step, loss = record.get("step"), record.get("loss")
    submission = last_submission(run_dir)
    job_id = submission.get("job_id") if submission else None
    kind = submission.get("kind") if submission else None
    state = queue.get(job_id) if job_id else None
    if (run_dir / COMPLETE_FILE).exists():
        status = "complete"
    elif state is not None:
        status = {"RUNNING": "running", "PENDING": "queued", "REQUEUED": "queued"}.get(state, state.lower())
        if kind == "preflight":
            status = f"preflight {status}"
    elif (run_dir / FAILED_FILE).is_file():
        status = "failed"
    elif step is not None:
        status = "stopped"
    elif job_id is not None:
        status = "preflight done" if kind == "preflight" else "submitted"
    else:
        status = "new"
    reason = None
    if status == "failed":
        reason = (run_dir / FAILED_FILE).read_text(errors="replace").strip().splitlines()[:1] or ["(no reason)"]
        reason = reason[0]
    return RunStatus(run_dir, status, job_id, step, loss, elapsed_seconds(run_dir) if step is not None else None,
                     record.get("tokens_per_s"), reason)


def collect(root: Path) -> list[RunStatus]:
    runs = find_runs(root)
    queue = queue_states() if runs else {}
    return [run_status(run, queue) for run in runs]


def format_runs(statuses: list[RunStatus], root: Path) -> str:
    """Aligned text, one run per line, folders relative to `root`."""
    rows = [("run", "status", "job", "step", "loss")]
    for s in statuses:
        name = str(s.run_dir.relative_to(root)) if s.run_dir != root else "."
        rows.append((name, s.status, s.job_id or "-", "-" if s.step is None else str(s.step),
                     f"{s.loss:.4f}" if isinstance(s.loss, (int, float)) else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def format_elapsed(seconds: float | None) -> str:
    """1h02m, 4m05s, 12s; '-' when unknown."""
    if seconds is None:
        return "-"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def failure_lines(statuses: list[RunStatus], root: Path) -> list[str]:
    """`RUN: failed: REASON`, one per failed run, for under the table."""
    return [f"{s.run_dir.relative_to(root) if s.run_dir != root else '.'}: failed: {s.reason}"
            for s in statuses if s.reason is not None]


def runs_table(statuses: list[RunStatus], root: Path):
    """The `moe-train runs` table (rich, no borders so each line still reads `run  status  job ...`): the
    columns of format_runs, then elapsed and tokens/s of the last logged step."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for name, justify in (("run", "left"), ("status", "left"), ("job", "left"), ("step", "right"),
                          ("loss", "right"), ("elapsed", "right"), ("tokens/s", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for s in statuses:
        name = str(s.run_dir.relative_to(root)) if s.run_dir != root else "."
        table.add_row(name, s.status, s.job_id or "-", "-" if s.step is None else str(s.step),
                      f"{s.loss:.4f}" if isinstance(s.loss, (int, float)) else "-", format_elapsed(s.elapsed_s),
                      f"{s.tokens_per_s:,.0f}" if isinstance(s.tokens_per_s, (int, float)) else "-")
    return table
