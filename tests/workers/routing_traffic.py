"""Worker: one training step of each case under measure's collective counter; every rank's bytes per
`<group>/<op>` and the step's per-rank loads come back, and rank 0 writes the step's routing trace with the
engine's own writer (train/rank_load.py `RoutingTrace`) into the case's run folder, for `plan --routing`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def main() -> None:
    spec, result_path, rank, world = start()
    import contextlib

    import torch.distributed as dist

    from moe_train.config import load_recipe
    from moe_train.measure.dtensor import local_dtensor_ops
    from moe_train.measure.traffic import CollectiveTraffic
    from moe_train.parallel.bootstrap import bootstrap
    from moe_train.train.loop import Trainer
    from moe_train.train.rank_load import RoutingTrace

    results = {}
    for case in spec["cases"]:
        run_dir = Path(spec["run_root"]) / case["id"]
        recipe = load_recipe(
            case["recipe"], [*case["overrides"], f"launch.gpus_per_node={world}", f"run_dir={run_dir}", "train.steps=1"]
        )
        trainer = Trainer(recipe, bootstrap(recipe, distinct_groups=True))  # groups named as measure names them
        comm = CollectiveTraffic(trainer.ctx.group_name)
        with contextlib.ExitStack() as stack:
            for context in (local_dtensor_ops(), comm):
                stack.enter_context(context)
            result = trainer.train_step(1)
        if rank == 0:
            trace = RoutingTrace(run_dir, start_step=0, ep=trainer.ctx.size("ep"))
            trace.write(1, result.moe, result.moe_ranks)
            trace.close()
        ranks = [None] * world
        dist.all_gather_object(ranks, dict(comm.bytes))
        results[case["id"]] = {"comm_bytes": ranks, "moe_ranks": result.moe_ranks}
    finish(results, result_path, rank)


if __name__ == "__main__":
    main()
