"""Pipeline bubble on this machine: PP=2 and PP=4 (1f1b) against the same work unpipelined, for 4, 8 and 16
micro-batches per step, next to the ideal bubble.

Each configuration trains the same recipe and global batch with `Trainer` on every rank of a torchrun job (one
thread per rank). Per rank and step it records the step's wall time and the rank's CPU time in it (gloo waits
block without spinning, and OpenMP threads wait passively, so CPU time is the time the stage was busy); the
bubble of a stage is 1 - busy / step time (docs/decisions.md: on 2 cores, busy time against step time says more than
wall time alone). The ideal 1F1B bubble is (p - 1) / (m + p - 1) of the step ((p - 1) / m of the work). PP=4
runs 4 ranks on 2 cores: a rank also waits for a core, so its bubble there is an upper bound. The unpipelined
step (1 rank) is timed in the same run, so the speed-up column compares like with like.

    python bench/bench_pp.py [--steps 6] [--micro-batches 4,8,16] [--pp 2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A dense proxy whose layers dominate the step (8 layers of hidden 256, a small vocabulary), so stages balance.
RECIPE = "qwen3-tiny"
OVERRIDES = ["model.num_layers=8", "model.hidden_size=256", "model.num_attention_heads=8", "model.num_query_groups=4",
             "model.head_dim=32", "model.ffn_hidden_size=768", "train.seq_length=128", "train.micro_batch_size=1",
             "train.precision=fp32", "train.warmup_steps=1", "train.eval_interval=null", "checkpoint.interval=null",
             "data.source=mock"]


def rank_main(out: Path, overrides: list[str], steps: int) -> None:
    """On every rank: train `steps` steps, time each, write this rank's (wall, cpu) per step."""
    import torch

    torch.set_num_threads(1)
    from moe_train.config import load_recipe
    from moe_train.parallel.bootstrap import bootstrap, shutdown
    from moe_train.train.loop import Trainer

    world = int(os.environ.get("WORLD_SIZE", 1))
    recipe = load_recipe(RECIPE, [*OVERRIDES, *overrides, f"launch.gpus_per_node={world}", f"run_dir={out}/run",
                                  f"train.steps={steps}"])
    ctx = bootstrap(recipe)
    trainer = Trainer(recipe, ctx)
    timings = []
    for step in range(1, steps + 1):
        torch.distributed.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train_step(step)
        timings.append((time.perf_counter() - wall, time.process_time() - cpu))
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({"pp": ctx.coord("pp"), "timings": timings}))
    shutdown(ctx)


def run(ranks: int, overrides: list[str], steps: int, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            __file__, "--rank-worker", str(out), "--steps", str(steps), "--", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run(argv, env=env, check=True, capture_output=True, text=True, timeout=1800)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def steady(timings: list[list[float]]) -> tuple[float, float]:
    """Median step time and busy time over the steps after the first (which warms caches)."""
    rest = timings[1:] or timings
    return statistics.median(t[0] for t in rest), statistics.median(t[1] for t in rest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", default="4,8,16")
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--rank-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker is not None:
        rank_main(args.rank_worker, args.overrides, args.steps)
        return
    print(f"load average {os.getloadavg()[0]:.1f}; {RECIPE} proxy, 1f1b, one thread per rank")
    with tempfile.TemporaryDirectory() as tmp:
        for m in map(int, args.micro_batches.split(",")):
            batch = [f"train.global_batch_size={m}"]
            base, _ = steady(run(1, batch, args.steps, Path(tmp) / f"base-{m}")[0]["timings"])
            print(f"m = {m:>2}: unpipelined step {base:.3f} s")
            for pp in map(int, args.pp.split(",")):
                ranks = run(pp, [*batch, f"parallel.pp={pp}"], args.steps, Path(tmp) / f"pp{pp}-{m}")
                step = statistics.median(steady(r["timings"])[0] for r in ranks)
                busy = [steady(r["timings"])[1] for r in sorted(ranks, key=lambda r: r["pp"])]
                bubbles = ", ".join(f"{1 - b / step:.0%}" for b in busy)
                ideal = (pp - 1) / (m + pp - 1)
                print(f"  PP={pp}: step {step:.3f} s (x{base / step:.2f} of unpipelined), bubble per stage "
                      f"[{bubbles}], ideal {ideal:.0%} ((p-1)/m = {(pp - 1) / m:.2f})")


if __name__ == "__main__":
    main()
