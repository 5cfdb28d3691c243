"""Issue 21, the GPU path, as far as the CPU can check it: the start-up API probe, collective buffers on the
training device, the two process-group timeouts. CUDA-only cases are skipped with their reason."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_train.config import load_recipe
from moe_train.parallel.bootstrap import LauncherEnv, launcher_problems
from moe_train.runtime import TESTED_TORCH, torch_problems
from moe_train.train import grad_norm
from moe_train.train.loop import Trainer

SHRINK = ["model.num_layers=2", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.precision=fp32", "logging.interval=1", "checkpoint.interval=null"]


def test_torch_probe_names_the_version_and_the_missing_api(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_problems() == []
    monkeypatch.delattr(dist, "reduce_scatter_single")
    (line,) = torch_problems()
    assert line == (f"torch {torch.__version__} lacks torch.distributed.reduce_scatter_single "
                    f"(moe-train is tested with torch {TESTED_TORCH})")
    recipe = load_recipe("qwen3-tiny")
    assert line in launcher_problems(recipe, LauncherEnv({}))  # so the entry stops with it, before a collective


def test_pyproject_states_the_tested_range() -> None:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'"torch{TESTED_TORCH}"' in text


class _Reduced(Exception):
    pass


def test_gradient_norm_sum_lives_on_the_training_device_without_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline rank with no counted gradient still all-reduces its (zero) sum: on ctx.device, never the CPU
    (NCCL takes no CPU tensor). meta stands in for cuda: any device that is not the CPU shows the rule."""
    seen = []

    def all_reduce(tensor, group=None):
        seen.append(tensor.device)
        raise _Reduced

    monkeypatch.setattr(grad_norm.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(grad_norm.dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(_Reduced):
        grad_norm.clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0, stage_group=object(),
                                 device=torch.device("meta"))
    assert seen == [torch.device("meta")]


def _timeout() -> timedelta:
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def test_startup_timeout_until_the_first_step_then_the_step_timeout(tmp_path: Path) -> None:
    t = Trainer(load_recipe("qwen3-tiny", [*SHRINK, "train.steps=2", f"run_dir={tmp_path}",
                                           "launch.startup_timeout_minutes=7", "launch.timeout_minutes=3"]))
    try:
        assert _timeout() == timedelta(minutes=7)
        t.train()
        assert _timeout() == timedelta(minutes=3)
        for mesh in (t.ctx.dense, t.ctx.expert):
            for name in mesh.mesh_dim_names:
                group = mesh.get_group(name)
                assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=3), name
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
