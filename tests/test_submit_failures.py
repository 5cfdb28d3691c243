"""`moe-train submit` when sbatch is missing, fails, answers without a job id or hangs: one `error:` line, exit 1,
no submissions.jsonl record, no temporary file, and no run folder left behind by a first submission.

sbatch is a stand-in shell script first on PATH (the real one is exercised in test_slurm.py)."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from cli_helpers import run_cli

from moe_train.launch import submit as submit_module


def stand_in(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / "sbatch"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def submit(run_dir: Path):
    return run_cli("submit", "qwen3-moe-tiny", "--set", f"run_dir={run_dir}")


def one_error_line(result, fragment: str) -> str:
    assert result.code == 1, (result.code, result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and fragment in line, line
    return line


def test_sbatch_missing_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    one_error_line(submit(tmp_path / "run"), "sbatch not found on PATH")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2\nexit 1',
         "sbatch: error: Batch job submission failed: Invalid partition name specified"),
        ("exit 3", "exit code 3"),
        ("exit 0", "no job id in its output ''"),
        ('echo "Submitted batch job"', "no job id in its output 'Submitted batch job'"),
    ],
    ids=["refused", "silent-failure", "no-output", "no-id"],
)
def test_failing_sbatch_is_one_line_and_leaves_no_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              body: str, fragment: str) -> None:
    stand_in(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    line = one_error_line(submit(tmp_path / "run"), fragment)
    assert "job.sbatch" in line  # names the script it tried
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_hanging_sbatch_is_killed_with_what_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = tmp_path / "sleeper.pid"
    stand_in(tmp_path / "bin", f"sleep 60 &\necho $! > '{pid_file}'\nwait")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setattr(submit_module, "SBATCH_TIMEOUT_S", 3.0)
    start = time.monotonic()
    one_error_line(submit(tmp_path / "run"), "no answer within 3 s")
    assert time.monotonic() - start < 20
    assert not (tmp_path / "run").exists()
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{sleeper}").exists() and "Z" not in Path(f"/proc/{sleeper}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the stand-in's child outlived the timeout"
        time.sleep(0.05)


def test_a_failed_resubmission_keeps_the_run_and_records_nothing(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "args"
    stand_in(tmp_path / "bin", f'printf "%s\\n" "$@" > "{record}"\necho "4242;cluster"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    run_dir = tmp_path / "run"
    ok = submit(run_dir)
    assert ok.code == 0, ok.stderr
    assert "submitted job 4242:" in ok.stdout
    assert record.read_text().splitlines() == ["--parsable", str(run_dir / "job.sbatch")]
    [line] = (run_dir / "submissions.jsonl").read_text().splitlines()
    assert json.loads(line)["job_id"] == "4242"

    stand_in(tmp_path / "bin", "echo 'sbatch: error: slurm_persist_conn_open: failed' >&2\nexit 1")
    one_error_line(submit(run_dir), "slurm_persist_conn_open: failed")
    assert (run_dir / "submissions.jsonl").read_text().splitlines() == [line]  # nothing recorded
    assert (run_dir / "recipe.yaml").is_file() and (run_dir / "job.sbatch").is_file()
    leftovers = [p for p in run_dir.rglob("*") if p.name.startswith(".")]
    assert leftovers == []
    assert os.access(run_dir / "job.sbatch", os.X_OK)
