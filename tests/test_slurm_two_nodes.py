"""Two nodes, really (issue 24): `launch.nodes: 2` on the real two-node test cluster (tests/slurm_cluster.py: two
slurmd on this machine, one CPU each), one torchrun per node rendezvousing across them:
- the preflight's rank table names both nodes;
- a sweep array of two-node training jobs, DP2 and EP2 across the nodes, each with the single process's losses;
- PP2 across the nodes, preempted (the batch shell's notice), requeued and resumed to the end, with the single
  process's losses;
- a rank killed on the second node fails the whole job fast, naming it.
Cases share jobs where they can (the budget of issue 24's tests is 5 minutes here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import SHRINK_SLURM
from slurm_cluster import node_names, slurm_cluster  # noqa: F401  (the session fixture)
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

pytestmark = pytest.mark.timeout(400)

STEPS = 6
# The preempted job's steps: enough that the notice (sent once 2 steps are logged, through slurmctld) cannot arrive
# after the last one; a 6-step job once finished first at load 10 (its steps take ~0.1 s).
PREEMPTED_STEPS = 40
JOB = [*SHRINK_SLURM, f"train.steps={STEPS}", "launch.nodes=2", "launch.gpus_per_node=1"]
ROW = re.compile(r"^\s+(\d+)\s+(\S+)\s+(\d+)\s+(pp \d+ dp \d+ cp \d+ tp \d+ \| edp \d+ ep \d+ etp \d+)$", re.M)


def losses(run_dir: Path) -> list[float]:
    return [loss for _, loss in train_losses(run_dir)]


def single_process_losses(run_dir: Path, steps: int = STEPS) -> list[float]:
    """The single process's losses of the recipe the jobs here train, for `steps` steps."""
    Trainer(load_recipe("qwen3-moe-tiny", [*JOB, f"train.steps={steps}", "launch.nodes=1",
                                           f"run_dir={run_dir}"])).train()
    return losses(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return single_process_losses(tmp_path_factory.mktemp("reference"))


@pytest.mark.slow
def test_two_node_preflight_and_sweep_of_dp2_and_ep2_match_one_process(slurm_cluster, tmp_path,  # noqa: F811
                                                                        reference):
    nodes = node_names()
    preflight_dir = tmp_path / "preflight"
    result = cli(slurm_cluster, tmp_path, "submit", "qwen3-moe-tiny", "--preflight",
                 sets=[*JOB, "parallel.ep=2", f"run_dir={preflight_dir}"])
    preflight_id = re.search(r"submitted job (\d+) \(preflight\)", result.stdout).group(1)
    base = tmp_path / "sweep"
    result = cli(slurm_cluster, tmp_path, "sweep", "qwen3-moe-tiny", "--grid", "parallel.ep=1,2", "--submit",
                 sets=[*JOB, f"run_dir={base}"])
    array_id = re.search(r"submitted job array (\d+) \(2 task\(s\)\)", result.stdout).group(1)

    assert slurm_cluster.wait_done(preflight_id, timeout=120) == "COMPLETED"
    log = (preflight_dir / "logs" / f"preflight-{preflight_id}.out").read_text()
    rows = {int(rank): (host, coords) for rank, host, _, coords in ROW.findall(log)}
    # One rank per node (which node gets rank 0 is torchrun's rendezvous' choice).
    assert {rank: coords for rank, (_, coords) in rows.items()} == {0: "pp 0 dp 0 cp 0 tp 0 | edp 0 ep 0 etp 0",
                                                                     1: "pp 0 dp 1 cp 0 tp 0 | edp 0 ep 1 etp 0"}, log
    assert sorted(host for host, _ in rows.values()) == nodes, log
    assert f"on 2 node(s) [{nodes[0]},{nodes[1]}]" in log, log

    for task, point in enumerate(("ep-1", "ep-2")):
        state = slurm_cluster.wait_done(f"{array_id}_{task}", timeout=240)
        text = (base / point / "logs" / f"slurm-{array_id}_{task}.out").read_text()
        assert state == "COMPLETED", text
        assert slurm_cluster.job_field(f"{array_id}_{task}", "NumNodes") == "2"
        assert f"complete at step {STEPS}/{STEPS}" in text, text
        assert losses(base / point) == pytest.approx(reference, rel=1e-5), point


@pytest.mark.slow
def test_two_node_pp2_preempted_requeued_resumes_to_the_single_process_losses(slurm_cluster, tmp_path):  # noqa: F811
    run_dir = tmp_path / "pp2"
    job_id = job_id_of(cli(slurm_cluster, tmp_path, "submit", "qwen3-moe-tiny",
                           sets=[*JOB, f"train.steps={PREEMPTED_STEPS}", "parallel.pp=2",
                                 "launch.slurm.signal_seconds=60", "launch.slurm.max_restarts=2",
                                 f"run_dir={run_dir}"]))
    _, text = preempt_and_finish(slurm_cluster, job_id, run_dir, PREEMPTED_STEPS)
    assert f"job {job_id} (restart 1) on 2 node(s)" in text, text
    assert losses(run_dir) == pytest.approx(single_process_losses(tmp_path / "reference", PREEMPTED_STEPS),
                                            rel=1e-5)


@pytest.mark.slow
def test_a_rank_killed_on_the_second_node_fails_the_two_node_job_fast(slurm_cluster, tmp_path):  # noqa: F811
    run_dir = tmp_path / "crash"
    job_id = job_id_of(cli(slurm_cluster, tmp_path, "submit", "qwen3-tiny",
                           sets=[*JOB, "train.steps=1000", f"run_dir={run_dir}"]))
    wait_for_steps(slurm_cluster, job_id, run_dir, 2)
    second = node_names()[1]  # not the rendezvous host (the allocation's first node)
    found = training_process(run_dir, SLURMD_NODENAME=second)
    assert found is not None, f"no rank found on {second}"
    pid, rank = found
    text = kill_and_expect_fast_failure(slurm_cluster, job_id, run_dir, pid)
    assert re.search(rf"rank\s*: {rank} \(local_rank: 0\)\s+exitcode\s*: -9", text), text
