"""Trainer throughput on the default run (qwen3-moe-tiny on the builtin corpus): tokens/s and MFU per step.

Whole optimizer steps as `moe-train run` takes them (data, micro-batch accumulation, backward, clipping, AdamW,
balance statistics), through `Trainer.train_step`. fp32 (the recipe's precision) and bf16 autocast are timed
side by side, interleaved step by step (median of the steps after a warm-up), so load from other processes hits
both alike. MFU uses the trainer's own FLOPs formula and the CPU matmul peak measured in this run, per dtype.

    PYTHONPATH=. python bench/bench_train.py [--steps 20] [--recipe qwen3-moe-tiny] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from moe_train.config import load_recipe
from moe_train.train.loop import Trainer

WARMUP = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="qwen3-moe-tiny")
    parser.add_argument("--steps", type=int, default=20, help="Timed steps per precision (after 2 warm-up steps).")
    parser.add_argument("--set", action="append", default=[], help="Recipe override (repeatable).")
    args = parser.parse_args()

    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "bf16"):
            recipe = load_recipe(args.recipe, [*args.set, f"train.precision={precision}",
                                               f"run_dir={tmp}/{precision}"])
            trainers[precision] = Trainer(recipe)
        times: dict[str, list[float]] = {p: [] for p in trainers}
        losses: dict[str, list[float]] = {p: [] for p in trainers}
        for step in range(1, WARMUP + args.steps + 1):
            for precision, trainer in trainers.items():
                start = time.perf_counter()
                result = trainer.train_step(step)
                if step > WARMUP:
                    times[precision].append(time.perf_counter() - start)
                losses[precision].append(result.loss)

    some = trainers["fp32"]
    tokens = some.tokens_per_step
    print(f"{args.recipe}: {tokens:,} tokens per step ({some.recipe.train.global_batch_size} x "
          f"{some.recipe.train.seq_length}), {some.flops_per_token / 1e6:.2f} MFLOP per trained token, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps each")
    rate = {}
    for precision, trainer in trainers.items():
        step_s = statistics.median(times[precision])
        rate[precision] = tokens / step_s
        tflops = trainer.flops_per_token * rate[precision] / 1e12
        print(f"  {precision}: {step_s * 1e3:7.1f} ms/step  {rate[precision]:9,.0f} tokens/s  "
              f"{tflops * 1e3:6.1f} GFLOP/s  MFU {tflops * 1e12 / trainer.peak:5.1%} "
              f"(peak {trainer.peak / 1e9:,.0f} GFLOP/s)  loss {losses[precision][0]:.3f} -> "
              f"{losses[precision][-1]:.3f}")
    print(f"  bf16 / fp32 throughput: {rate['bf16'] / rate['fp32']:.2f}x")


if __name__ == "__main__":
    main()
