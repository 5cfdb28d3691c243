"""The checkpoint folder under real SIGKILLs: `latest` always names a complete checkpoint, pruning and saving a
step again never lose the one a resume would read.

A driver process (tests/publish_driver.py) runs the real `publish`/`prune` (or a whole save) and pauses after each
rename and deletion (and before a save's manifest); the test kills it there with SIGKILL and inspects what is on
disk, then resumes from it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from moe_train.checkpoint import layout
from moe_train.checkpoint.layout import LATEST, is_complete, latest_checkpoint, tmp_dir
from moe_train.checkpoint.resume import start_point
from moe_train.checkpoint.save import save_checkpoint
from moe_train.checkpoint.state import Progress, load_training_state, save_training_state

DRIVER = Path(__file__).with_name("publish_driver.py")


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def write_tmp(ckpt_dir: Path, step: int, consumed: int) -> Path:
    """A complete, unpublished save of `step`; `consumed` tells one save of a step from another."""
    model, optimizer = model_and_optimizer()
    tmp = tmp_dir(ckpt_dir, step)
    save_training_state(tmp, chunks=[model], optimizers=[optimizer],
                        progress=Progress(step=step, consumed_samples=consumed))
    return tmp


def published(ckpt_dir: Path, *steps: int, latest: int | None = None) -> None:
    for step in steps:
        layout.publish(write_tmp(ckpt_dir, step, consumed=step), step=step)
    if latest is not None:
        (ckpt_dir / LATEST).write_text(f"step-{latest:07d}\n")


def resumed_progress(ckpt_dir: Path) -> Progress | None:
    """What `resume: auto` would continue from, loaded for real."""
    start = start_point(ckpt_dir=ckpt_dir, resume="auto", init_from=None).resume_from
    if start is None:
        return None
    model, optimizer = model_and_optimizer()
    return load_training_state(start, chunks=[model], optimizers=[optimizer])


def step_folders(ckpt_dir: Path) -> dict[str, bool]:
    """Every `step-*` folder and whether it is complete."""
    return {p.name: is_complete(p) for p in sorted(ckpt_dir.glob("step-*"))}


def run_driver(*args: str, kill_at: str | None) -> list[str]:
    """Run the driver, answering each pause until an event starting with `kill_at`; SIGKILL it there."""
    # The driver imports the same moe_train as this test (a mutation run's copy included).
    env = {**os.environ, "PYTHONPATH": str(Path(layout.__file__).parents[2])}
    process = subprocess.Popen([sys.executable, str(DRIVER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, start_new_session=True, env=env)
    watchdog = threading.Timer(60, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    events: list[str] = []
    try:
        for line in process.stdout:
            events.append(line.strip())
            if kill_at is not None and events[-1].startswith(kill_at):
                process.kill()
                assert process.wait(timeout=10) == -signal.SIGKILL
                return events
            if events[-1] == "done":
                break
            process.stdin.write("\n")
            process.stdin.flush()
        assert process.wait(timeout=10) == 0, events
        assert kill_at is None, f"never reached {kill_at!r}: {events}"
        return events
    finally:
        watchdog.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow
def test_killed_between_writing_a_step_and_updating_latest(tmp_path: Path) -> None:
    published(tmp_path, 1)
    write_tmp(tmp_path, 2, consumed=2)
    events = run_driver("publish", str(tmp_path), "2", kill_at="replace .tmp-step-0000002 step-0000002")
    assert events == ["replace .tmp-step-0000002 step-0000002"]
    assert step_folders(tmp_path) == {"step-0000001": True, "step-0000002": True}
    assert latest_checkpoint(tmp_path) == tmp_path / "step-0000001"  # step 2 was never named
    assert resumed_progress(tmp_path) == Progress(step=1, consumed_samples=1)
    model, optimizer = model_and_optimizer()  # the resumed run saves step 2 again
    save_checkpoint(tmp_path, chunks=[model], optimizers=[optimizer],
                    progress=Progress(step=2, consumed_samples=22),
                    model_config={}, keep=2)
    assert resumed_progress(tmp_path) == Progress(step=2, consumed_samples=22)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000001", "step-0000002"]


# Saving step 2 again while `latest` names the old step 2: the driver's events, in order.
OVERWRITE_EVENTS = [
    "replace tmp:latest latest",  # latest moved back to step 1 before the old step 2 goes
    "replace step-0000002 .tmp-removing-step-0000002",
    "rmtree .tmp-removing-step-0000002",
    "replace .tmp-step-0000002 step-0000002",
    "replace tmp:latest latest",
]


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", range(len(OVERWRITE_EVENTS)))
def test_killed_while_saving_a_step_again(tmp_path: Path, kill_after: int) -> None:
    """Between removing the old step 2 and putting the new one in its place, a resume still finds step 1."""
    published(tmp_path, 1, 2)
    write_tmp(tmp_path, 2, consumed=20)
    events = run_driver("publish", str(tmp_path), "2", kill_at=None if kill_after == len(OVERWRITE_EVENTS) - 1
                        else OVERWRITE_EVENTS[kill_after])
    assert events[: kill_after + 1] == OVERWRITE_EVENTS[: kill_after + 1]
    assert all(step_folders(tmp_path).values())  # no half-deleted step folder that looks complete
    expected = Progress(step=2, consumed_samples=20) if kill_after == 4 else Progress(step=1, consumed_samples=1)
    assert resumed_progress(tmp_path) == expected  # never the old step 2, never a fresh start
    model, optimizer = model_and_optimizer()
    save_checkpoint(tmp_path, chunks=[model], optimizers=[optimizer],
                    progress=Progress(step=2, consumed_samples=21),
                    model_config={}, keep=2)
    assert resumed_progress(tmp_path) == Progress(step=2, consumed_samples=21)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000001", "step-0000002"]


@pytest.mark.slow
def test_saving_the_only_checkpoint_again_killed_midway_starts_over_honestly(tmp_path: Path) -> None:
    """No earlier checkpoint: `latest` is removed before the old folder goes (a fresh start, never a dangling name)."""
    published(tmp_path, 1)
    write_tmp(tmp_path, 1, consumed=10)
    run_driver("publish", str(tmp_path), "1", kill_at="rmtree .tmp-removing-step-0000001")
    assert not (tmp_path / LATEST).exists() and step_folders(tmp_path) == {}
    assert resumed_progress(tmp_path) is None
    with pytest.raises(layout.CheckpointError, match="required"):
        start_point(ckpt_dir=tmp_path, resume="required", init_from=None)


def test_pruning_never_deletes_what_latest_names(tmp_path: Path) -> None:
    published(tmp_path, 1, 2, 3, 4, latest=2)  # a run resumed from step 2 by path
    assert layout.prune(tmp_path, keep=1) == [tmp_path / "step-0000001", tmp_path / "step-0000003"]
    assert step_folders(tmp_path) == {"step-0000002": True, "step-0000004": True}
    assert latest_checkpoint(tmp_path) == tmp_path / "step-0000002"


@pytest.mark.slow
def test_pruning_killed_midway_leaves_only_complete_steps(tmp_path: Path) -> None:
    published(tmp_path, 1, 2, 3)
    run_driver("prune", str(tmp_path), "1", kill_at="replace step-0000002 .tmp-removing-step-0000002")
    assert step_folders(tmp_path) == {"step-0000003": True}  # step 1 gone, step 2 renamed out of the way
    assert resumed_progress(tmp_path) == Progress(step=3, consumed_samples=3)
    model, optimizer = model_and_optimizer()
    save_checkpoint(tmp_path, chunks=[model], optimizers=[optimizer], progress=Progress(step=4), model_config={},
                    keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000004"]


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    for consumed in (5, 6):
        save_checkpoint(tmp_path, chunks=[model], optimizers=[optimizer], model_config={"save": consumed}, keep=2,
                        progress=Progress(step=3, consumed_samples=consumed))
    assert resumed_progress(tmp_path) == Progress(step=3, consumed_samples=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000003"]


def test_pruning_counts_only_complete_checkpoints(tmp_path: Path) -> None:
    """A `step-*` folder without DCP's .metadata (a copy still arriving) is neither kept in place of one nor removed."""
    published(tmp_path, 1, 2, 3)
    (tmp_path / "step-0000004").mkdir()
    assert layout.prune(tmp_path, keep=2) == [tmp_path / "step-0000001"]
    assert step_folders(tmp_path) == {"step-0000002": True, "step-0000003": True, "step-0000004": False}


def test_latest_naming_an_incomplete_or_missing_folder_is_not_trusted(tmp_path: Path) -> None:
    published(tmp_path, 1, 2)
    (tmp_path / "step-0000002" / ".metadata").unlink()  # a shard store damaged by hand
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / LATEST).write_text("step-0000009\n")
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / LATEST).write_text("step-0000001\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-0000001"


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["manifest .tmp-step-0000002", "replace tmp:manifest.json manifest.json"])
def test_a_save_killed_before_or_as_its_manifest_is_written_is_never_resumed_from(tmp_path: Path, kill_at: str) -> None:
    """A real save_checkpoint killed with its DCP files on disk, before the manifest (or right as it lands): the
    folder is still `.tmp-*`, so a resume continues from the earlier checkpoint, and saving the step again
    replaces what the kill left."""
    model, optimizer = model_and_optimizer()  # what the driver saves too
    save_checkpoint(tmp_path, chunks=[model], optimizers=[optimizer],
                    progress=Progress(step=1, consumed_samples=1), model_config={}, keep=None)
    events = run_driver("save", str(tmp_path), "2", kill_at=kill_at)
    assert events[-1] == kill_at
    partial = tmp_dir(tmp_path, 2)
    assert is_complete(partial)  # DCP's part finished: only the manifest and the publishing are missing
    assert step_folders(tmp_path) == {"step-0000001": True}
    assert resumed_progress(tmp_path) == Progress(step=1, consumed_samples=1)
    save_checkpoint(tmp_path, chunks=[model], optimizers=[optimizer],
                    progress=Progress(step=2, consumed_samples=2), model_config={}, keep=None)
    assert resumed_progress(tmp_path) == Progress(step=2, consumed_samples=2) and not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000001", "step-0000002"]


# A background save of step 2 (checkpoint.async_save): the pauses in order. `staged` is the main thread's (training
# goes on while DCP writes); the rest are the background thread's, after the write.
ASYNC_EVENTS = ["staged", "manifest .tmp-step-0000002", "replace tmp:manifest.json manifest.json",
                "replace .tmp-step-0000002 step-0000002", "replace tmp:latest latest"]


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [*ASYNC_EVENTS, None])
def test_a_background_save_killed_at_any_point_never_leaves_latest_naming_it_incomplete(
        tmp_path: Path, kill_at: str | None) -> None:
    """SIGKILL while the state is staged and the write runs, before the manifest, as it lands, after the rename and
    after `latest` moved: `latest` names a complete checkpoint every time, and it is step 2 (as staged, not as
    trained on afterwards) only once `latest` moved."""
    model, optimizer = model_and_optimizer()  # what the driver trains and stages too
    save_checkpoint(tmp_path, chunks=[model], optimizers=[optimizer],
                    progress=Progress(step=1, consumed_samples=1), model_config={}, keep=None)
    events = run_driver("async_save", str(tmp_path), "2", kill_at=kill_at)
    assert events[:len(ASYNC_EVENTS)] == ASYNC_EVENTS[:len(events)] and "staged" in events
    assert is_complete(latest_checkpoint(tmp_path))
    moved = kill_at in (None, ASYNC_EVENTS[-1])
    assert resumed_progress(tmp_path) == (Progress(step=2, consumed_samples=2) if moved else
                                          Progress(step=1, consumed_samples=1))
    if moved:
        restored, restored_optimizer = model_and_optimizer()
        with torch.no_grad():
            restored.weight.zero_()
        load_training_state(latest_checkpoint(tmp_path), chunks=[restored], optimizers=[restored_optimizer])
        assert torch.equal(restored.weight, model.weight)  # the staged weights, not the ones changed after staging
    save_checkpoint(tmp_path, chunks=[model], optimizers=[optimizer],
                    progress=Progress(step=2, consumed_samples=22), model_config={}, keep=None)
    assert resumed_progress(tmp_path) == Progress(step=2, consumed_samples=22)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000001", "step-0000002"]
