"""Data- and expert-parallel scaling on this machine: FSDP2 at DP=2 (2 ranks x 1 thread), and for the MoE model
EP=2 (experts split over the 2 ranks), against 1 rank x 1 thread and 1 rank x 2 threads, tokens/s side by side
in one run.

Each configuration is a real `moe-train run` (torchrun for 2 ranks) of the same recipe and global batch; the
figure is the median tokens/s of the steps after the first two (metrics.jsonl). The configurations run in
turn, `--rounds` times, so load from other processes hits each alike; the ratios are printed per round.
Models: qwen3-moe-tiny (the default run) and a ~100M-parameter dense Qwen3 proxy.

    python bench/bench_dp.py [--steps 8] [--rounds 2] [--models moe,dense]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {
    "moe": ("qwen3-moe-tiny", ["train.global_batch_size=16", "train.micro_batch_size=8"]),
    # ~100M parameters: 12 layers of hidden 768 (GQA 12/4 heads), FFN 2048, a 32k vocabulary.
    "dense": ("qwen3-tiny", ["model.num_layers=12", "model.hidden_size=768", "model.num_attention_heads=12",
                             "model.num_query_groups=4", "model.head_dim=64", "model.ffn_hidden_size=2048",
                             "model.vocab_size=32000", "data.source=mock", "train.seq_length=128",
                             "train.global_batch_size=8", "train.micro_batch_size=4"]),
}
CONFIGS = {"1 rank x 1 thread": (1, 1, []), "1 rank x 2 threads": (1, 2, []), "DP=2, 2 ranks x 1 thread": (2, 1, [])}
MOE_CONFIGS = {"EP=2 alltoall, 2 ranks x 1 thread": (2, 1, ["parallel.ep=2"]),
               "EP=2 allgather, 2 ranks x 1 thread": (2, 1, ["parallel.ep=2", "model.moe.dispatcher=allgather"])}


def tokens_per_s(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if r["kind"] == "train" and r["step"] > 2]
    return statistics.median(rates)


def run(recipe: str, overrides: list[str], ranks: int, threads: int, run_dir: Path, steps: int) -> float:
    sets = [*overrides, f"train.steps={steps}", "train.warmup_steps=1", "train.eval_interval=null",
            "checkpoint.interval=null", "logging.interval=1", "train.precision=fp32", f"run_dir={run_dir}"]
    # One rank trains in this interpreter with `threads` threads; several ranks get one thread each (bootstrap).
    code = f"import torch; torch.set_num_threads({threads}); from moe_train.cli.main import main; main()"
    argv = [sys.executable, "-c", code, "run", recipe, "--nproc", str(ranks)]
    for item in sets:
        argv += ["--set", item]
    # Passive OpenMP waiting, as `moe-train run` sets it: torch is imported above before run() could set it, and
    # spinning threads made 1 rank x 2 threads 3x slower than 1 thread on the loaded machine.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return tokens_per_s(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="moe,dense")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            recipe, overrides = MODELS[key]
            configs = {**CONFIGS, **(MOE_CONFIGS if key == "moe" else {})}
            results: dict[str, list[float]] = {name: [] for name in configs}
            for round_index in range(args.rounds):
                for index, (name, (ranks, threads, extra)) in enumerate(configs.items()):
                    run_dir = Path(tmp) / f"{key}-{round_index}-{index}"
                    results[name].append(run(recipe, [*overrides, *extra], ranks, threads, run_dir, args.steps))
            base = statistics.median(results["1 rank x 1 thread"])
            print(f"{key} ({recipe}):")
            for name, rates in results.items():
                rate = statistics.median(rates)
                print(f"  {name:<36} {rate:>9,.0f} tokens/s  x{rate / base:.2f} of 1 rank x 1 thread  "
                      f"(rounds: {', '.join(f'{r:,.0f}' for r in rates)})")


if __name__ == "__main__":
    main()
