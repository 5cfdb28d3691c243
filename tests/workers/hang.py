"""Two gloo ranks in mismatched collectives: after one all-reduce together on group `a`, rank 0 enters a second
on `a` while rank 1 enters one on `b`. Neither returns; each rank's hang watch (tests/test_hang_report.py) must
print its own collective before the process group's timeout ends the wait with an error, which the worker
catches. Rank 0 reports the error text."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import json

    import torch
    import torch.distributed as dist

    from moe_train.train.hang_report import HangWatch

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = json.loads(Path(sys.argv[1]).read_text())
    timeout_s = spec["timeout_s"]
    dist.init_process_group("gloo", init_method=f"file://{os.environ['MOE_TRAIN_TEST_STORE']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    groups = {name: dist.new_group([0, 1], group_desc=name, timeout=timedelta(seconds=timeout_s))
              for name in ("a", "b")}
    watch = HangWatch(rank=rank, timeout_s=timeout_s, step=lambda: 7, log_dir=Path(spec["log_dir"]))
    tensor = torch.ones(3, 5)
    dist.all_reduce(tensor, group=groups["a"])
    error = None
    try:
        dist.all_reduce(tensor, group=groups["a" if rank == 0 else "b"])
    except RuntimeError as raised:
        error = str(raised).splitlines()[0]
    watch.stop()
    if rank == 0:
        Path(sys.argv[2]).write_text(json.dumps({"error": error}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the groups are broken: no barrier, no teardown


if __name__ == "__main__":
    main()
