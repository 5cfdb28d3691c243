"""`moe-train plan`: its wall time on a login node, and its estimates next to published Megatron-Core throughput.

1. Wall time (whole process, as a user waits for it) of `plan deepseek-v3` at 1024 GPUs and of `plan --search`
   over 256 GPUs, beside `python -c pass` and `validate`, interleaved so drifting load hits all alike. Target:
   under 2 s.
2. The planner's TFLOP/s per GPU for the published Megatron-Core runs (their published figures: docs/plan.md), each in
   its published layout, with the error: plain, then overlapped (parallel.ep_overlap; at pp > 1 under
   pp_schedule dualpipev, also printed without the overlap), with peak memory and whether the engine runs it or
   it is a plan only. These are the figures docs/plan.md reports.

Run: python bench/bench_plan.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

MXFP8 = ["train.precision=fp8", "train.fp8.recipe=mxfp8", "train.fp8.saved_inputs=fp8"]
PUBLISHED_DSV3 = "parallel.recompute.modules=[mla_up_proj, moe_act, layernorm]"
# (model, hardware, GPUs, published TFLOP/s per GPU, overrides giving the published layout)
PUBLISHED = [
    ("qwen3-30b-a3b", "H100", 32, 234.1, []),
    ("qwen3-30b-a3b", "GB200", 16, 528.0, [
        "launch.gpu=gb200", "launch.nodes=4", "launch.gpus_per_node=4", "parallel.ep=16",
        "train.micro_batch_size=4", "train.global_batch_size=512",
        "parallel.recompute.modules=[moe_act, layernorm]"]),  # 165 GB of 186 (until 2026-12-02: 197, +core_attn)
    # MXFP8 with the GEMM inputs kept in fp8, as Megatron-Core with transformer-engine keeps them, and the
    # published recompute: the recipe's own since the routing weights moved into the experts' activation; with
    # the all-to-all dispatcher, then the node-aware one (Megatron-Core's run: DeepEP; the recipe's own)
    ("deepseek-v3", "B200", 256, 776.7, [*MXFP8, PUBLISHED_DSV3, "model.moe.dispatcher=alltoall"]),
    ("deepseek-v3", "B200", 256, 776.7, [*MXFP8, PUBLISHED_DSV3, "model.moe.dispatcher=hierarchical"]),
]


def wall_times(command: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def timings(repeats: int) -> None:
    cli = [sys.executable, "-m", "moe_train.cli.main"]
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "validate deepseek-v3": [*cli, "validate", "deepseek-v3"],
        "plan deepseek-v3 (1024 GPUs)": [*cli, "plan", "deepseek-v3", "--nodes", "128", "--json"],
        "plan deepseek-v3 --search (256 GPUs)": [*cli, "plan", "deepseek-v3", "--search", "--json"],
        "plan qwen3-30b-a3b --search (32 GPUs)": [*cli, "plan", "qwen3-30b-a3b", "--search", "--json"],
    }
    results: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, command in commands.items():
            results[name] += wall_times(command, 1)
    baseline = statistics.median(results["python -c pass"])
    print(f"{'command':40s} {'median s':>9s} {'min s':>7s} {'x python':>9s}")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:40s} {median:9.3f} {min(times):7.3f} {median / baseline:9.1f}")


# The recipe's parallel.ep_overlap (docs/parallel.md, "Overlapped micro-batches"): the plan prices what its
# pairs of micro-batches hide (plan/overlap.py). With pipelining (pp > 1) it is built under pp_schedule dualpipev
# only (the published rows' interleaved_1f1b is refused), so a pp > 1 row's overlapped variant also takes
# dualpipev (vpp 2 in a V, as the published PP8 VPP2). For DeepSeek-V3 that is the like-for-like overlapped
# schedule: it was trained with DualPipe, which exists to hide its expert-parallel all-to-all.
EP_OVERLAP = ["parallel.ep_overlap=true"]
DUALPIPEV = ["parallel.pp_schedule=dualpipev"]


def variants(pp: int) -> list[tuple[str, list[str]]]:
    """The published layout plain, then overlapped (at pp > 1: dualpipev plain, then dualpipev + ep_overlap)."""
    if pp == 1:
        return [("plain", []), ("ep_overlap", EP_OVERLAP)]
    return [("plain", []), ("dualpipev", DUALPIPEV), ("dualpipev+ep_overlap", [*DUALPIPEV, *EP_OVERLAP])]


def published() -> None:
    from moe_train.config import RecipeError, load_recipe
    from moe_train.config.hardware import hardware_table
    from moe_train.config.support import unsupported
    from moe_train.plan.estimate import estimate, plan_json

    # error: of the plan in Megatron-Core's convention (causal attention over half of s x s), as it publishes;
    # "engine": the plan in the engine's own (full s x s, as torch's flop counter and measure count);
    # runs: whether the engine trains the variant (config/support.py) or it is a plan only
    print(f"\n{'model':15s} {'hardware':8s} {'GPUs':>4s} {'variant':20s} {'published':>9s} {'plan':>6s} "
          f"{'error':>7s} {'engine':>6s} {'peak GB':>8s} {'fits':>5s} {'runs':>9s}  "
          "step-time parts (s) of the slowest pipeline rank")
    for name, gpu, gpus, figure, overrides in PUBLISHED:
        pp = load_recipe(name, overrides, check_files=False).parallel.pp
        for variant, extra in variants(pp):
            head = f"{name:15s} {gpu:8s} {gpus:4d} {variant:20s} {figure:9.1f}"
            try:
                recipe = load_recipe(name, [*overrides, *extra], check_files=False)
            except RecipeError as error:  # plan refuses what validate refuses (exit 2)
                print(f"{head}  refused: {error}")
                continue
            assert recipe.world_size == gpus, (name, recipe.world_size)
            data = plan_json(estimate(recipe, hardware_table()[recipe.launch.gpu]))
            t = data["time_s"]
            parts = ", ".join(f"{k} {t[k]:.2f}" for k in ("compute", "elementwise", "comm_total", "comm_exposed",
                                                            "ep_comm_hidden", "moe_sync", "bubble", "optimizer"))
            exposed = ", ".join(f"{k} {c['exposed_fraction']:.2f} of {c['own_s']:.2f} s"
                                for k, c in data["exposed_comm"].items())
            refusals = unsupported(recipe)
            megatron = data["tflops_per_gpu_megatron"]
            error = megatron / figure - 1
            print(f"{head} {megatron:6.1f} {error:+7.1%} {data['tflops_per_gpu']:6.1f} "
                  f"{data['memory_bytes']['total'] / 1e9:8.1f} {str(data['fits']):>5s} "
                  f"{'plan-only' if refusals else 'engine':>9s}  {parts} (pp rank {data['time_rank']['pp']}; "
                  f"memory: pp rank {data['rank']['pp']}); EP comm exposed: {exposed}"
                  + "".join(f"\n{'':20s}refused by the engine: {line}" for line in refusals))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--published-only", action="store_true", help="only part 2 (the table)")
    args = parser.parse_args()
    if not args.published_only:
        timings(args.repeats)
    published()


if __name__ == "__main__":
    main()
