"""Run under torchrun with 2 ranks by tests/test_measure.py: known collectives under the comm counter.

Each rank writes {"<group>/<op>": bytes} to OUT/rank-R.json. The mesh is (dp 1, ep 2): dp is a group of one
rank (nothing moves, nothing counted), ep spans both ranks; the default group is `world`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as autograd_collectives
from torch.distributed.device_mesh import init_device_mesh

from moe_train.measure.comm import CommCounter, mesh_group_namer


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    ep, dp = mesh.get_group("ep"), mesh.get_group("dp")
    with CommCounter(mesh_group_namer([mesh])) as counter:
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
    (out / f"rank-{rank}.json").write_text(json.dumps(dict(counter.bytes)), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
