"""Launching without a cluster: run folders, cluster profiles, rendering, quoting, sweeps, `runs`, and the batch
script's preemption logic executed with stand-in srun/torchrun/scontrol binaries."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from cli_helpers import assert_bad_input, run_cli

from moe_train.config import RecipeError, load_recipe
from moe_train.config.cluster import ClusterProfileError
from moe_train.config.loader import apply_cluster_profile
from moe_train.launch.render import render_array, render_sbatch, render_torchrun, sbatch_directives, torchrun_argv
from moe_train.launch.rundir import prepare_run_dir, read_run_recipe
from moe_train.launch.runs import collect, format_runs
from moe_train.launch.shell import LaunchError, sbatch_value
from moe_train.launch.sweep import axis_keys, expand, parse_axes, parse_axis, point_name

REPO = Path(__file__).resolve().parents[1]
HOSTILE = "a b $(touch PWNED1) `touch PWNED2`; touch PWNED3 'q' \"dq\" ${HOME} %j \\n"
HOSTILE_PATH = "run $(touch PWNED4) `touch PWNED5`; 'q' \"dq\" ${HOME} &x|y"


# Divides the global batch (16) at every world size these tests launch; qwen3-moe-tiny's own 8 (the default run's
# speed) only up to dp 2.
MICRO_BATCH = "train.micro_batch_size=2"


def tiny(tmp_path: Path, *sets: str, name: str = "qwen3-moe-tiny"):
    return load_recipe(name, [f"run_dir={tmp_path / 'runs' / 'r'}", MICRO_BATCH, *sets])


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# ------------------------------------------------------------------------------------------------ run dirs


def test_run_dir_written_with_provenance_and_reused_only_when_recipe_matches(tmp_path):
    recipe = tiny(tmp_path)
    run_dir = prepare_run_dir(recipe)
    assert run_dir == tmp_path / "runs" / "r" and (run_dir / "logs").is_dir()
    stored = read_run_recipe(run_dir)
    assert stored.run_dir == str(run_dir)
    assert set(stored.provenance) == {"moe_train_version", "git_sha", "time", "host"}
    assert stored.model == recipe.model and stored.train == recipe.train
    # The stored recipe is the one the ranks load: it must load with the real loader, unchanged.
    assert load_recipe(run_dir / "recipe.yaml").model_dump(exclude={"provenance"}) == stored.model_dump(
        exclude={"provenance"})
    # Same run again (resume and exit_at_step may differ): reused.
    assert prepare_run_dir(tiny(tmp_path, "checkpoint.resume=never", "train.exit_at_step=5")) == run_dir
    # A different run in the same folder: refused, naming the folder and the field.
    with pytest.raises(LaunchError) as error:
        prepare_run_dir(tiny(tmp_path, "train.lr=1e-2"))
    assert str(run_dir) in error.value.problems[0] and "train.lr" in error.value.problems[0]


def test_a_changed_layout_continues_the_same_run_and_recipe_yaml_records_it(tmp_path):
    """parallel.*, launch.* and train.micro_batch_size spread the same math over devices: a run folder accepts
    them changed (its checkpoints reshard) and keeps the latest launch's layout; the math itself may not change."""
    run_dir = prepare_run_dir(tiny(tmp_path, "launch.gpus_per_node=4", "parallel.tp=2", "parallel.ep=2"))
    relaid = tiny(tmp_path, "launch.gpus_per_node=8", "parallel.ep=8", "train.micro_batch_size=1",
                  "launch.timeout_minutes=3", "launch.slurm.partition=big")
    assert prepare_run_dir(relaid) == run_dir
    stored = read_run_recipe(run_dir)
    assert (stored.parallel, stored.launch, stored.train) == (relaid.parallel, relaid.launch, relaid.train)
    for field in ("train.global_batch_size=32", "train.seq_length=64", "model.moe.top_k=1"):
        with pytest.raises(LaunchError, match=field.split("=")[0]):
            prepare_run_dir(tiny(tmp_path, field))


def test_run_dir_mismatch_through_the_cli_exits_2_naming_the_folder(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    assert run_cli("render", "qwen3-moe-tiny", "--set", f"run_dir={run_dir}", "-t", "torchrun").code == 0
    result = run_cli("render", "qwen3-moe-tiny", "--set", f"run_dir={run_dir}", "--set", "train.steps=7")
    assert_bad_input(result, str(run_dir), "train.steps")
    assert len(result.stderr.strip().splitlines()) == 1


def test_folder_with_checkpoints_but_no_recipe_is_refused(tmp_path):
    (tmp_path / "runs" / "r" / "checkpoints").mkdir(parents=True)
    with pytest.raises(LaunchError, match="no recipe.yaml"):
        prepare_run_dir(tiny(tmp_path))


# ------------------------------------------------------------------------------------------ cluster profiles


def test_cluster_profile_by_name_supplies_defaults_that_the_recipe_overrides(tmp_path, monkeypatch):
    clusters = tmp_path / "clusters"
    clusters.mkdir()
    write_recipe(clusters / "big.yaml", {
        "gpus_per_node": 8, "gpu": "h100", "device": "cuda", "env": {"NCCL_DEBUG": "WARN", "A": "profile"},
        "setup": ["module load cuda"], "slurm": {"partition": "gpu", "account": "proj", "container_image": "img"},
    })
    monkeypatch.setenv("MOE_TRAIN_CLUSTERS", str(clusters))
    # The built-in sets launch.device and gpu itself (they would win over the profile): leave its launch out.
    data = yaml.safe_load((REPO / "recipes" / "qwen3-moe-tiny.yaml").read_text())
    data.update(run_dir=str(tmp_path / "run"),
                launch={"cluster": "big", "env": {"A": "recipe"}, "slurm": {"account": "mine"}})
    recipe_file = write_recipe(tmp_path / "r.yaml", data)
    recipe = load_recipe(recipe_file, ["parallel.ep=8", MICRO_BATCH])
    launch = recipe.launch
    assert (launch.gpus_per_node, launch.gpu, launch.device, launch.cluster) == (8, "h100", "cuda", None)
    assert launch.env == {"NCCL_DEBUG": "WARN", "A": "recipe"}
    assert launch.setup == ("module load cuda",)
    assert (launch.slurm.partition, launch.slurm.account, launch.slurm.container_image) == ("gpu", "mine", "img")
    # The resolved recipe needs no profile any more: it loads where the profile does not exist.
    run_dir = prepare_run_dir(recipe)
    monkeypatch.setenv("MOE_TRAIN_CLUSTERS", str(tmp_path / "elsewhere"))
    assert load_recipe(run_dir / "recipe.yaml").launch.slurm.partition == "gpu"


def test_cluster_profile_by_path_relative_to_the_recipe_and_user_folder(tmp_path, monkeypatch):
    write_recipe(tmp_path / "site.yaml", {"slurm": {"partition": "p1"}})
    raw = apply_cluster_profile({"cluster": "site.yaml", "nodes": 2}, tmp_path)
    assert raw == {"slurm": {"partition": "p1"}, "nodes": 2}
    home = tmp_path / "home"
    (home / ".config" / "moe-train" / "clusters").mkdir(parents=True)
    write_recipe(home / ".config" / "moe-train" / "clusters" / "c2.yaml", {"gpus_per_node": 4})
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MOE_TRAIN_CLUSTERS", raising=False)
    assert apply_cluster_profile({"cluster": "c2"}, tmp_path) == {"gpus_per_node": 4}


@pytest.mark.parametrize(
    ("content", "reference", "message"),
    [
        (None, "nowhere", "no cluster profile 'nowhere'"),
        (None, "missing.yaml", "does not exist"),
        ({"partitionn": "x"}, "bad.yaml", "unknown launch field(s) partitionn"),
        ([1, 2], "bad.yaml", "expected a mapping"),
        ({"slurm": "gpu"}, "bad.yaml", "slurm must be a mapping"),
    ],
)
def test_bad_cluster_profiles_are_one_line_errors(tmp_path, monkeypatch, content, reference, message):
    monkeypatch.setenv("MOE_TRAIN_CLUSTERS", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    if content is not None:
        write_recipe(tmp_path / reference, content)
    with pytest.raises(ClusterProfileError) as error:
        apply_cluster_profile({"cluster": reference}, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)
    recipe_file = write_recipe(tmp_path / "r.yaml", {"extends": "qwen3-tiny", "launch": {"cluster": reference}})
    result = run_cli("validate", str(recipe_file))
    assert_bad_input(result, "launch.cluster", message)


# ------------------------------------------------------------------------------------------------ rendering


def test_torchrun_command_shape(tmp_path):
    recipe = tiny(tmp_path, "launch.nodes=2", "launch.gpus_per_node=4", "parallel.ep=8")
    argv = torchrun_argv(recipe, Path("/runs/x"), host="node1", port=1234)
    assert argv == ["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "node1:1234", "--rdzv-id", "qwen3-moe-tiny", "-m", "moe_train.entry",
                    "--recipe", "/runs/x/recipe.yaml"]
    assert torchrun_argv(recipe, Path("/r"), preflight=True)[-1] == "--preflight"


def test_sbatch_script_structure(tmp_path):
    recipe = tiny(tmp_path, "launch.nodes=2", "launch.gpus_per_node=4", "launch.device=cuda", "launch.gpu=h100",
                  "parallel.ep=8", "launch.slurm.partition=gpu", "launch.slurm.time=04:00:00",
                  "launch.slurm.signal_seconds=300", "launch.slurm.max_restarts=5",
                  "launch.slurm.extra_sbatch=[--mem=0]", "launch.env={NCCL_DEBUG: WARN}",
                  "launch.setup=[module load cuda]")
    run_dir = tmp_path / "runs" / "r"
    text = render_sbatch(recipe, run_dir)
    directives = [line[len("#SBATCH "):] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert directives == [
        "--job-name=qwen3-moe-tiny", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4",
        "--cpus-per-task=56", "--partition=gpu",
        "--time=04:00:00", "--exclusive", f"--output={run_dir}/logs/slurm-%j.out", "--open-mode=append",
        "--signal=B:USR1@300", "--requeue", "--mem=0",
    ]
    # #SBATCH lines come before the first command; sbatch ignores directives after it.
    first_command = next(i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))
    for fragment in (
        'HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        "srun --nodes=\"$SLURM_JOB_NUM_NODES\" --ntasks-per-node=1",
        '--rdzv-endpoint "$HEAD_NODE:$RDZV_PORT"',
        '-m moe_train.entry --recipe "$RECIPE" ${RESTART[@]+"${RESTART[@]}"} &',
        "trap on_notice USR1",
        'scontrol requeue "$SLURM_JOB_ID"',
        '"$RESTARTS" -ge 5',
        "export NCCL_DEBUG=WARN",
        "\nmodule load cuda\n",
    ):
        assert fragment in text, fragment
    assert text.index("module load cuda") < text.index("srun ")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_preflight_script_is_short_and_never_requeues(tmp_path):
    recipe = tiny(tmp_path, "launch.slurm.time='48:00:00'")
    text = render_sbatch(recipe, tmp_path / "r", preflight=True)
    assert "#SBATCH --time=00:10:00" in text and "#SBATCH --no-requeue" in text
    assert "#SBATCH --job-name=qwen3-moe-tiny-preflight" in text
    assert "--signal" not in text and "scontrol requeue" not in text and "trap " not in text
    assert "--recipe \"$RECIPE\" --preflight &" in text and "/logs/preflight-%j.out" in text


def test_requeue_disabled_and_no_signal(tmp_path):
    text = render_sbatch(tiny(tmp_path, "launch.slurm.requeue=false"), tmp_path / "r")
    assert "#SBATCH --no-requeue" in text and "scontrol requeue" not in text and "requeue is false" in text
    text = render_sbatch(tiny(tmp_path, "launch.slurm.signal_seconds=0"), tmp_path / "r")
    assert "--signal" not in text and "trap " not in text


def sbatch_read(text: str) -> str:
    """Emulates sbatch's #SBATCH tokenizer on one option value (double quotes group, backslash escapes;
    the real sbatch is checked in test_slurm.py)."""
    out, escape, in_quotes = [], False, False
    for char in text:
        if escape:
            out.append(char)
            escape = False
        elif char == "\\":
            escape = True
        elif char == '"':
            in_quotes = not in_quotes
        else:
            assert in_quotes or not char.isspace(), f"unquoted space in {text!r}"
            out.append(char)
    assert not in_quotes and not escape
    return "".join(out)


@pytest.mark.parametrize("value", ["plain", "a b", 'q"uote', "back\\slash", "it's", "$(x) `y` ;z ${X}"])
def test_sbatch_value_reads_back_verbatim(value):
    assert sbatch_read(sbatch_value(value)) == value


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (r'launch.slurm.partition="a\nb"', "launch.slurm.partition"),
        (r'launch.slurm.job_name="x\r#SBATCH --y"', "launch.slurm.job_name"),
        (r'launch.slurm.extra_sbatch=["--mem=0\n#SBATCH --x"]', "launch.slurm.extra_sbatch.0"),
        ("launch.env={'BAD NAME': x}", "launch.env"),
        ("launch.env={'X;rm': x}", "launch.env"),
    ],
)
def test_unsafe_launch_values_exit_2_naming_the_field(tmp_path, override, field):
    for command in (["render", "-t", "slurm"], ["submit", "--dry-run"]):
        result = run_cli(*command, "qwen3-tiny", "--set", f"run_dir={tmp_path}/r", "--set", override)
        assert_bad_input(result, field)
    assert not (tmp_path / "r").exists()


def test_extra_sbatch_must_be_an_option(tmp_path):
    recipe = tiny(tmp_path, "launch.slurm.extra_sbatch=[mem=0]")
    with pytest.raises(LaunchError, match=r"extra_sbatch.0: 'mem=0' is not an sbatch option"):
        render_sbatch(recipe, tmp_path / "r")


# ------------------------------------------------------------------------ hostile values, executed for real


STAND_INS = {
    # srun: drop its own options, run the rest (the per-node command) as it would.
    "srun": """#!/bin/bash
        while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do printf '%s\\0' "$1" >> "$RECORD/srun.args"; shift; done
        exec "$@"
    """,
    "torchrun": """#!/bin/bash
        printf '%s\\0' "$@" > "$RECORD/torchrun.args"
        env -0 > "$RECORD/torchrun.env"
        exit "${STAND_IN_EXIT:-0}"
    """,
    "scontrol": """#!/bin/bash
        printf '%s\\0' "$@" >> "$RECORD/scontrol.args"; printf '\\n' >> "$RECORD/scontrol.calls"
        if [ "$1 $2" = "show hostnames" ]; then echo node-a; echo node-b; fi
    """,
}


def stand_in_bin(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(textwrap.dedent(body))
        (bin_dir / name).chmod(0o755)
    return bin_dir, record


def run_script(script: str, tmp_path: Path, bin_dir: Path, record: Path, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.sh"
    path.write_text(script)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "HOME": "/home-sentinel",
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_NUM_NODES": "2", **env}
    return subprocess.run(["bash", str(path)], cwd=work, env=full_env, capture_output=True, text=True, timeout=60)


def read_args(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def read_env(path: Path) -> dict[str, str]:
    return dict(item.split("=", 1) for item in path.read_bytes().decode().split("\0") if "=" in item)


def hostile_recipe(tmp_path: Path):
    run_dir = tmp_path / HOSTILE_PATH
    recipe_file = write_recipe(tmp_path / "hostile.yaml", {
        "extends": "qwen3-moe-tiny",
        "run_dir": str(run_dir),
        "launch": {
            "gpus_per_node": 2,
            "env": {"HOSTILE": HOSTILE, "EMPTY": ""},
            "slurm": {field: HOSTILE for field in ("partition", "account", "job_name", "qos", "constraint", "time",
                                                   "container_image")},
        },
    })
    return load_recipe(recipe_file), run_dir


def assert_nothing_ran(tmp_path: Path) -> None:
    assert not [p for p in tmp_path.rglob("PWNED*")], "a hostile value was executed"


def test_hostile_values_reach_the_job_verbatim_and_never_run(tmp_path):
    bin_dir, record = stand_in_bin(tmp_path)
    recipe, run_dir = hostile_recipe(tmp_path)
    run_dir = prepare_run_dir(recipe)
    script = render_sbatch(recipe, run_dir)
    result = run_script(script, tmp_path, bin_dir, record)
    assert result.returncode == 0, result.stderr
    assert_nothing_ran(tmp_path)
    args = read_args(record / "torchrun.args")
    assert args == ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"node-a:{20000 + 4242 % 20000}", "--rdzv-id", "4242", "-m", "moe_train.entry", "--recipe",
                    f"{run_dir}/recipe.yaml"]
    env = read_env(record / "torchrun.env")
    assert env["HOSTILE"] == HOSTILE and env["EMPTY"] == "" and env["MOE_TRAIN_RUN_DIR"] == str(run_dir)
    srun_args = read_args(record / "srun.args")
    assert f"--container-image={HOSTILE}" in srun_args and f"--container-mounts={run_dir}" in srun_args
    # #SBATCH lines: each value reads back verbatim through sbatch's quoting rules.
    directives = dict(line[len("#SBATCH --"):].split("=", 1) for line in script.splitlines()
                      if line.startswith("#SBATCH --") and "=" in line)
    for field in ("partition", "account", "job-name", "qos", "constraint", "time"):
        assert sbatch_read(directives[field]) == HOSTILE, field
    assert sbatch_read(directives["output"]) == str(run_dir).replace("%", "%%") + "/logs/slurm-%j.out"
    # Array scripts carry the same values, one run folder per task.
    array = render_array(recipe, [run_dir, tmp_path / "other dir"], tmp_path / HOSTILE_PATH)
    result = run_script(array, tmp_path, bin_dir, record, SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_JOB_ID="77")
    assert result.returncode == 0, result.stderr
    assert read_args(record / "torchrun.args")[-1] == f"{run_dir}/recipe.yaml"
    assert_nothing_ran(tmp_path)


def test_hostile_values_in_the_torchrun_snippet(tmp_path):
    bin_dir, record = stand_in_bin(tmp_path)
    recipe, run_dir = hostile_recipe(tmp_path)
    run_dir = prepare_run_dir(recipe)
    snippet = render_torchrun(recipe, run_dir, host=HOSTILE, port=29511, preflight=True)
    result = run_script(snippet, tmp_path, bin_dir, record)
    assert result.returncode == 0, result.stderr
    assert_nothing_ran(tmp_path)
    args = read_args(record / "torchrun.args")
    assert args[args.index("--rdzv-endpoint") + 1] == f"{HOSTILE}:29511"
    assert args[-2:] == [f"{run_dir}/recipe.yaml", "--preflight"]
    assert read_env(record / "torchrun.env")["HOSTILE"] == HOSTILE


# ------------------------------------------------------------------------------------ preemption and requeue


def requeue_case(tmp_path: Path, *, notice: bool, exit_code: int = 0, complete: bool = False, restarts: int = 0,
                 requeue: bool = True) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the job script with a stand-in step; the notice (USR1 to the batch shell) arrives while it runs."""
    bin_dir, record = stand_in_bin(tmp_path)
    (bin_dir / "torchrun").write_text(textwrap.dedent("""\
        #!/bin/bash
        while [ $# -gt 0 ] && [ "$1" != --recipe ]; do shift; done
        run_dir=$(dirname "$2")
        if [ "$NOTIFY" = 1 ]; then kill -USR1 "$PPID"; fi
        for _ in $(seq 100); do [ -e "$run_dir/PREEMPT" ] && break; [ "$NOTIFY" = 1 ] || break; sleep 0.05; done
        if [ "$MAKE_COMPLETE" = 1 ]; then touch "$run_dir/COMPLETE"; fi
        exit "$STAND_IN_EXIT"
    """))
    # srun here is a plain exec, so the stand-in's parent is the batch shell that holds the trap.
    recipe = tiny(tmp_path, f"launch.slurm.requeue={str(requeue).lower()}", "launch.slurm.max_restarts=2")
    run_dir = prepare_run_dir(recipe)
    result = run_script(render_sbatch(recipe, run_dir), tmp_path, bin_dir, record, NOTIFY=str(int(notice)),
                        STAND_IN_EXIT=str(exit_code), MAKE_COMPLETE=str(int(complete)),
                        SLURM_RESTART_COUNT=str(restarts))
    calls = read_args(record / "scontrol.args") if (record / "scontrol.args").exists() else []
    requeues = [calls[i + 1] for i, arg in enumerate(calls) if arg == "requeue"]
    return result, requeues


def test_notice_then_clean_exit_requeues_and_writes_the_notice_file(tmp_path):
    result, requeues = requeue_case(tmp_path, notice=True)
    assert requeues == ["4242"], result.stdout + result.stderr
    assert result.returncode == 0
    notice = tmp_path / "runs" / "r" / "PREEMPT"
    assert notice.read_text().startswith("preempt ") and "job 4242" in notice.read_text()
    assert "requeueing job 4242 (restart 1 of 2)" in result.stdout


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ({"notice": False}, None),  # exit_at_step or an ordinary end: no notice, no requeue
        ({"notice": True, "exit_code": 3}, "failed after the notice"),  # a crash never requeues
        ({"notice": False, "exit_code": 3}, None),
        ({"notice": True, "complete": True}, "the run is complete"),
        ({"notice": True, "restarts": 2}, "reached launch.slurm.max_restarts 2"),
        ({"notice": True, "requeue": False}, "requeue is false"),
    ],
)
def test_no_requeue_without_a_notice_clean_exit_or_restarts_left(tmp_path, case, reason):
    result, requeues = requeue_case(tmp_path, **case)
    assert requeues == [], result.stdout
    assert result.returncode == case.get("exit_code", 0)
    if reason:
        assert "not requeued: " in result.stdout and reason in result.stdout


def test_a_stale_notice_is_cleared_when_the_job_starts(tmp_path):
    recipe = tiny(tmp_path)
    run_dir = prepare_run_dir(recipe)
    (run_dir / "PREEMPT").write_text("old")
    bin_dir, record = stand_in_bin(tmp_path)
    result = run_script(render_sbatch(recipe, run_dir), tmp_path, bin_dir, record)
    assert result.returncode == 0 and not (run_dir / "PREEMPT").exists()
    assert not (record / "scontrol.args").read_bytes().count(b"requeue")


def test_a_requeued_job_must_resume_and_a_complete_run_does_not_start(tmp_path):
    """Restart 0 starts the entry as the recipe says; a requeued job (SLURM_RESTART_COUNT > 0) passes --restart
    (resume: required); a run folder holding COMPLETE exits 0 without starting any step."""
    recipe = tiny(tmp_path)
    run_dir = prepare_run_dir(recipe)
    script = render_sbatch(recipe, run_dir)
    bin_dir, record = stand_in_bin(tmp_path)
    entry_args = {}
    for restarts in (0, 1):
        result = run_script(script, tmp_path, bin_dir, record, SLURM_RESTART_COUNT=str(restarts))
        assert result.returncode == 0, result.stderr
        args = read_args(record / "torchrun.args")
        entry_args[restarts] = args[args.index("moe_train.entry") + 1:]
    assert entry_args == {0: ["--recipe", f"{run_dir}/recipe.yaml"],
                          1: ["--recipe", f"{run_dir}/recipe.yaml", "--restart"]}
    (record / "torchrun.args").unlink()
    (run_dir / "COMPLETE").write_text("step 8\n")
    result = run_script(script, tmp_path, bin_dir, record, SLURM_RESTART_COUNT="1")
    assert result.returncode == 0 and "not started: the run is complete" in result.stdout
    assert not (record / "torchrun.args").exists()


# --------------------------------------------------------------------------------------------------- sweeps


def test_grid_parsing_and_point_names():
    assert parse_axis("train.lr=1e-4,3e-4") .values == ("1e-4", "3e-4")
    assert parse_axis("data.weights=[0.5,0.5],[0.2,0.8]").values == ("[0.5,0.5]", "[0.2,0.8]")
    axes = parse_axes(["train.lr=3e-4", "parallel.ep=8"])
    assert point_name([("train.lr", "3e-4"), ("parallel.ep", "8")], axis_keys(axes)) == "lr-3e-4_ep-8"
    # Shared last components use the whole path; unsafe characters get a hash that keeps names distinct.
    assert axis_keys(parse_axes(["train.lr=1", "other.lr=2"])) == ["train.lr", "other.lr"]
    a = point_name([("data.weights", "[0.5,0.5]")], ["weights"])
    b = point_name([("data.weights", "[0.5, 0.5]")], ["weights"])
    assert a != b and re.fullmatch(r"[A-Za-z0-9.+=~_-]+", a) and "/" not in a
    assert point_name([("data.weights", "[0.5,0.5]")], ["weights"]) == a  # deterministic
    long = point_name([("train.lr", "1" * 300)], ["lr"])
    assert len(long) < 120
    for bad, message in [("train.lr", "expected dotted.path"), ("train.lr=1,1", "repeated"),
                         ("run_dir=a,b", "cannot be swept"), ("1x=2", "not a dotted field path")]:
        with pytest.raises(LaunchError, match=message):
            parse_axes([bad])
    with pytest.raises(LaunchError, match="given twice"):
        parse_axes(["train.lr=1", "train.lr=2"])


def test_sweep_expands_validates_and_lists_invalid_points(tmp_path):
    base = tmp_path / "sw"
    axes = parse_axes(["train.lr=1e-3,3e-3", "parallel.ep=1,2,3"])
    sweep_dir, points = expand("qwen3-moe-tiny", [f"run_dir={base}", "launch.gpus_per_node=2"], axes)
    assert sweep_dir == base
    assert [p.name for p in points] == ["lr-1e-3_ep-1", "lr-1e-3_ep-2", "lr-1e-3_ep-3", "lr-3e-3_ep-1",
                                        "lr-3e-3_ep-2", "lr-3e-3_ep-3"]
    assert [p.valid for p in points] == [True, True, False, True, True, False]
    assert any("num_experts" in line for line in points[2].problems)
    assert points[4].recipe.train.lr == 3e-3 and points[4].recipe.parallel.ep == 2
    assert points[4].recipe.run_dir == str(base / "lr-3e-3_ep-2")


def test_sweep_cli_dry_run_writes_nothing_and_default_writes_points(tmp_path):
    base = tmp_path / "sw"
    common = ["qwen3-moe-tiny", "--set", f"run_dir={base}", "--set", "launch.gpus_per_node=2",
              "--grid", "parallel.ep=1,2,3"]
    result = run_cli("sweep", *common, "--dry-run")
    assert result.code == 0, result.stderr
    assert "2 of 3 point(s) valid" in result.stdout and "must divide model.moe.num_experts" in result.stdout
    assert not base.exists()
    result = run_cli("sweep", *common)
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in base.iterdir()) == ["ep-1", "ep-2", "logs", "sweep.json"]
    assert read_run_recipe(base / "ep-2").parallel.ep == 2
    record = json.loads((base / "sweep.json").read_text())
    assert [p["valid"] for p in record["points"]] == [True, True, False]
    commands = [line for line in result.stdout.splitlines() if line.startswith("torchrun ")]
    assert [shlex.split(c)[-1] for c in commands] == [f"{base}/ep-1/recipe.yaml", f"{base}/ep-2/recipe.yaml"]
    assert_bad_input(run_cli("sweep", *common, "--dry-run", "--submit"), "exclude each other")
    assert_bad_input(run_cli("sweep", "qwen3-moe-tiny", "--grid", "parallel.ep"), "--grid parallel.ep")
    assert_bad_input(run_cli("sweep", "qwen3-moe-tiny", "--grid", "parallel.ep=16", "--dry-run", "--set",
                             "train.lr=-1"), "train.lr")
    assert_bad_input(run_cli("sweep", *common[:-2], "--grid", "parallel.ep=3"), "no valid point")


def test_sweep_array_script_groups_points_by_launch_shape(tmp_path):
    from moe_train.launch.sweep import launch_groups, submit_arrays

    axes = parse_axes(["launch.gpus_per_node=1,2", "train.lr=1e-3,2e-3"])
    sweep_dir, points = expand("qwen3-tiny", [f"run_dir={tmp_path / 'sw'}"], axes)
    assert [len(g) for g in launch_groups(points)] == [2, 2]
    jobs = submit_arrays(sweep_dir, points, max_parallel=3, dry_run=True)
    assert [j.script.name for j in jobs] == ["sweep-0.sbatch", "sweep-1.sbatch"]
    text = jobs[1].script.read_text()
    assert "#SBATCH --array=0-1%3" in text and "--nproc-per-node 2" in text
    assert f"RUN_DIRS=(\n  {sweep_dir}/gpus_per_node-2_lr-1e-3\n  {sweep_dir}/gpus_per_node-2_lr-2e-3\n)" in text
    assert f"--output={sweep_dir}/logs/slurm-%A_%a.out" in text


# ------------------------------------------------------------------------------------------------------ runs


def test_runs_lists_status_step_and_loss(tmp_path):
    root = tmp_path / "runs"
    for name in ("done", "stopped", "new", "queued"):
        prepare_run_dir(load_recipe("qwen3-tiny", [f"run_dir={root / name}"]))
    (root / "done" / "COMPLETE").write_text("")
    lines = [json.dumps({"kind": "train", "step": s, "loss": 5.0 - s / 10}) for s in range(1, 4)]
    (root / "stopped" / "metrics.jsonl").write_text("\n".join([*lines, json.dumps({"kind": "eval", "step": 3,
                                                                                    "loss": 9.0})]) + "\n")
    (root / "queued" / "submissions.jsonl").write_text(json.dumps({"job_id": "999999", "kind": "train"}) + "\n")
    statuses = {s.run_dir.name: s for s in collect(root)}
    assert statuses["done"].status == "complete"
    assert (statuses["stopped"].status, statuses["stopped"].step, statuses["stopped"].loss) == ("stopped", 3, 4.7)
    assert statuses["new"].status == "new"
    assert statuses["queued"].status == "submitted"  # no SLURM knows job 999999 here
    table = format_runs(list(statuses.values()), root)
    assert re.search(r"stopped\s+stopped\s+-\s+3\s+4\.7000", table)
    result = run_cli("runs", str(root))
    assert result.code == 0 and "complete" in result.stdout
    assert_bad_input(run_cli("runs", str(tmp_path / "nowhere")), "no such folder")


# --------------------------------------------------------------------------------------- the login-node side


def test_render_sweep_submit_runs_never_import_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from moe_train.cli.main import app
        for args in (["render", "qwen3-moe-tiny", "-t", "slurm", "-o", "{tmp_path}/job.sbatch",
                      "--set", "run_dir={tmp_path}/a"],
                     ["render", "qwen3-moe-tiny", "-t", "torchrun", "--set", "run_dir={tmp_path}/a"],
                     ["sweep", "qwen3-moe-tiny", "--grid", "train.lr=1e-3,2e-3", "--set", "run_dir={tmp_path}/s"],
                     ["submit", "qwen3-moe-tiny", "--dry-run", "--set", "run_dir={tmp_path}/b"],
                     ["runs", "{tmp_path}"]):
            try:
                app(args)
            except SystemExit as exit:
                assert exit.code in (0, None), (args, exit.code)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
        assert not loaded, loaded
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "job.sbatch").read_text().startswith("#!/bin/bash")


def test_bad_recipe_through_render_is_exit_2(tmp_path):
    assert_bad_input(run_cli("render", str(tmp_path / "nope.yaml")), "no such file")
    with pytest.raises(RecipeError):
        load_recipe("qwen3-tiny", ["launch.env={'1x': y}"])


def test_sbatch_directives_cpu_vs_cuda(tmp_path):
    cpu = sbatch_directives(tiny(tmp_path, "launch.gpus_per_node=2"), "/o")
    assert "--cpus-per-task=2" in cpu and not any(d.startswith("--gpus") for d in cpu)
    cuda = sbatch_directives(tiny(tmp_path, "launch.device=cuda", "launch.gpu=h100", "launch.gpus_per_node=8",
                                  "parallel.ep=8", "launch.slurm.exclusive=false"), "/o")
    assert "--gpus-per-node=8" in cuda and "--exclusive" not in cuda
