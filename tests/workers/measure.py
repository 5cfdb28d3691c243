"""Worker: on 2 gloo ranks, (1) known collectives under the comm counter, (2) `measure_step` of a recipe,
(3) the trainer's own `train_step` of the same recipe under the same counters. Rank 0 writes all three."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def known_collectives(rank: int) -> dict:
    """Mesh (dp 1, ep 2): dp is a group of one rank (nothing moves, nothing counted), ep spans both ranks."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.nn.functional as autograd_collectives
    from torch.distributed.device_mesh import init_device_mesh

    from moe_train.measure.traffic import CollectiveTraffic

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    ep, dp = mesh.get_group("ep"), mesh.get_group("dp")
    names = {group.group_name: dim for dim, group in (("ep", ep), ("dp", dp))}  # groups named by mesh dimension
    with CollectiveTraffic(lambda group: names[group.group_name]) as counter:
        dist.all_reduce(torch.ones(10), group=ep)  # 40 bytes
        dist.all_reduce(torch.ones(10), group=dp)  # one rank: not counted
        dist.all_gather_into_tensor(torch.empty(12), torch.ones(6), group=ep)  # the 24-byte shard
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6), group=ep)  # the 24-byte input
        # Uneven all-to-all of rows of 4 fp32: rank 0 keeps 1 row and sends 3, rank 1 sends 2 and keeps 2.
        send_rows = [1, 3] if rank == 0 else [2, 2]
        recv_rows = [1, 2] if rank == 0 else [3, 2]
        dist.all_to_all_single(torch.empty(sum(recv_rows), 4), torch.ones(4, 4), recv_rows, send_rows, group=ep)
        dist.broadcast(torch.ones(5, dtype=torch.float64), src=0, group=ep)  # 40
        if rank == 0:
            dist.send(torch.ones(7), dst=1, group=ep)  # 28 sent
        else:
            dist.recv(torch.empty(7), src=0, group=ep)  # 28 received
        funcol.all_gather_tensor(torch.ones(4, dtype=torch.bfloat16), 0, ep).wait()  # 8
        x = torch.ones(3, requires_grad=True)
        autograd_collectives.all_reduce(x, group=ep).sum().backward()  # 12 forward + 12 backward
    return dict(counter.bytes)


def trainer_step(recipe) -> dict:
    """Trainer.train_step(1) under the counters measure uses."""
    import contextlib

    from moe_train.measure.dtensor import local_dtensor_ops
    from moe_train.measure.flops import PhaseFlopCounter
    from moe_train.measure.layers import LayerTracker
    from moe_train.measure.traffic import CollectiveTraffic
    from moe_train.parallel.bootstrap import bootstrap
    from moe_train.train.loop import Trainer

    trainer = Trainer(recipe, bootstrap(recipe, distinct_groups=True))  # groups named as measure names them
    comm, flops = CollectiveTraffic(trainer.ctx.group_name), PhaseFlopCounter(LayerTracker(trainer.chunks))
    # The trainer's reduction of host figures (loss sums, MoE telemetry) goes through _all_reduce.
    telemetry = {"bytes": 0}
    all_reduce = trainer._all_reduce

    def counted(tensor, *args, **kwargs):
        telemetry["bytes"] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)

    trainer._all_reduce = counted
    with contextlib.ExitStack() as stack:
        for context in (local_dtensor_ops(), comm, flops):
            stack.enter_context(context)
        trainer.train_step(1)
    return {"flops": flops.totals(), "comm_bytes": dict(comm.bytes), "telemetry_bytes": telemetry["bytes"]}


def main() -> None:
    spec, result_path, rank, world = start()
    import torch.distributed as dist

    from moe_train.config import load_recipe
    from moe_train.measure.driver import Target, measure_step
    from moe_train.parallel.bootstrap import bootstrap

    known = [None] * world
    dist.all_gather_object(known, known_collectives(rank))
    recipe = load_recipe(spec["recipe"], spec["overrides"])
    report = measure_step(recipe, Target(), bootstrap(recipe, distinct_groups=True))
    trainer = trainer_step(recipe)
    finish({"known": known, "measure": report, "trainer": trainer}, result_path, rank)


if __name__ == "__main__":
    main()
