"""Worker: `measure_step` of each case of the spec on this job's gloo ranks; rank 0 keeps every case's report
(its own, and every rank's in `reports`: pipeline stages differ).

A case runs under forced even routing (what the planner and `--fake` assume) unless it sets "even": false; then
every rank also records, for each MoE layer forward, how many of its token slots went to each rank of its
expert-parallel group, and rank 0 gets every rank's counts with the members of its own group: the exact
dispatch volume the routing implies, independent of the dispatcher's own bookkeeping.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def main() -> None:
    spec, result_path, rank, world = start()
    import torch
    import torch.distributed as dist
    from torch.nn.modules.module import register_module_forward_hook

    from moe_train.config import load_recipe
    from moe_train.measure.driver import Target, measure_step
    from moe_train.models.moe.router import Router
    from moe_train.parallel.bootstrap import bootstrap

    reports = {}
    for case in spec["cases"]:
        nodes = next((int(o.split("=")[1]) for o in case["overrides"] if o.startswith("launch.nodes=")), 1)
        recipe = load_recipe(case["recipe"], [*case["overrides"], f"launch.gpus_per_node={world // nodes}"])
        ctx = bootstrap(recipe, distinct_groups=True)
        ep = ctx.size("ep")
        local = recipe.model.moe.num_experts // ep if recipe.model.moe is not None else 1
        sent: list[list[int]] = []  # per router forward: this rank's slots to each rank of its ep group

        def count(module, args, output, sent=sent, local=local, ep=ep) -> None:
            if isinstance(module, Router):
                sent.append(torch.bincount(output.topk_indices.reshape(-1) // local, minlength=ep).tolist())

        handle = register_module_forward_hook(count)
        report = measure_step(recipe, Target(even_routing=case.get("even", True)), ctx)
        handle.remove()
        every_rank = [None] * world
        dist.all_gather_object(every_rank, sent)
        every_report = [None] * world
        dist.all_gather_object(every_report, report)
        if rank == 0:
            group = dist.get_process_group_ranks(ctx.group("ep")) if ep > 1 else [0]
            reports[case["id"]] = {"report": report, "reports": every_report,
                                   "slots": {r: every_rank[r] for r in group},
                                   "ep_rank": ctx.coord("ep")}
    finish(reports, result_path, rank)


if __name__ == "__main__":
    main()
