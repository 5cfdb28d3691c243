"""The tools people expect (issue 24): --version, shell completion, the runs table, report --compare, data
prepare from parquet and datasets folders, and W&B offline logging; each as a user runs it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from cli_helpers import assert_bad_input, run_cli
from helpers import SHRINK_CLI, read_metrics, sets

import moe_train
from moe_train.config import load_recipe
from moe_train.data.indexed import IndexedDataset
from moe_train.launch.rundir import prepare_run_dir
from moe_train.launch.runs import launched_at

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["Hello, world.", "Zweites Dokument: äöü ß", "", "line one\nline two\n", "emoji \U0001f600 end"]


# The installed console script, as a shell calls it (completion is keyed on the program's name).
MOE_TRAIN = str(Path(sys.executable).parent / "moe-train")


def moe_train_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MOE_TRAIN, *args], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)


# ------------------------------------------------------------------------------------- version, completion


def test_version_prints_the_package_version():
    result = run_cli("--version")
    assert result.code == 0 and result.stdout.strip() == f"moe-train {moe_train.__version__}"


@pytest.mark.slow
def test_completion_shows_and_installs_for_bash(tmp_path):
    shown = moe_train_cli("--show-completion", "bash")
    assert shown.returncode == 0, shown.stderr
    assert "_moe_train_completion" in shown.stdout and "complete " in shown.stdout
    env = dict(os.environ, HOME=str(tmp_path), SHELL="/bin/bash")
    installed = moe_train_cli("--install-completion", "bash", env=env)
    assert installed.returncode == 0, installed.stderr
    script = tmp_path / ".bash_completions" / "moe-train.sh"
    assert "_moe_train_completion" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text() or ".bash_completions/moe-train.sh" in \
        (tmp_path / ".bashrc").read_text()
    # What the shell then asks: the completions of `moe-train re`.
    env = dict(os.environ, _MOE_TRAIN_COMPLETE="complete_bash", COMP_WORDS="moe-train re", COMP_CWORD="1")
    completed = moe_train_cli(env=env)
    assert set(completed.stdout.split()) == {"recipes", "render", "report"}, completed


# ------------------------------------------------------------------------------------------------ runs


def test_runs_table_shows_elapsed_and_tokens_per_s(tmp_path):
    root = tmp_path / "runs"
    run_dir = prepare_run_dir(load_recipe("qwen3-tiny", [f"run_dir={root / 'a'}"]))
    prepare_run_dir(load_recipe("qwen3-tiny", [f"run_dir={root / 'b'}"]))
    record = {"kind": "train", "step": 7, "loss": 3.25, "tokens_per_s": 12345.6}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    started = launched_at(run_dir)
    assert started is not None and abs(started - datetime.now().timestamp()) < 600
    os.utime(run_dir / "metrics.jsonl", (started + 3725, started + 3725))  # last line 1 h 2 min 5 s after launch
    result = run_cli("runs", str(root))
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["run", "status", "job", "step", "loss", "elapsed", "tokens/s"]
    assert lines[1].split() == ["a", "stopped", "-", "7", "3.2500", "1h02m", "12,346"]
    assert lines[2].split() == ["b", "new", "-", "-", "-", "-", "-"]


# ---------------------------------------------------------------------------------------------- report


def write_metrics(folder: Path, losses: list[float], tokens_per_s: float) -> Path:
    folder.mkdir(parents=True)
    (folder / "COMPLETE").write_text("")
    lines = [{"kind": "train", "step": step, "loss": loss, "lm_loss": loss, "tokens": 64 * step,
              "tokens_per_s": tokens_per_s, "mfu": 0.1, "skipped": 0} for step, loss in enumerate(losses, 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_report_compare_overlays_runs_in_one_png(tmp_path):
    fast = write_metrics(tmp_path / "fast", [5.0, 4.0, 3.5], 2000.0)
    slow = write_metrics(tmp_path / "other" / "slow", [5.0, 4.5, 4.2, 4.0], 900.0)
    out = tmp_path / "cmp"
    result = run_cli("report", "--compare", str(fast), str(slow), "-o", str(out))
    assert result.code == 0, result.stderr
    assert f"plot: {out / 'compare.png'}" in result.stdout
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:3]}
    assert rows["fast"][1:3] == ["3", "3.5000"] and rows["slow"][1:3] == ["4", "4.0000"]
    from moe_train.report.compare import compare_figure, load_compared

    loss_axes, tokens_axes = compare_figure(load_compared([fast, slow])).axes
    assert [line.get_label() for line in loss_axes.lines] == ["fast", "slow"]
    assert list(tokens_axes.lines[1].get_ydata()) == [900.0] * 4


def test_report_compare_bad_input(tmp_path):
    run = write_metrics(tmp_path / "a", [5.0], 1.0)
    assert_bad_input(run_cli("report", "--compare", str(run)), "--compare: give at least two run folders")
    assert_bad_input(run_cli("report", "--compare", str(run), str(tmp_path / "nope")), "nope: no such folder")
    assert_bad_input(run_cli("report", "--compare", str(run), str(tmp_path)), "no metrics.jsonl")
    assert_bad_input(run_cli("report", str(run), str(run)), "several with --compare")


# --------------------------------------------------------------------------------------------- data prepare


@pytest.fixture
def tables(tmp_path):
    """The same documents as JSONL, parquet (two row groups) and a saved datasets folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": text, "n": i}) + "\n" for i, text in enumerate(TEXTS)))
    table = pa.table({"body": TEXTS, "n": list(range(len(TEXTS)))})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=2)
    datasets.Dataset.from_dict({"body": TEXTS, "n": list(range(len(TEXTS)))}).save_to_disk(tmp_path / "hf")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": TEXTS})}).save_to_disk(tmp_path / "hfdict")
    return {"jsonl": str(jsonl), "parquet": str(tmp_path / "docs.parquet"), "hf": str(tmp_path / "hf"),
            "hfdict": str(tmp_path / "hfdict")}


def documents(prefix: Path) -> list[list[int]]:
    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_prepare_parquet_and_datasets_folder_equal_jsonl(tmp_path, tables):
    for name in ("jsonl", "parquet", "hf"):
        result = run_cli("data", "prepare", tables[name], "-o", str(tmp_path / name), "--text-column", "body")
        assert result.code == 0, result.stderr
        assert "4 documents, 1 empty skipped" in result.stdout, result.stdout
    expected = documents(tmp_path / "jsonl")
    assert len(expected) == 4 and expected[0] == list(b"Hello, world.") + [256]
    assert documents(tmp_path / "parquet") == expected and documents(tmp_path / "hf") == expected
    both = run_cli("data", "prepare", tables["parquet"], tables["hf"] + "/", "-o", str(tmp_path / "both"),
                   "--text-field", "body")
    assert both.code == 0 and documents(tmp_path / "both") == expected + expected
    split = run_cli("data", "prepare", tables["hfdict"] + "/train", "-o", str(tmp_path / "split"),
                    "--text-column", "body")
    assert split.code == 0 and documents(tmp_path / "split") == expected


def test_prepare_tables_bad_input(tmp_path, tables):
    out = str(tmp_path / "out")
    assert_bad_input(run_cli("data", "prepare", tables["parquet"], "-o", out),
                     f'{tables["parquet"]}: no "text" column (columns: body, n; choose it with --text-field)')
    assert_bad_input(run_cli("data", "prepare", tables["hf"], "-o", out), 'no "text" column (columns: body, n')
    assert_bad_input(run_cli("data", "prepare", tables["parquet"], "-o", out, "--text-column", "n"),
                     'row 1: column "n" is int, not a string')
    assert_bad_input(run_cli("data", "prepare", tables["hfdict"], "-o", out, "--text-column", "body"),
                     "holds the splits train; give one split's folder")
    assert_bad_input(run_cli("data", "prepare", str(tmp_path), "-o", out), "not one written by datasets")
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    assert_bad_input(run_cli("data", "prepare", str(broken), "-o", out), "broken.parquet: not a readable parquet")
    assert not list(tmp_path.glob("out*"))


# ------------------------------------------------------------------------------------------------- W&B


def wandb_records(path: Path) -> list:
    """The records of an offline .wandb file (a LevelDB-style log of protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, position, block = path.read_bytes(), [], b"", 7, 32768
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
def test_wandb_offline_logs_every_step_into_the_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="", OMP_NUM_THREADS="1")  # the recipe's mode decides, not the caller's
    env.pop("WANDB_MODE")
    result = subprocess.run([sys.executable, "-m", "moe_train.cli.main", "run", "qwen3-tiny",
                             *sets(*SHRINK_CLI, "train.steps=4", "train.exit_at_step=3", f"run_dir={run_dir}",
                                   "logging.wandb={project: moe-test, mode: offline}")],
                            capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    (offline,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
               for r in wandb_records(offline) if r.WhichOneof("record_type") == "history"]
    logged = read_metrics(run_dir, "train")
    assert [h["_step"] for h in history] == [r["step"] for r in logged] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == [r["loss"] for r in logged]
    assert [h["train/tokens_per_s"] for h in history] == [r["tokens_per_s"] for r in logged]
    # A continued run with W&B switched off is the same run (logging.wandb is an ignored field).
    again = run_cli("run", "qwen3-tiny", *sets(*SHRINK_CLI, "train.steps=4", f"run_dir={run_dir}"))
    assert again.code == 0, again.stderr
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2, 3, 4]
