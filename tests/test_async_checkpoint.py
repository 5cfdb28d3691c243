"""`checkpoint.async_save: true` (issue 24): interval checkpoints staged to host memory and written in the
background. What it saves is what a synchronous save saves, bit for bit, though training moves on while the
write runs; a resume from it continues the run exactly; on 2 gloo ranks (the dedicated gloo group) too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from helpers import SHRINK_CLI, read_metrics, sets
from processes import run_bounded
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from moe_train.checkpoint.layout import latest_checkpoint

STEPS = ["train.steps=4", "checkpoint.interval=1", "checkpoint.keep=null"]


def saved_tensors(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, flattened to dotted keys."""
    out = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        else:
            flat[prefix.rstrip(".")] = value

    walk("", torch.load(out, weights_only=True))
    return flat


def numbers(run_dir: Path) -> list[dict]:
    """The train lines without the timings and the process's memory, which differ from run to run."""
    timed = ("tokens_per_s", "tflops_per_device", "mfu", "memory_bytes")
    return [{k: v for k, v in r.items() if k not in timed} for r in read_metrics(run_dir, "train")]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> Path:
    """The single process with synchronous saves: what both tests compare with (one run for the two)."""
    run_dir = tmp_path_factory.mktemp("sync")
    result = run_cli("run", "qwen3-moe-tiny", *sets(*SHRINK_CLI, *STEPS, "checkpoint.async_save=false",
                                                     f"run_dir={run_dir}"))
    assert result.code == 0, result.stderr
    return run_dir


@pytest.mark.slow
def test_async_saves_equal_sync_saves_and_resume_the_same(tmp_path: Path, sync_run: Path) -> None:
    runs = {"sync": sync_run, "async": tmp_path / "async"}
    result = run_cli("run", "qwen3-moe-tiny", *sets(*SHRINK_CLI, *STEPS, "checkpoint.async_save=true",
                                                     f"run_dir={runs['async']}"))
    assert result.code == 0, result.stderr
    assert "checkpoint staged, writing in the background" in result.stdout
    assert result.stdout.count("checkpoint staged") == 3 and "checkpoint saved" in result.stdout  # the last: sync
    for step in (1, 2, 3, 4):
        name = f"step-{step:07d}"
        sync, background = (saved_tensors(runs[k] / "checkpoints" / name, tmp_path) for k in ("sync", "async"))
        assert sorted(sync) == sorted(background) and any(k.startswith("optim.") for k in sync)
        for key, value in sync.items():
            assert torch.equal(background[key], value), (name, key)
    assert latest_checkpoint(runs["async"] / "checkpoints").name == "step-0000004"
    assert numbers(runs["async"]) == numbers(runs["sync"])
    # A new run resumed from the background save of step 2 trains steps 3 and 4 as the uninterrupted run did.
    resumed, step_2 = tmp_path / "resumed", runs["async"] / "checkpoints" / "step-0000002"
    result = run_cli("run", "qwen3-moe-tiny", *sets(*SHRINK_CLI, *STEPS, f"run_dir={resumed}",
                                                     f"checkpoint.resume={step_2}"))
    assert result.code == 0, result.stderr
    sync_losses = [r["loss"] for r in read_metrics(runs["sync"], "train")]
    assert [r["loss"] for r in read_metrics(resumed, "train")] == sync_losses[2:]


@pytest.mark.slow
def test_async_save_on_two_gloo_ranks_equals_one_rank(tmp_path: Path, sync_run: Path) -> None:
    """Two ranks through torchrun: the background write runs DCP and the manifest on its own gloo group."""
    one, two = sync_run, tmp_path / "two"
    done = run_bounded([sys.executable, "-m", "moe_train.cli.main", "run", "qwen3-moe-tiny", "--nproc", "2",
                        *sets(*SHRINK_CLI, *STEPS, "checkpoint.async_save=true", f"run_dir={two}")], timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "checkpoint staged, writing in the background" in done.stdout
    for step in (1, 2, 3):
        name = f"step-{step:07d}"
        single, parallel = (saved_tensors(run / "checkpoints" / name, tmp_path) for run in (one, two))
        model = [key for key in single if key.startswith("model.")]
        assert model and all(key in parallel for key in model)
        assert torch.equal(parallel["progress.step"], single["progress.step"])
        for key in model:  # gradients summed in another order: ~1e-7 apart; one more step would be ~1e-3
            torch.testing.assert_close(parallel[key], single[key], rtol=0, atol=1e-5, msg=key)


def test_background_saves_stage_into_the_same_host_buffers_and_hold_each_saves_values(tmp_path: Path) -> None:
    """The staging copy is allocated by the first background save and reused by the next (a fresh 1.5 GB copy per
    save cost the 125M proxy ~1 s of stall zeroing pages); each save still writes the values it staged."""
    from moe_train.checkpoint.async_save import Checkpointer
    from moe_train.checkpoint.state import Progress, load_training_state

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer, staged = Checkpointer(tmp_path, keep=None), []
    write = checkpointer._write
    checkpointer._write = lambda state, *args: (staged.append(state), write(state, *args))[1]
    weights = []
    for step in (1, 2):
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        weights.append(model.weight.detach().clone())
        checkpointer.save(chunks=[model], optimizers=[optimizer], progress=Progress(step=step), model_config={},
                          background=True)
    checkpointer.close()
    first, second = ({key: value.data_ptr() for key, value in state["model"].items()} for state in staged)
    assert first == second and first["weight"] != model.weight.data_ptr()
    for step, weight in zip((1, 2), weights, strict=True):
        restored = torch.nn.Linear(8, 8)
        load_training_state(tmp_path / f"step-{step:07d}", chunks=[restored],
                            optimizers=[torch.optim.AdamW(restored.parameters())])
        assert torch.equal(restored.weight, weight)
