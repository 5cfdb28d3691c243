"""The entry on real ranks (torchrun, gloo): preflight rank tables, parallel folding, fast mismatch failures."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import free_port
from processes import run_bounded

from moe_train.config import load_recipe
from moe_train.config.mesh_shape import MeshShape
from moe_train.entry import LauncherEnv, launcher_problems
from moe_train.launch.render import torchrun_argv
from moe_train.launch.rundir import prepare_run_dir

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s+(\d+)\s+(\S+)\s+(\d+)\s+(pp \d+ dp \d+ cp \d+ tp \d+ \| edp \d+ ep \d+ etp \d+)$", re.M)
RANK_LINE = re.compile(r"rank (\d+)/(\d+) on \S+: local rank (\d+): (pp .*? etp \d+); (\d+) all-reduces ok")


def torchrun(recipe, run_dir: Path, *, nproc: int | None = None, preflight: bool = True, timeout: float = 120):
    argv = torchrun_argv(recipe, run_dir, port=free_port(), preflight=preflight)
    argv[0:1] = [sys.executable, "-m", "torch.distributed.run"]
    if nproc is not None:
        argv[argv.index("--nproc-per-node") + 1] = str(nproc)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    start = time.monotonic()
    result = run_bounded(argv, timeout=timeout, cwd=REPO, env=env)  # a hang kills torchrun and its ranks
    return result, time.monotonic() - start


def expected_coords(shape: tuple[int, ...], names: tuple[str, ...]) -> list[str]:
    """Row-major rank order, last dimension fastest (the test's own enumeration, not the mesh module's)."""
    return [" ".join(f"{n} {c}" for n, c in zip(names, coords, strict=True))
            for coords in itertools.product(*(range(s) for s in shape))]


@pytest.mark.slow
def test_preflight_four_ranks_folds_experts_across_tp_and_dp(tmp_path):
    """tp 2 x dp 2 for attention, ep 2 x edp 2 for experts over the same 4 ranks."""
    recipe = load_recipe("qwen3-moe-tiny", [f"run_dir={tmp_path / 'r'}", "launch.gpus_per_node=4",
                                            "parallel.tp=2", "parallel.ep=2"])
    result, _ = torchrun(recipe, prepare_run_dir(recipe))
    assert result.returncode == 0, result.stdout + result.stderr
    dense = expected_coords((1, 2, 1, 2), ("pp", "dp", "cp", "tp"))
    expert = expected_coords((2, 2, 1), ("edp", "ep", "etp"))
    want = [f"{d} | {e}" for d, e in zip(dense, expert, strict=True)]
    assert want[1] == "pp 0 dp 0 cp 0 tp 1 | edp 0 ep 1 etp 0"
    rows = ROW.findall(result.stdout)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert [r[3] for r in rows] == want
    assert [int(r[2]) for r in rows] == [0, 1, 2, 3]
    lines = sorted(RANK_LINE.findall(result.stdout))
    assert [(int(r), int(w), int(local), coords) for r, w, local, coords, _ in lines] == [
        (rank, 4, rank, want[rank]) for rank in range(4)]
    # 4 dense + 4 expert dimensions, each checked with a real all-reduce on its group.
    assert {n for *_, n in lines} == {"8"}
    assert "dense mesh (pp, dp, cp, tp) = (1, 2, 1, 2)" in result.stdout
    assert "expert mesh (pp, edp, ep, etp) = (1, 2, 2, 1)" in result.stdout


@pytest.mark.slow
def test_world_size_mismatch_fails_fast_on_every_rank(tmp_path):
    recipe = load_recipe("qwen3-moe-tiny", [f"run_dir={tmp_path / 'r'}", "launch.gpus_per_node=4",
                                            "train.micro_batch_size=2"])
    result, elapsed = torchrun(recipe, prepare_run_dir(recipe), nproc=2)
    assert result.returncode != 0
    failures = re.findall(r"rank (\d)/2 on \S+: world size 2 from the launcher does not match the recipe's "
                          r"launch.nodes 1 x launch.gpus_per_node 4 = 4; 2 rank\(s\) on this node", result.stderr)
    assert sorted(failures) == ["0", "1"], result.stderr
    assert elapsed < 60, elapsed  # no rendezvous or collective timeout was waited for
    assert "Traceback" not in "\n".join(line for line in result.stderr.splitlines() if "moe-train entry" in line)


@pytest.mark.slow
def test_single_process_preflight_without_a_launcher(tmp_path):
    recipe = load_recipe("qwen3-tiny", [f"run_dir={tmp_path / 'r'}"])
    run_dir = prepare_run_dir(recipe)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK") and not k.startswith("SLURM_")}
    result = subprocess.run([sys.executable, "-m", "moe_train.entry", "--recipe", str(run_dir / "recipe.yaml"),
                             "--preflight"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "rank 0/1" in result.stdout and ROW.search(result.stdout).group(4).startswith("pp 0 dp 0 cp 0 tp 0")


@pytest.mark.slow
def test_training_an_unsupported_recipe_exits_2(tmp_path):
    recipe = load_recipe("qwen3-tiny", [f"run_dir={tmp_path / 'r'}", "parallel.pp=2", "launch.gpus_per_node=2",
                                        "parallel.pp_schedule=zero_bubble"])
    run_dir = prepare_run_dir(recipe)
    result = subprocess.run([sys.executable, "-m", "moe_train.entry", "--recipe", str(run_dir / "recipe.yaml")],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert "parallel.pp_schedule: the zero_bubble schedule with FSDP2" in result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_recipe_file_exits_2(tmp_path):
    bad = tmp_path / "recipe.yaml"
    bad.write_text("name: x\nmodel: {family: nope}\n")
    result = subprocess.run([sys.executable, "-m", "moe_train.entry", "--recipe", str(bad), "--preflight"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "model.family" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, "world size 8 from the launcher"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "2 rank(s) on this node"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "SLURM_JOB_NUM_NODES": "2"},
         "the SLURM allocation has 2 node(s)"),
    ],
)
def test_launcher_problems(environ, fragment):
    recipe = load_recipe("qwen3-moe-tiny", ["launch.gpus_per_node=4", "train.micro_batch_size=2"])
    assert launcher_problems(recipe, LauncherEnv({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})) == []
    problems = launcher_problems(recipe, LauncherEnv(environ))
    assert any(fragment in p for p in problems), problems


def test_mesh_shape_layout_math():
    shape = MeshShape(pp=2, dp=2, cp=1, tp=2, edp=1, ep=4, etp=1)
    assert shape.world_size == 8 and shape.problems(8) == []
    assert shape.dense_coords(5) == (1, 0, 0, 1) and shape.expert_coords(5) == (1, 0, 1, 0)
    assert shape.problems(16)[0].startswith("dense mesh pp 2 x dp 2 x cp 1 x tp 2 = 8 ranks")
    assert "expert mesh edp 1 x ep 2 x etp 1 = 2" in MeshShape(1, 2, 1, 2, 1, 2, 1).problems(4)[0]
