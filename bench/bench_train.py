"""Trainer throughput on the default run (qwen3-moe-tiny on the builtin corpus): time per step, tokens/s and MFU.

Whole optimizer steps as `moe-train run` takes them (data, micro-batch accumulation, backward, clipping, AdamW,
balance statistics), through `Trainer.train_step`. Variants of the recipe are timed side by side, interleaved
step by step (median of the steps after a warm-up), so load from other processes hits each alike; besides wall
time each step's CPU time (this process, all its threads) is reported, which load inflates far less. Default
variants: the recipe as it is and micro-batches of 2 (the default before issue 8); e.g. `--variant recipe:
--variant bf16:train.precision=bf16` adds bf16 (FSDP2's bf16 compute on fp32 master weights: on a CPU without
bf16 vector units its matmuls run at ~1 GFLOP/s, so expect minutes). MFU uses the trainer's own FLOPs formula and
the CPU matmul peak measured in this run, per dtype. OpenMP threads wait passively, as under `moe-train run`.

    PYTHONPATH=. python bench/bench_train.py [--steps 20] [--recipe qwen3-moe-tiny] [--set k=v ...]
        [--threads N] [--variant "NAME:k=v,k=v" ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP: before the import below

import torch  # noqa: E402

from moe_train.config import load_recipe  # noqa: E402
from moe_train.train.loop import Trainer  # noqa: E402

WARMUP = 2
DEFAULT_VARIANTS = ["recipe:", "micro-batch 2:train.micro_batch_size=2"]


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition(":")
    return name, [item for item in overrides.split(",") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="qwen3-moe-tiny")
    parser.add_argument("--steps", type=int, default=20, help="Timed steps per variant (after 2 warm-up steps).")
    parser.add_argument("--set", action="append", default=[], help="Recipe override for every variant (repeatable).")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice).")
    parser.add_argument("--variant", action="append", default=None,
                        help='"NAME:k=v,k=v" (repeatable); the first is the baseline of the ratios.')
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    variants = dict(parse_variant(text) for text in (args.variant or DEFAULT_VARIANTS))
    trainers: dict[str, Trainer] = {}
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, overrides) in enumerate(variants.items()):
            recipe = load_recipe(args.recipe, [*args.set, *overrides, f"run_dir={tmp}/{index}"])
            trainers[name] = Trainer(recipe)
        for step in range(1, WARMUP + args.steps + 1):
            for name, trainer in trainers.items():
                wall, used = time.perf_counter(), time.process_time()
                result = trainer.train_step(step)
                if step > WARMUP:
                    times[name].append(time.perf_counter() - wall)
                    cpu[name].append(time.process_time() - used)
                losses[name].append(result.loss)

    some = next(iter(trainers.values()))
    tokens = some.tokens_per_step
    print(f"{args.recipe}: {tokens:,} tokens per step ({some.recipe.train.global_batch_size} x "
          f"{some.recipe.train.seq_length}), {some.flops_per_token / 1e6:.2f} MFLOP per trained token, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps each, load average "
          f"{os.getloadavg()[0]:.1f}")
    base = None
    for name, trainer in trainers.items():
        step_s, cpu_s = statistics.median(times[name]), statistics.median(cpu[name])
        base = base or (step_s, cpu_s)
        rate = tokens / step_s
        tflops = trainer.flops_per_token * rate / 1e12
        print(f"  {name:<16} {step_s * 1e3:7.1f} ms/step (x{step_s / base[0]:.2f})  CPU {cpu_s * 1e3:7.1f} ms/step "
              f"(x{cpu_s / base[1]:.2f})  {rate:8,.0f} tokens/s  MFU {tflops * 1e12 / trainer.peak:5.1%} "
              f"(peak {trainer.peak / 1e9:,.0f} GFLOP/s, micro-batch {trainer.recipe.train.micro_batch_size}, "
              f"{trainer.recipe.train.precision})  loss {losses[name][0]:.3f} -> {losses[name][-1]:.3f}")


if __name__ == "__main__":
    main()
