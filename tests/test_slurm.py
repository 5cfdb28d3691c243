"""End to end on a real one-node SLURM cluster (started by tests/slurm_cluster.py; skipped with the reason where
it cannot start): preflight jobs with 2 ranks, a sweep as a job array, an allocation that does not match the
recipe failing fast, and the preemption requeue path with a stand-in workload."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import SHRINK_SLURM, read_metrics, sets
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

from moe_train.atomic import write_atomic
from moe_train.config import load_recipe
from moe_train.launch.render import render_sbatch
from moe_train.launch.rundir import prepare_run_dir
from moe_train.launch.submit import record_submission

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s+(\d+)\s+(\S+)\s+(\d+)\s+(pp \d+ dp \d+ cp \d+ tp \d+ \| edp \d+ ep \d+ etp \d+)$", re.M)
RANK_LINE = re.compile(r"rank (\d+)/2 on \S+: local rank \d+: (pp .*? etp \d+); \d+ all-reduces ok")
# Spaces, quotes, command substitution, a percent sign: the run folder reaches #SBATCH --output and the shell.
HOSTILE_DIR = "run dir $(touch PWNED) 'q' `x` 100%"

pytestmark = pytest.mark.timeout(150)


def cli(cluster, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_train.cli.main", *args], env=cluster.env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def wait_for_file(path: Path, pattern: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text(errors="replace")):
            return path.read_text(errors="replace")
        time.sleep(0.3)
    pytest.fail(f"{path}: {pattern!r} not seen within {timeout}s; has: "
                f"{path.read_text(errors='replace') if path.exists() else '(missing)'}")


def check_rank_table(log: str, want: dict[int, str]) -> None:
    """Rank 0's table and every rank's own line agree with the expected coordinates."""
    rows = {int(rank): coords for rank, _, _, coords in ROW.findall(log)}
    lines = {int(rank): coords for rank, coords in RANK_LINE.findall(log)}
    assert rows == want, log
    assert lines == want, log


@pytest.mark.slow
def test_submit_preflight_runs_two_ranks_on_slurm(slurm_cluster, tmp_path):  # noqa: F811
    run_dir = tmp_path / HOSTILE_DIR
    result = cli(slurm_cluster, tmp_path, "submit", "qwen3-moe-tiny", "--preflight", "--set", f"run_dir={run_dir}",
                 "--set", "launch.gpus_per_node=2", "--set", "parallel.ep=2",
                 "--set", "launch.slurm.job_name=job $(touch PWNED) \"dq\"")
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+) \(preflight\)", result.stdout).group(1)
    assert f"log:    {run_dir}/logs/preflight-{job_id}.out" in result.stdout
    assert slurm_cluster.wait_done(job_id) == "COMPLETED", (run_dir / "logs" / f"preflight-{job_id}.out").read_text()
    log = (run_dir / "logs" / f"preflight-{job_id}.out").read_text()
    check_rank_table(log, {0: "pp 0 dp 0 cp 0 tp 0 | edp 0 ep 0 etp 0", 1: "pp 0 dp 1 cp 0 tp 0 | edp 0 ep 1 etp 0"})
    # sbatch read the quoted job name back verbatim, and nothing hostile ran anywhere.
    name = slurm_cluster.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%j").stdout.strip()
    assert name == 'job $(touch PWNED) "dq"-preflight'
    assert not list(tmp_path.rglob("PWNED")) and not (REPO / "PWNED").exists()
    runs = cli(slurm_cluster, tmp_path, "runs", str(tmp_path))
    assert re.search(rf"preflight done\s+{job_id}", runs.stdout), runs.stdout


@pytest.mark.slow
def test_sweep_is_one_job_array_each_task_with_its_own_recipe(slurm_cluster, tmp_path):  # noqa: F811
    base = tmp_path / "sweep"
    result = cli(slurm_cluster, tmp_path, "sweep", "qwen3-moe-tiny", "--set", f"run_dir={base}",
                 "--set", "launch.gpus_per_node=2", "--grid", "parallel.ep=1,2,3", "--submit", "--preflight",
                 "--max-parallel", "2")
    assert result.returncode == 0, result.stderr
    assert "2 of 3 point(s) valid" in result.stdout  # ep=3 does not divide 8 experts: listed and skipped
    array_id = re.search(r"submitted job array (\d+) \(2 task\(s\)\)", result.stdout).group(1)
    assert "#SBATCH --array=0-1%2" in (base / "preflight.sbatch").read_text()
    for task in (0, 1):
        assert slurm_cluster.wait_done(f"{array_id}_{task}") == "COMPLETED"
    want = {
        "ep-1": {0: "pp 0 dp 0 cp 0 tp 0 | edp 0 ep 0 etp 0", 1: "pp 0 dp 1 cp 0 tp 0 | edp 1 ep 0 etp 0"},
        "ep-2": {0: "pp 0 dp 0 cp 0 tp 0 | edp 0 ep 0 etp 0", 1: "pp 0 dp 1 cp 0 tp 0 | edp 0 ep 1 etp 0"},
    }
    for task, (point, coords) in enumerate(want.items()):
        link = base / point / "logs" / f"slurm-{array_id}_{task}.out"
        assert link.is_symlink()
        log = link.read_text()
        assert f"recipe {base / point}/recipe.yaml" in log
        check_rank_table(log, coords)
    assert not (base / "ep-3").exists()


@pytest.mark.slow
def test_allocation_smaller_than_the_recipe_fails_fast_on_every_rank(slurm_cluster, tmp_path):  # noqa: F811
    recipe = load_recipe("qwen3-moe-tiny", [f"run_dir={tmp_path / 'r'}", "launch.nodes=2", "launch.gpus_per_node=2",
                                            "train.micro_batch_size=2"])
    run_dir = prepare_run_dir(recipe)
    script = run_dir / "preflight.sbatch"
    write_atomic(script, render_sbatch(recipe, run_dir, preflight=True))
    # The recipe asks for 2 nodes; the allocation is overridden to the cluster's one node.
    job_id = slurm_cluster.run("sbatch", "--parsable", "--nodes=1", str(script), cwd=tmp_path).stdout.strip()
    assert slurm_cluster.wait_done(job_id) == "FAILED"
    log = (run_dir / "logs" / f"preflight-{job_id}.out").read_text()
    failed = re.findall(r"rank (\d)/2 on \S+: world size 2 from the launcher does not match the recipe's "
                        r"launch.nodes 2 x launch.gpus_per_node 2 = 4; the SLURM allocation has 1 node\(s\)", log)
    # Each rank checks the launch before any collective and says why it stops; a rank still starting when its
    # peer has failed is stopped by torchrun first (SIGTERM, in torchrun's failure report), which is fast too.
    stopped = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*\n\s*exitcode\s*: -15 ", log)
    assert failed and sorted({*failed, *stopped}) == ["0", "1"], log
    start, end = (slurm_cluster.job_field(job_id, f) for f in ("StartTime", "EndTime"))
    fmt = "%Y-%m-%dT%H:%M:%S"
    assert time.mktime(time.strptime(end, fmt)) - time.mktime(time.strptime(start, fmt)) < 45


STAND_IN_STEP = """\
#!/bin/bash
# Stand-in for torchrun + trainer: waits for the preemption notice file on its first run and stops cleanly
# (as the trainer does after a checkpoint), then completes on the requeued run.
while [ $# -gt 0 ] && [ "$1" != --recipe ]; do shift; done
run_dir=$(dirname "$2")
echo "stand-in step: restart ${SLURM_RESTART_COUNT:-0}"
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
  echo "stand-in step: waiting for the notice"
  for _ in $(seq 900); do
    if [ -e "$run_dir/PREEMPT" ]; then echo "stand-in step: notice seen, stopping cleanly"; exit 0; fi
    sleep 0.1
  done
  exit 3
fi
touch "$run_dir/COMPLETE"
echo "stand-in step: complete"
"""


@pytest.mark.slow
def test_preemption_notice_requeues_once_then_completes(slurm_cluster, tmp_path):  # noqa: F811
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(textwrap.dedent(STAND_IN_STEP))
    (bin_dir / "torchrun").chmod(0o755)
    recipe = load_recipe("qwen3-tiny", [f"run_dir={tmp_path / 'r'}", "launch.slurm.signal_seconds=60",
                                        "launch.slurm.max_restarts=2"])
    run_dir = prepare_run_dir(recipe)
    script = run_dir / "job.sbatch"
    write_atomic(script, render_sbatch(recipe, run_dir))
    env = dict(slurm_cluster.env, PATH=f"{bin_dir}:{slurm_cluster.env['PATH']}")
    job_id = slurm_cluster.run("sbatch", "--parsable", str(script), env=env, cwd=tmp_path).stdout.strip()
    record_submission(run_dir, job_id, "train", script)
    log = run_dir / "logs" / f"slurm-{job_id}.out"
    wait_for_file(log, "waiting for the notice")
    runs = cli(slurm_cluster, tmp_path, "runs", str(tmp_path))
    assert re.search(rf"^r\s+running\s+{job_id}\s", runs.stdout, re.M), runs.stdout
    # What SLURM does --signal seconds before the time limit: USR1 to the batch shell only.
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    assert slurm_cluster.wait_done(job_id, timeout=120) == "COMPLETED", log.read_text()
    text = log.read_text()
    for fragment in ("preemption notice (SIGUSR1)", "notice seen, stopping cleanly", "step exited with status 0",
                     f"requeueing job {job_id} (restart 1 of 2)", "stand-in step: restart 1",
                     "stand-in step: complete"):
        assert fragment in text, text
    assert text.count("requeueing") == 1
    assert (run_dir / "COMPLETE").exists() and not (run_dir / "PREEMPT").exists()
    assert slurm_cluster.job_field(job_id, "Restarts") == "1"
    runs = cli(slurm_cluster, tmp_path, "runs", str(tmp_path))
    assert re.search(rf"^r\s+complete\s+{job_id}", runs.stdout, re.M), runs.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ['back\\slash "q" $(x) `y`', "tab\there; z", "it's 'single'", "a#b c #d", "x=1 %j"])
def test_sbatch_reads_rendered_job_names_verbatim(slurm_cluster, tmp_path, name):  # noqa: F811
    recipe = load_recipe("qwen3-tiny", [f"run_dir={tmp_path / 'r'}"])
    recipe = recipe.model_copy(update={"launch": recipe.launch.model_copy(update={
        "slurm": recipe.launch.slurm.model_copy(update={"job_name": name})})})
    run_dir = prepare_run_dir(recipe)
    script = run_dir / "job.sbatch"
    write_atomic(script, render_sbatch(recipe, run_dir))
    job_id = slurm_cluster.run("sbatch", "--parsable", "--hold", str(script), cwd=tmp_path).stdout.strip()
    try:
        assert slurm_cluster.run("squeue", "-h", "-j", job_id, "-o", "%j").stdout.rstrip("\n") == name
    finally:
        slurm_cluster.run("scancel", job_id)


@pytest.mark.slow
def test_submitted_ep2_run_trains_on_slurm(slurm_cluster, tmp_path):  # noqa: F811
    """A qwen3-moe-tiny training job with expert parallelism over its 2 ranks, through sbatch: it completes,
    the logging rank writes every step with each MoE layer's balance, the run folder is COMPLETE, and
    `moe-train report` renders its plots."""
    run_dir = tmp_path / "ep2"
    result = cli(slurm_cluster, tmp_path, "submit", "qwen3-moe-tiny",
                 *sets(*SHRINK_SLURM, "launch.gpus_per_node=2", "parallel.ep=2", "train.steps=4", f"run_dir={run_dir}"))
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    log = run_dir / "logs" / f"slurm-{job_id}.out"
    assert slurm_cluster.wait_done(job_id, timeout=130) == "COMPLETED", log.read_text() if log.exists() else ""
    lines = read_metrics(run_dir, "train")
    assert len(lines) == 4  # one writer: the logging rank only
    assert all({"0", "1"} <= set(line["moe"]) for line in lines)
    assert (run_dir / "COMPLETE").exists()
    report = cli(slurm_cluster, tmp_path, "report", str(run_dir))
    assert report.returncode == 0, report.stderr
    for name in ("loss.png", "throughput.png", "expert_load.png"):
        assert (run_dir / "report" / name).stat().st_size > 10_000, name
