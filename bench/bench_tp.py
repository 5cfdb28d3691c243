"""Tensor parallelism on this machine: TP=2 (with and without sequence parallelism, with recompute) against
DP=2 (FSDP2), 2 ranks x 1 thread each, tokens/s side by side in one run.

Each configuration is a real `moe-train run` of the same recipe and global batch (bench_dp.py's runner: median
tokens/s of the steps after the first two); configurations run in turn, `--rounds` times, so load from other
processes hits each alike. On CPU, TP pays an all-reduce (or all-gather + reduce-scatter) per region on gloo
for half-sized GEMMs, where DP pays one gradient reduce-scatter per step: the ratio says what TP costs here,
not on NVLink.

    python bench/bench_tp.py [--steps 8] [--rounds 1] [--models dense,moe]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dp import MODELS, run  # noqa: E402

CONFIGS = {
    "DP=2": [],
    "TP=2": ["parallel.tp=2"],
    "TP=2 + SP": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "TP=2 + SP + selective(core_attn, layernorm)": [
        "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute.granularity=selective",
        "parallel.recompute.modules=[core_attn,layernorm]"],
    "TP=2 + SP + full": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute.granularity=full"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--models", default="dense,moe")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            recipe, overrides = MODELS[model]
            for round_index in range(args.rounds):
                rates = {}
                for label, extra in CONFIGS.items():
                    run_dir = Path(tmp) / f"{model}-{round_index}-{len(rates)}"
                    rates[label] = run(recipe, [*overrides, *extra], 2, 1, run_dir, args.steps)
                print(f"{model} ({recipe}), round {round_index + 1}:")
                for label, rate in rates.items():
                    print(f"  {label:45s} {rate:9,.0f} tokens/s  x{rate / rates['DP=2']:.2f} of DP=2")


if __name__ == "__main__":
    main()
