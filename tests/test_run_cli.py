"""`moe-train run` end to end: in-process, through torchrun (2 gloo ranks), stopped by SIGTERM or the notice file."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_cli
from helpers import SHRINK_CLI, read_metrics, sets
from processes import finish, run_bounded, start

from moe_train.checkpoint.layout import latest_checkpoint
from moe_train.checkpoint.state import load_model_weights
from moe_train.config import load_recipe
from moe_train.models import build_model


def test_run_trains_and_summarises(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli("run", "qwen3-moe-tiny", *sets(*SHRINK_CLI, "train.steps=3", f"run_dir={run_dir}"))
    assert result.code == 0, result.stderr
    assert "complete at step 3/3: 3 steps" in result.stdout
    assert f"run dir {run_dir}" in result.stdout and "tokens/s, MFU" in result.stdout
    assert (run_dir / "recipe.yaml").exists() and (run_dir / "COMPLETE").exists()
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-0000003"
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2, 3]

    again = run_cli("run", "qwen3-moe-tiny", *sets(*SHRINK_CLI, "train.steps=3", f"run_dir={run_dir}"))
    assert again.code == 0 and "complete at step 3/3: 0 steps" in again.stdout  # resumed, nothing left to do


def test_run_resume_required_without_checkpoint_exits_2(tmp_path: Path) -> None:
    result = run_cli("run", "qwen3-tiny", *sets(*SHRINK_CLI, "train.steps=2", f"run_dir={tmp_path}",
                                                  "checkpoint.resume=required"))
    assert_bad_input(result, "checkpoint.resume: required, but", "holds no complete checkpoint")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_run_refuses_unsupported_features(tmp_path: Path) -> None:
    result = run_cli("run", "qwen3-tiny", *sets("parallel.cp=2", "parallel.dp_replicate=2", "launch.gpus_per_node=8",
                                                 f"run_dir={tmp_path}"))
    assert_bad_input(result, "parallel.cp: context parallelism with HSDP (cp > 1 and dp_replicate > 1) is not "
                     "supported yet")


@pytest.mark.slow
def test_run_two_data_parallel_ranks_match_one_across_a_resume(tmp_path: Path) -> None:
    """2 gloo ranks through torchrun, stopped at step 2 and resumed (a 2-rank DCP save and load), match 1 rank."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = [sys.executable, "-m", "moe_train.cli.main", "run", "qwen3-moe-tiny", *sets(*SHRINK_CLI, "train.steps=4")]
    runs = ((one, []), (two, ["--nproc", "2", *sets("train.exit_at_step=2")]), (two, ["--nproc", "2"]))
    for run_dir, extra in runs:
        done = run_bounded([*common, *extra, *sets(f"run_dir={run_dir}")], timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    assert "complete at step 4/4: 2 steps" in done.stdout
    single, parallel = read_metrics(one, "train"), read_metrics(two, "train")
    assert [r["step"] for r in parallel] == [1, 2, 3, 4]
    for a, b in zip(single, parallel, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"]
        # Expert counts all-reduced over ranks: the global batch's balance, exactly; the router's entropy is a
        # float sum whose order differs across ranks.
        for layer, figures in a["moe"].items():
            entropy = figures.pop("router_entropy")
            assert b["moe"][layer].pop("router_entropy") == pytest.approx(entropy, rel=1e-6)
            assert figures == b["moe"][layer]
    # The saved weights after step 4, parameter by parameter (gradients summed in another order: ~1e-6 apart).
    recipe = load_recipe("qwen3-moe-tiny", SHRINK_CLI)
    weights = []
    for run_dir in (one, two):
        model = build_model(recipe.model)
        load_model_weights(latest_checkpoint(run_dir / "checkpoints"), model)
        weights.append(model.state_dict())
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=1e-4, msg=name)


def _stop_midway(tmp_path: Path, stop) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "moe_train.cli.main", "run", "qwen3-tiny",
            *sets(*SHRINK_CLI, "train.steps=1000", "train.warmup_steps=10", f"run_dir={run_dir}")]
    process = start(argv)
    try:
        deadline = time.monotonic() + 90
        while (len(read_metrics(run_dir, "train", missing_ok=True)) < 2 and process.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.2)
        stop(process, run_dir)
    finally:
        done = finish(process, timeout=60)
    return done, run_dir


def _check_clean_stop(done: subprocess.CompletedProcess, run_dir: Path, reason: str) -> None:
    assert done.returncode == 0, done.stderr[-2000:]
    assert reason in done.stdout and "preempted at step" in done.stdout
    step = read_metrics(run_dir, "train")[-1]["step"]
    assert 2 <= step < 1000
    assert latest_checkpoint(run_dir / "checkpoints").name == f"step-{step:07d}"
    assert not (run_dir / "COMPLETE").exists()


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_0(tmp_path: Path) -> None:
    done, run_dir = _stop_midway(tmp_path, lambda process, run_dir: process.send_signal(signal.SIGTERM))
    _check_clean_stop(done, run_dir, "SIGTERM")


@pytest.mark.slow
def test_preemption_notice_checkpoints_and_exits_0(tmp_path: Path) -> None:
    done, run_dir = _stop_midway(tmp_path, lambda process, run_dir: (run_dir / "PREEMPT").write_text("soon\n"))
    _check_clean_stop(done, run_dir, f"preemption notice {run_dir / 'PREEMPT'}")


def test_run_runtime_failure_exits_1_naming_the_rank(tmp_path: Path) -> None:
    """A learning rate of 1e6 without clipping blows the gradients up within a few steps: on_nonfinite: stop."""
    result = run_cli("run", "qwen3-tiny", *sets(*SHRINK_CLI, "train.steps=20", "train.warmup_steps=0", "train.lr=1e6",
                                                  "train.min_lr=1e6", "train.grad_clip=null", "train.on_nonfinite=stop",
                                                  "checkpoint.interval=1", f"run_dir={tmp_path}"))
    assert result.code == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    pattern = r"error: rank 0: non-finite loss \S+ or grad norm \S+ at step (\d+) \(train.on_nonfinite: stop\)"
    assert re.fullmatch(pattern, line), line
    failed = int(re.search(r"at step (\d+)", line).group(1))
    assert failed < 20 and latest_checkpoint(tmp_path / "checkpoints").name == f"step-{failed - 1:07d}"
    last = read_metrics(tmp_path, "train")[-1]
    assert last["step"] == failed and last["skipped"] == 1


def test_run_refuses_several_nodes(tmp_path: Path) -> None:
    result = run_cli("run", "qwen3-tiny", *sets("launch.nodes=2", f"run_dir={tmp_path}"))
    assert_bad_input(result, "launch.nodes: 2 nodes; moe-train run trains on this machine only")
