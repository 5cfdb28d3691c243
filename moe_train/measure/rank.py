"""What torchrun starts on every rank for `moe-train measure --nproc N`:
`python -m moe_train.measure.rank --recipe R.yaml --out report.json [--rank R] [--layers 0,3]`.

Every rank runs the step (collectives need them all); rank `--rank` writes the report. Exit 0 on success,
1 with one line naming the rank on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_train.measure.rank", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--layers", default=None, help="Comma-separated layer indices; default: all.")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from moe_train.config import load_recipe
    from moe_train.measure.driver import Target, measure_step
    from moe_train.parallel.bootstrap import bootstrap, shutdown

    rank = int(os.environ.get("RANK", "0"))
    recipe = load_recipe(args.recipe)
    layers = tuple(int(i) for i in args.layers.split(",")) if args.layers else None
    try:
        ctx = bootstrap(recipe, distinct_groups=True)
        try:
            report = measure_step(recipe, Target(rank=args.rank, layers=layers), ctx)
            if ctx.rank == args.rank:
                args.out.write_text(json.dumps(report), encoding="utf-8")
            dist.barrier()
        finally:
            shutdown(ctx)
    except Exception as error:  # one line naming the rank, never a traceback per rank
        reason = str(error).splitlines()[0] if str(error) else ""
        print(f"error: rank {rank}: {type(error).__name__}: {reason}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
