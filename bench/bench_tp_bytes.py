"""Tensor parallelism's bytes, measured beside the plan: communication per step of TP=2 with and without sequence
parallelism on a real 2-rank gloo run (`moe-train measure --nproc 2`: measure's counters), and activation bytes
per layer of full-size layers across layouts (`--fake`), each figure next to `moe-train plan`'s analytic count.

Not a speed bench: bytes do not depend on the machine's load. Payload is docs/decisions.md's (all-reduce and
reduce-scatter: the input; all-gather: the shard sent); bus bytes are the planner's (2(n-1)/n, (n-1)/n, n-1
shards), where "SP moves what TP moves" plus one all-gather per column-parallel GEMM's saved shard shows.

    python bench/bench_tp_bytes.py [--recipes qwen3-tiny,deepseek-v3-tiny] [--no-full-size]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from moe_train.config import load_recipe
from moe_train.config.hardware import HARDWARE
from moe_train.plan.estimate import estimate, plan_json

GPU = HARDWARE["h100"]  # the payload does not depend on it; the plan needs a target
TP2 = ["parallel.tp=2", "train.precision=bf16", "train.global_batch_size=4", "train.micro_batch_size=2"]
FULL_SIZE = {  # (model, extra overrides, the layer reported, layouts: label -> overrides)
    "Qwen3-8B dense layer, s = 2h = 8192": ("qwen3-8b", ["model.num_layers=1", "train.seq_length=8192"], "0", 4),
    "DeepSeek-V3 MoE layer, s = 4096": (
        "deepseek-v3", ["model.num_layers=2", "model.first_k_dense=1", "model.mtp_layers=0", "parallel.ep=1"], "1", 8),
}
TODAY = ["parallel.pp=1", "parallel.vpp=1", "parallel.pp_schedule=1f1b", "parallel.pp_layout=null",
         "launch.nodes=1"]


def measured_real(recipe: str, overrides: list[str]) -> dict:
    argv = [str(Path(sys.executable).parent / "moe-train"), "measure", recipe, "--nproc", "2", "--json",
            *(arg for item in overrides for arg in ("--set", item))]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"measure failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def communication(recipe_name: str) -> None:
    print(f"{recipe_name}, TP=2 on 2 gloo ranks, bf16, one step (2 micro-batches of 2 x seq):")
    print(f"  {'layout':10s} {'key':18s} {'measured':>14s} {'plan':>14s} {'plan bus':>14s}")
    bus_totals = {}
    for label, sp in (("TP", "false"), ("TP + SP", "true")):
        overrides = [*TP2, f"parallel.sequence_parallel={sp}", "launch.gpus_per_node=2"]
        report = measured_real(recipe_name, overrides)
        plan = plan_json(estimate(load_recipe(recipe_name, overrides), GPU))
        keys = sorted(k for k in set(report["comm_bytes"]) | set(plan["comm_bytes"]) if k.startswith("tp/"))
        for key in keys:
            measured, planned = report["comm_bytes"].get(key, 0), plan["comm_bytes"].get(key, 0)
            print(f"  {label:10s} {key:18s} {measured:>14,} {planned:>14,} {plan['comm_bus_bytes'].get(key, 0):>14,}")
        bus_totals[label] = sum(plan["comm_bus_bytes"].get(k, 0) for k in keys)
    print(f"  bus bytes, TP + SP over TP: x{bus_totals['TP + SP'] / bus_totals['TP']:.3f}\n")


def activations() -> None:
    from moe_train.measure.driver import Target, measure

    print("Activation bytes per layer (one micro-batch, bf16, --fake at full size), measured and planned:")
    for title, (name, extra, layer, tp) in FULL_SIZE.items():
        layouts = {"TP=1": ["parallel.tp=1", "parallel.sequence_parallel=false"],
                   f"TP={tp}": [f"parallel.tp={tp}", "parallel.sequence_parallel=false"],
                   f"TP={tp} + SP": [f"parallel.tp={tp}", "parallel.sequence_parallel=true"],
                   f"TP={tp} + SP + selective(core_attn, layernorm)": [
                       f"parallel.tp={tp}", "parallel.sequence_parallel=true",
                       "parallel.recompute.granularity=selective", "parallel.recompute.modules=[core_attn,layernorm]"]}
        print(f"  {title}")
        base = None
        for label, layout in layouts.items():
            world = int(layout[0].split("=")[1])
            none = [] if "recompute" in " ".join(layout) else ["parallel.recompute.granularity=none"]
            recipe = load_recipe(name, [*TODAY, *extra, *layout, *none, f"launch.gpus_per_node={world}",
                                        "train.global_batch_size=1", "train.micro_batch_size=1"], check_files=False)
            measured = measure(recipe, Target(fake=True))["activation_bytes_per_layer"][layer]
            planned = plan_json(estimate(recipe, GPU))["activation_bytes_per_layer"][layer]
            base = base or measured
            print(f"    {label:48s} {measured / 1e9:7.3f} GB measured {planned / 1e9:7.3f} GB planned"
                  f"   1/{base / measured:.1f} of TP=1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="qwen3-tiny,deepseek-v3-tiny")
    parser.add_argument("--no-full-size", action="store_true")
    args = parser.parse_args()
    for name in args.recipes.split(","):
        communication(name)
    if not args.no_full_size:
        activations()


if __name__ == "__main__":
    main()
