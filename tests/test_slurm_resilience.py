"""A long run on a real one-node SLURM cluster (tests/slurm_cluster.py; skipped with the reason where it cannot
start), with the real trainer on 2 gloo ranks:
- preempted: the batch shell gets the notice (`scancel --signal=USR1 --batch`, what SLURM does `--signal` seconds
  before the time limit), the ranks save and exit 0, the job requeues itself and resumes from that checkpoint
  (`--restart`: resume required), finishes, and its loss sequence equals an uninterrupted run's; a finished run
  is neither requeued nor started again;
- crashed: a rank SIGKILLed mid-step fails the job within 60 s, the dead rank named in the log, no requeue.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import SHRINK_SLURM
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)
from slurm_jobs import (
    cli,
    job_id_of,
    kill_and_expect_fast_failure,
    preempt_and_finish,
    train_losses,
    training_process,
    wait_for_steps,
)

from moe_train.config import load_recipe
from moe_train.train.loop import Trainer

pytestmark = pytest.mark.timeout(240)

STEPS = 10
JOB = [*SHRINK_SLURM, f"train.steps={STEPS}"]


def submit_two_ranks(cluster, tmp_path: Path, recipe: str, run_dir: Path, *extra: str) -> str:
    return job_id_of(cli(cluster, tmp_path, "submit", recipe,
                         sets=[*JOB, "launch.gpus_per_node=2", f"run_dir={run_dir}", *extra]))


@pytest.mark.slow
def test_a_preempted_ep2_job_saves_requeues_resumes_and_matches_an_uninterrupted_run(slurm_cluster, tmp_path):  # noqa: F811
    run_dir = tmp_path / "ep2"
    job_id = submit_two_ranks(slurm_cluster, tmp_path, "qwen3-moe-tiny", run_dir, "parallel.ep=2",
                              "launch.slurm.signal_seconds=60", "launch.slurm.max_restarts=2")
    stopped, text = preempt_and_finish(slurm_cluster, job_id, run_dir, STEPS, timeout=180)
    checkpoint = run_dir / "checkpoints" / f"step-{stopped:07d}"
    for fragment in (f"checkpoint saved: {checkpoint}", f"preempted at step {stopped}/{STEPS}",
                     "step exited with status 0", f"started from {checkpoint} at step {stopped}"):
        assert fragment in text, fragment + "\n" + text
    assert not (run_dir / "PREEMPT").exists()

    # One history, step by step the uninterrupted run's (the single process; EP2 equals it within 1e-5).
    logged = train_losses(run_dir)
    assert [step for step, _ in logged] == list(range(1, STEPS + 1))
    reference_dir = tmp_path / "reference"
    Trainer(load_recipe("qwen3-moe-tiny", [*JOB, f"run_dir={reference_dir}"])).train()
    assert [loss for _, loss in logged] == pytest.approx([loss for _, loss in train_losses(reference_dir)], rel=1e-5)

    # Finished: a resubmission of its script starts nothing and is not requeued.
    again = slurm_cluster.run("sbatch", "--parsable", str(run_dir / "job.sbatch"), cwd=tmp_path).stdout.strip()
    assert slurm_cluster.wait_done(again, timeout=60) == "COMPLETED"
    second = (run_dir / "logs" / f"slurm-{again}.out").read_text()
    assert "not started: the run is complete" in second and "step exited" not in second
    assert slurm_cluster.job_field(again, "Restarts") == "0"
    assert train_losses(run_dir) == logged


@pytest.mark.slow
def test_a_rank_killed_mid_step_fails_the_job_within_60_s_naming_it_and_it_is_not_requeued(slurm_cluster,  # noqa: F811
                                                                                           tmp_path):
    run_dir = tmp_path / "crash"
    job_id = submit_two_ranks(slurm_cluster, tmp_path, "qwen3-tiny", run_dir, "train.steps=1000")
    wait_for_steps(slurm_cluster, job_id, run_dir, 2, timeout=120)
    found = training_process(run_dir, RANK="1", LOCAL_RANK="1")
    assert found is not None, "rank 1's process not found"
    text = kill_and_expect_fast_failure(slurm_cluster, job_id, run_dir, found[0])
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", text[text.index("Root Cause"):]), text
