"""Worker: the resilience cases of tests/test_resilience.py on this job's ranks; rank 0 saves each case's record.

- stops: StopRequests on every rank, each with a notice path of its own and only rank 0 reading its file: a
  file only a non-reading rank would see stops nobody; rank 0's notice, and SIGTERM to one rank, stop all.
- reshard: train under the case's save layout to `stop_at` (a checkpoint), then resume that checkpoint under
  each resume layout in turn, in the same run folder, and train to `steps`; records every full tensor of model
  and optimizer right after the save and right after each load, and each layout's logged losses.
- poison: after every gradient reduction of step `poison_step` and before the norm is taken, one rank makes
  one element of its own shard of an expert gradient NaN (through the real trainer object: its model's
  `parameters()`, which the trainer calls for the clipping); records what each rank decided and whether its
  state moved.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import train_losses  # noqa: E402
from workers.common import finish, start  # noqa: E402


def gathered(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def stops_case(case: dict, run_root: Path, rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from moe_train.train.stops import StopRequests

    folder = run_root / case["id"]
    folder.mkdir(parents=True, exist_ok=True)
    stops = StopRequests(notice=folder / f"PREEMPT-{rank}", reads_notice=rank == 0, device=torch.device("cpu"))
    reasons = {"none": gathered(stops.agreed())}
    if rank == 0:
        (folder / "PREEMPT-1").write_text("only rank 1, which does not read the notice, would see this")
    dist.barrier()
    reasons["unread notice"] = gathered(stops.agreed())
    if rank == 0:
        (folder / "PREEMPT-0").write_text("preempt")
    reasons["notice"] = gathered(stops.agreed())
    if rank == 0:
        (folder / "PREEMPT-0").unlink()
    with stops:
        if rank == case["signal_rank"]:
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler, as torchrun or a user would deliver it
        reasons["signal"] = gathered(stops.agreed())
    return reasons


def reshard_case(case: dict, run_root: Path, world: int, rank: int) -> dict:
    from workers.record import full_state

    from moe_train.config import load_recipe
    from moe_train.train.loop import Trainer

    run_dir = run_root / case["id"]
    base = [*case["overrides"], f"launch.gpus_per_node={world}", f"run_dir={run_dir}", f"train.steps={case['steps']}",
            "checkpoint.keep=null"]
    saver = Trainer(load_recipe(case["recipe"], [*base, *case["save"], f"train.exit_at_step={case['stop_at']}"]))
    saver.train()
    record = {"saved": full_state(saver), "losses": train_losses(run_dir) if rank == 0 else None}
    del saver
    checkpoint = run_dir / "checkpoints" / f"step-{case['stop_at']:07d}"
    for index, (layout_id, layout) in enumerate(case["resume"].items()):
        # The first resume continues the run folder as a requeued job would; later ones name the checkpoint.
        policy = "required" if index == 0 else str(checkpoint)
        trainer = Trainer(load_recipe(case["recipe"], [*base, *layout, f"checkpoint.resume={policy}"]))
        loaded = {"loaded": full_state(trainer), "started": trainer.progress.step,
                  "started_from": str(trainer.started_from), "own": trainer.start.own}
        trainer.train()
        loaded["losses"] = train_losses(run_dir) if rank == 0 else None
        record[layout_id] = loaded
        del trainer
    return record


def poison_case(case: dict, run_root: Path, world: int, rank: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor
    from workers.record import full_state

    from moe_train.config import load_recipe
    from moe_train.train.loop import Trainer

    recipe = load_recipe(case["recipe"], [*case["overrides"], *case["layout"], f"launch.gpus_per_node={world}",
                                          f"run_dir={run_root / case['id']}", f"train.steps={case['steps']}"])
    trainer = Trainer(recipe)
    current = {"step": 0}
    (model,) = trainer.chunks
    real_parameters = model.parameters

    def parameters(recurse: bool = True):
        if recurse and rank == case["poison_rank"] and current["step"] == case["poison_step"]:
            for name, param in model.named_parameters():
                if ".experts." in name and param.grad is not None:
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    grad.view(-1)[0] = float("nan")
                    break
        return real_parameters(recurse)

    model.parameters = parameters
    states, verdicts = [full_state(trainer)], []
    for step in range(1, case["steps"] + 1):
        current["step"] = step
        result = trainer.train_step(step)
        verdicts.append(None if result.rejection is None else result.rejection.kind)
        states.append(full_state(trainer))
    unchanged = [all(torch.equal(states[s][k], states[s + 1][k]) for k in states[s]) for s in range(case["steps"])]
    return {"verdicts": gathered(verdicts), "unchanged": gathered(unchanged)}


def main() -> None:
    spec, result_path, rank, world = start()
    from workers.record import keep_record

    run_root = Path(spec["run_root"])
    run_root.mkdir(parents=True, exist_ok=True)
    saved = {}
    for case in spec["cases"]:
        if case["kind"] == "stops":
            saved[case["id"]] = stops_case(case, run_root, rank)
            continue
        record = reshard_case(case, run_root, world, rank) if case["kind"] == "reshard" else poison_case(
            case, run_root, world, rank)
        keep_record(record, run_root=run_root, case_id=case["id"], rank=rank, saved=saved)
    finish(saved, result_path, rank)


if __name__ == "__main__":
    main()
