"""Submit a run to SLURM: run folder, batch script, sbatch, and a record of the job id for `moe-train runs`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from moe_train.atomic import write_atomic
from moe_train.config import Recipe, unsupported
from moe_train.run_files import LOGS_DIR, PREFLIGHT_SCRIPT_FILE, SCRIPT_FILE, SUBMISSIONS_FILE

from .render import render_sbatch
from .rundir import check_reusable, prepare_run_dir, run_dir_path
from .shell import LaunchError


class SubmitError(RuntimeError):
    """sbatch refused or failed (a runtime failure, exit code 1); the message is one line."""


SBATCH_MISSING = "sbatch not found on PATH (submit from a SLURM login node, or use --dry-run)"


@dataclass(frozen=True)
class Submission:
    run_dir: Path
    script: Path
    script_text: str
    job_id: str | None
    log: Path | None


def submittable_problems(recipe: Recipe, *, preflight: bool) -> list[str]:
    """A training job must be trainable now and fit its GPUs (`moe-train plan`); a preflight only checks the
    allocation, so any layout passes."""
    return [] if preflight else unsupported(recipe) + memory_problems(recipe)


def memory_problems(recipe: Recipe) -> list[str]:
    """The planner's verdict when the recipe cannot fit its GPUs' memory (none for launch.device cpu)."""
    from moe_train.plan.fit import check_fit

    error = check_fit(recipe).error
    return [error] if error else []


SBATCH_TIMEOUT_S = 120.0
_JOB_ID = re.compile(r"\d+")


def sbatch(script: Path) -> str:
    """Run `sbatch --parsable` on a script; returns the job id. Raises SubmitError with sbatch's message.

    sbatch runs in its own session so that, when it hangs (a slurmctld that does not answer), it is killed
    with everything it started and the error comes back after SBATCH_TIMEOUT_S, not never.
    """
    if shutil.which("sbatch") is None:
        raise SubmitError(SBATCH_MISSING)
    process = subprocess.Popen(["sbatch", "--parsable", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise SubmitError(f"sbatch {script}: no answer within {SBATCH_TIMEOUT_S:g} s (is slurmctld up?)") from None
    if process.returncode != 0:
        reason = " ".join(stderr.split()) or f"exit code {process.returncode}"
        raise SubmitError(f"sbatch {script}: {reason}")
    job_id = stdout.strip().split(";")[0]
    if not _JOB_ID.fullmatch(job_id):
        raise SubmitError(f"sbatch {script}: no job id in its output {stdout.strip()[:200]!r}")
    return job_id


def record_submission(run_dir: Path, job_id: str, kind: str, script: Path) -> None:
    """Append a line to {run_dir}/submissions.jsonl (rewritten atomically): what `runs` looks up in squeue."""
    path = run_dir / SUBMISSIONS_FILE
    previous = path.read_text() if path.exists() else ""
    line = json.dumps({"job_id": job_id, "kind": kind, "script": str(script),
                       "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    write_atomic(path, previous + line + "\n")


def write_job(recipe: Recipe, *, preflight: bool = False) -> tuple[Path, Path, str]:
    """Prepare the run folder and write its batch script (job.sbatch, or preflight.sbatch) into it: what
    `render --target slurm` leaves behind and `submit` then sbatches. Returns (run_dir, script, script text)."""
    run_dir = prepare_run_dir(recipe)
    text = render_sbatch(recipe, run_dir, preflight=preflight)
    script = run_dir / (PREFLIGHT_SCRIPT_FILE if preflight else SCRIPT_FILE)
    write_atomic(script, text)
    script.chmod(0o755)
    return run_dir, script, text


def submit(recipe: Recipe, *, preflight: bool = False, dry_run: bool = False) -> Submission:
    """Write the run folder and its batch script and sbatch it; `dry_run` renders only and writes nothing.

    Raises LaunchError (invalid input, exit 2) or SubmitError (sbatch missing, failing, silent or hanging: exit 1).
    A failed submission records nothing in submissions.jsonl, and a run folder it created is removed again.
    """
    problems = submittable_problems(recipe, preflight=preflight)
    if problems:
        raise LaunchError(problems)
    if dry_run:
        run_dir = run_dir_path(recipe)
        check_reusable(recipe, run_dir)
        script = run_dir / (PREFLIGHT_SCRIPT_FILE if preflight else SCRIPT_FILE)
        return Submission(run_dir, script, render_sbatch(recipe, run_dir, preflight=preflight), None, None)
    if shutil.which("sbatch") is None:  # before anything is written
        raise SubmitError(SBATCH_MISSING)
    fresh = not run_dir_path(recipe).exists()
    run_dir, script, text = write_job(recipe, preflight=preflight)
    try:
        job_id = sbatch(script)
    except SubmitError:
        if fresh:  # a failed first submission leaves no run folder behind: retrying starts from the same place
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    record_submission(run_dir, job_id, "preflight" if preflight else "train", script)
    log = run_dir / LOGS_DIR / f"{'preflight' if preflight else 'slurm'}-{job_id}.out"
    return Submission(run_dir, script, text, job_id, log)
