"""Train a few steps of a recipe on this rank and record what layouts are compared on: the loss of every step,
every gradient of the first step, every parameter and buffer after the last, as full (unsharded) tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from moe_train.config import load_recipe


def full(tensor: torch.Tensor) -> torch.Tensor:
    """An owned copy of the whole tensor. A DTensor's full_tensor() may be an async collective's output: wait for
    it before copying (copying first read the buffer before the gather had filled it, under load)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
        if isinstance(tensor, AsyncCollectiveTensor):
            tensor = tensor.wait()
    return tensor.detach().cpu().clone()


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, and every optimizer state tensor (`{param}/exp_avg` etc.), as full tensors:
    what a checkpoint holds of the model and optimizer, whatever the layout. Every rank must call it."""
    state = {k: full(v) for k, v in trainer.model.state_dict().items()}
    for name, param in trainer.model.named_parameters():
        for key, value in trainer.optimizer.state.get(param, {}).items():
            state[f"{name}/{key}"] = full(value)
    return state


def record_run(recipe_name: str, overrides: list[str], *, world: int, run_dir: Path, steps: int, ctx=None,
               prepare: Callable | None = None) -> dict:
    """{"losses", "grads" (step 1), "state" (after `steps`), "moe" (balance figures per step)}; every rank
    must call it (the full tensors are gathered collectively). `prepare(trainer)` runs before the first step."""
    from moe_train.train.loop import Trainer

    recipe = load_recipe(recipe_name, [*overrides, f"launch.gpus_per_node={world}", f"run_dir={run_dir}",
                                       f"train.steps={steps}"])
    trainer = Trainer(recipe, ctx)
    if prepare is not None:
        prepare(trainer)
    initial = {k: full(v) for k, v in trainer.model.state_dict().items()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def snapshot(optimizer, args, kwargs) -> None:
        if not grads:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    grads[names[id(p)]] = full(p.grad)

    trainer.optimizer.register_step_pre_hook(snapshot)
    losses, balance = [], []
    for step in range(1, steps + 1):
        result = trainer.train_step(step)
        losses.append(result.loss)
        balance.append(result.moe)
    state = {k: full(v) for k, v in trainer.model.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state, "moe": balance, "initial": initial}


def record_resumed(recipe_name: str, overrides: list[str], *, world: int, run_dir: Path, steps: int,
                   stop_at: int) -> dict:
    """Train to `stop_at` (checkpoint, exit), resume in a new Trainer and finish: the final state and the
    metrics the logging rank wrote, to compare with an uninterrupted run."""
    from moe_train.train.loop import Trainer

    base = [*overrides, f"launch.gpus_per_node={world}", f"run_dir={run_dir}", f"train.steps={steps}"]
    Trainer(load_recipe(recipe_name, [*base, f"train.exit_at_step={stop_at}"])).train()
    resumed = Trainer(load_recipe(recipe_name, [*base, "checkpoint.resume=required"]))
    started = resumed.progress.step
    resumed.train()
    return {"started": started, "state": {k: full(v) for k, v in resumed.model.state_dict().items()}}


def keep_record(record: dict, *, run_root: Path, case_id: str, rank: int, saved: dict[str, str]) -> None:
    """Rank 0 saves a case's record beside the runs (too large for the JSON result) and notes its path."""
    if rank == 0:
        path = run_root / f"{case_id}.pt"
        torch.save(record, path)
        saved[case_id] = str(path)
