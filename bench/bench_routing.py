"""Balanced vs real (skewed) routing on 4 gloo ranks (EP4), before and after expert placement, side by side.

Three trainers of one MoE recipe live in the same job and take their steps in turn, so drifting machine load
hits all alike: `balanced` (the router as initialised, near even), `skewed` (model.moe.router.logit_bias
favouring experts 0-3, which the contiguous placement puts on ranks 0 and 1) and `skewed-placed` (the same
router, experts placed by `experts place`'s packing from a short routing trace of the skewed model). Printed
per case: the median step time and tokens/s, the all-to-all bytes of the rank that sent the most and of all
ranks together in one more, untimed step (measure's CollectiveTraffic), and the measured max/mean rank load
(metrics' `moe_ranks`), averaged over layers. On one machine gloo's "network" is loopback TCP and 2 cores run 4 ranks:
the times say what imbalance costs here, not on a GPU cluster.

Run: python bench/bench_routing.py [--steps 6] [--ffn 384]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD = 4
SKEW = "model.moe.router.logit_bias=[1.2,1.0,0.8,0.6,0,0,0,0]"


def _overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        "model.num_layers=2",
        f"model.moe.ffn_hidden_size={args.ffn}",
        "train.seq_length=128",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
        "train.precision=fp32",
        "train.eval_interval=null",
        "checkpoint.interval=null",
        "logging.interval=1",
        "parallel.ep=4",
        f"launch.gpus_per_node={WORLD}",
        f"train.steps={args.steps + 2}",
        f"run_dir={run_dir}",
    ]


def _a2a_bytes(trainer, step: int) -> int:
    """This rank's all-to-all bytes (token rows, their weights and row counts) in one step, counted by measure's
    dispatch mode: a step of its own, since the counting costs time."""
    from moe_train.measure.traffic import CollectiveTraffic

    with CollectiveTraffic(lambda group: str(group.group_name)) as traffic:
        trainer.train_step(step)
    return sum(sent for key, sent in traffic.bytes.items() if key.endswith("/all_to_all"))


def _rank(rank: int, store: str, root: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from moe_train.config import load_recipe
    from moe_train.plan.routing import place, read_trace
    from moe_train.train.loop import Trainer

    root_dir = Path(root)
    trace_dir = root_dir / "trace"
    tracer = Trainer(
        load_recipe(
            "qwen3-moe-tiny", [*_overrides(args, trace_dir), SKEW, "logging.routing_trace=true", "train.steps=2"]
        )
    )
    tracer.train()
    placement_file = root_dir / "placement.json"
    if rank == 0:
        placement, _ = place(read_trace(trace_dir), ep=WORLD)
        placement_file.write_text(json.dumps(placement.to_json()))
    dist.barrier()
    cases = {"balanced": [], "skewed": [SKEW], "skewed-placed": [SKEW, f"model.moe.placement={placement_file}"]}
    trainers = {
        name: Trainer(load_recipe("qwen3-moe-tiny", [*_overrides(args, root_dir / name), *extra]))
        for name, extra in cases.items()
    }
    figures = {name: {"seconds": [], "rank_load": []} for name in cases}
    for step in range(1, args.steps + 2):
        for name, trainer in trainers.items():
            dist.barrier()
            start = time.perf_counter()
            result = trainer.train_step(step)
            dist.barrier()
            seconds = time.perf_counter() - start
            if step > 1:  # the first step warms caches and allocators
                f = figures[name]
                f["seconds"].append(seconds)
                f["rank_load"].append(statistics.mean(x["rank_load_max_over_mean"] for x in result.moe_ranks.values()))
    for name, trainer in trainers.items():
        sent = torch.tensor([_a2a_bytes(trainer, args.steps + 2)] * 2, dtype=torch.float64)
        dist.all_reduce(sent[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(sent[1:])
        figures[name]["a2a_max"], figures[name]["a2a_sum"] = sent.tolist()
    if rank == 0:
        tokens = 16 * 128
        base = statistics.median(figures["balanced"]["seconds"])
        print(
            f"{'case':<14} {'step s':>8} {'tokens/s':>9} {'vs balanced':>11} {'a2a MB max rank':>15} "
            f"{'a2a MB all':>10} {'rank max/mean':>13}"
        )
        for name, f in figures.items():
            step = statistics.median(f["seconds"])
            print(
                f"{name:<14} {step:8.3f} {tokens / step:9.0f} {base / step:11.2f} "
                f"{f['a2a_max'] / 1e6:15.3f} {f['a2a_sum'] / 1e6:10.3f} "
                f"{statistics.mean(f['rank_load']):13.3f}"
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=384, help="each routed expert's hidden size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(_rank, args=(str(Path(root) / "store"), root, args), nprocs=WORLD)


if __name__ == "__main__":
    main()
