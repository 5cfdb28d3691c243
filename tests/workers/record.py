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


def _merged_over_stages(trainer, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`local` (this rank's tensors by name) merged over the pipeline stages (collective). A tensor two stages
    hold (the last stage's copy of the embedding) must be bit-equal on both."""
    import torch.distributed as dist

    if trainer.ctx.size("pp") == 1:
        return local
    stages: list[dict] = [{} for _ in range(trainer.ctx.size("pp"))]
    dist.all_gather_object(stages, local, group=trainer.ctx.group("pp"))
    return _one_per_key((key, value) for stage in stages for key, value in stage.items())


def _one_per_key(items) -> dict[str, torch.Tensor]:
    """(name, tensor) pairs by name; a name given twice (two stages' copies) must hold bit-equal tensors."""
    merged: dict[str, torch.Tensor] = {}
    for key, value in items:
        if key in merged and not torch.equal(merged[key], value):
            raise AssertionError(f"{key}: the stages' copies differ")
        merged[key] = value
    return merged


def whole_state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model as full tensors, from every pipeline stage (collective); the
    copies of one tensor on one rank (a V's embedding and the last stage's) checked bit-equal too."""
    return _merged_over_stages(trainer, _one_per_key((k, full(v)) for part in trainer.chunks
                                                     for k, v in part.state_dict().items()))


def fp8_gathering(trainer) -> dict[str, int]:
    """How many parameters FSDP2 gathers in fp8 (train.fp8.fp8_all_gather), and how many state-dict entries are
    not plain tensors (a checkpoint must see none)."""
    from moe_train.models.fp8.all_gather import gathered_in_fp8

    def plain(value: torch.Tensor) -> bool:
        return type(value.to_local() if isinstance(value, DTensor) else value) in (torch.Tensor, torch.nn.Parameter)

    return {"gathered": sum(gathered_in_fp8(p) for part in trainer.chunks for p in part.parameters()),
            "not_plain": sum(not plain(v) for part in trainer.chunks for v in part.state_dict().values())}


def full_state(trainer) -> dict[str, torch.Tensor]:
    """`whole_state` and every optimizer state tensor (`{param}/exp_avg` etc.) as full tensors: what a checkpoint
    holds of the model and optimizer, whatever the layout (collective)."""
    optimizer_state = _one_per_key((f"{name}/{key}", full(value))
                                   for part, optimizer in zip(trainer.chunks, trainer.optimizers, strict=True)
                                   for name, param in part.named_parameters()
                                   for key, value in optimizer.state.get(param, {}).items())
    return {**whole_state(trainer), **_merged_over_stages(trainer, optimizer_state)}


def whole_grads(trainer, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's gradients by name, merged over the pipeline stages (collective)."""
    import torch.distributed as dist

    if trainer.ctx.size("pp") == 1:
        return grads
    stages: list[dict] = [{} for _ in range(trainer.ctx.size("pp"))]
    dist.all_gather_object(stages, grads, group=trainer.ctx.group("pp"))
    return {key: value for stage in stages for key, value in stage.items()}


def record_run(recipe_name: str, overrides: list[str], *, world: int, run_dir: Path, steps: int, ctx=None,
               prepare: Callable | None = None, evaluate: bool = False) -> dict:
    """{"losses", "grads" (step 1), "state" (after `steps`), "moe" (balance figures per step), "moe_ranks" (the
    per-rank load per step), "eval" (the
    validation loss after the last step, when `evaluate`), "meshes" (this rank's parameters' mesh dimensions),
    "fp8_gemms" (this rank's fp8 GEMMs by "kind/product/mode"), "fp8_gathering" (`fp8_gathering`)};
    every rank must call it (the full tensors are gathered collectively). `prepare(trainer)` runs before the
    first step."""
    from moe_train.train.loop import Trainer

    nodes = next((int(o.split("=")[1]) for o in overrides if o.startswith("launch.nodes=")), 1)  # emulated
    recipe = load_recipe(recipe_name, [*overrides, f"launch.gpus_per_node={world // nodes}", f"run_dir={run_dir}",
                                       f"train.steps={steps}"])
    trainer = Trainer(recipe, ctx)
    if prepare is not None:
        prepare(trainer)
    initial = whole_state(trainer)
    names = {id(p): n for part in trainer.chunks for n, p in part.named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    snapshots = {"taken": 0}

    def snapshot(optimizer, args, kwargs) -> None:
        if snapshots["taken"] < len(trainer.optimizers):
            snapshots["taken"] += 1
            for group in optimizer.param_groups:
                for p in group["params"]:
                    assert p.grad is not None, names[id(p)]
                    grads[names[id(p)]] = full(p.grad)

    for optimizer in trainer.optimizers:
        optimizer.register_step_pre_hook(snapshot)
    losses, balance, rank_loads = [], [], []
    from moe_train.models.fp8.gemm import count_fp8_gemms

    with count_fp8_gemms() as fp8_gemms:
        for step in range(1, steps + 1):
            result = trainer.train_step(step)
            losses.append(result.loss)
            balance.append(result.moe)
            rank_loads.append(result.moe_ranks)
    meshes = {n: list(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else None
              for part in trainer.chunks for n, p in part.named_parameters()}
    return {"losses": losses, "grads": whole_grads(trainer, grads), "state": whole_state(trainer), "moe": balance,
            "moe_ranks": rank_loads,
            "initial": initial, "eval": trainer.evaluate() if evaluate else None, "meshes": meshes,
            "fp8_gemms": {"/".join(key): count for key, count in fp8_gemms.items()},
            "fp8_gathering": fp8_gathering(trainer)}


def record_resumed(recipe_name: str, overrides: list[str], *, world: int, run_dir: Path, steps: int,
                   stop_at: int, resume_overrides: tuple[str, ...] = ()) -> dict:
    """Train to `stop_at` (checkpoint, exit), resume in a new Trainer and finish: the final state and the
    metrics the logging rank wrote, to compare with an uninterrupted run. `resume_overrides` change the resumed
    launch (another layout: the checkpoint reshards on load)."""
    from moe_train.train.loop import Trainer

    base = [*overrides, f"launch.gpus_per_node={world}", f"run_dir={run_dir}", f"train.steps={steps}"]
    Trainer(load_recipe(recipe_name, [*base, f"train.exit_at_step={stop_at}"])).train()
    resumed = Trainer(load_recipe(recipe_name, [*base, *resume_overrides, "checkpoint.resume=required"]))
    started = resumed.progress.step
    resumed.train()
    return {"started": started, "state": whole_state(resumed), "fp8_gathering": fp8_gathering(resumed)}


def keep_record(record: dict, *, run_root: Path, case_id: str, rank: int, saved: dict[str, str]) -> None:
    """Rank 0 saves a case's record beside the runs (too large for the JSON result) and notes its path."""
    if rank == 0:
        path = run_root / f"{case_id}.pt"
        torch.save(record, path)
        saved[case_id] = str(path)
