"""What every rank of a test worker does first: one thread, the process group over the test's file store."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def start() -> tuple[dict, Path, int, int]:
    """Returns (spec, result path, rank, world size) with the default process group initialised."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{os.environ['MOE_TRAIN_TEST_STORE']}", rank=rank,
                            world_size=world)
    spec = json.loads(Path(sys.argv[1]).read_text())
    return spec, Path(sys.argv[2]), rank, world


def finish(result: dict | None, result_path: Path, rank: int) -> None:
    """Rank 0 writes the result; every rank leaves without interpreter finalisation, which after FSDP2 + gloo
    aborted now and then ("terminate called without an active exception") after every check had passed."""
    import torch.distributed as dist

    if rank == 0 and result is not None:
        result_path.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
