"""plan's exposed fraction of the expert-parallel communication against measure's, plain and under
`parallel.ep_overlap` and `parallel.split_wgrad` (alone and with it), on 2 gloo ranks of this machine (EP2
all-to-all, qwen3-moe-tiny fp32, 4 micro-batches a rank: 3 overlapped pairs, F0 and B3 alone).

measure: one step of `moe-train measure --nproc 2 --json` per layout, `exposed_comm` (waited / own per
<group>/<op>, docs/measure.md). plan: `estimate` of the same recipe on a hardware row of this machine, each
figure measured here first, in this process, on one thread (the ranks run one each): the GEMM rate at the
model's shapes (every efficiency then 1), the memory bandwidth of a large copy, and the link two ways: (a) the
link alone, a gloo all-to-all of one dispatch's rows between 2 processes doing nothing else (what the plan's
link bandwidth stands for); (b) the plain step's measured all-to-all, its bus bytes over the seconds the plain
step waited on it, so the plan's plain exchanges last what measure's blocked: on this shared 2-core machine
that wait is mostly the peer rank arriving late (both ranks and gloo's threads share 2 cores), not the link.
Each overlapped figure is the schedule model's prediction (plan/overlap.py), not a fit.

Reading it: measure's exposed fraction (waited / own) of the plain step reads about 0.7, not 1: a dispatch's
tensors are issued together and each collective books its own span from its issue to its completion, so the
spans of one batch overlap and the own time is counted about 1.4 times (docs/parallel.md); the plan's plain
fraction is 1 by definition. Under overlap, with the link alone (a), a phase's exchange is far below the
partner's compute and the plan gives the bound 1/M = 0.25, which is what measure's fraction is compared with.
With (b) the plan treats the peer's lateness as link time that only the partner's compute can hide; the real
pair also hides the wait itself, so (b) over-predicts the exposed seconds.

    python bench/bench_overlap_plan.py [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

RECIPE = "qwen3-moe-tiny"
COMMON = ["train.global_batch_size=16", "train.micro_batch_size=2", "parallel.param_gather=per_step",
          "parallel.ep=2", "train.precision=fp32"]
OVERLAP = ["parallel.ep_overlap=true"]
SPLIT = ["parallel.split_wgrad=true"]  # the experts' weight gradients delayed into the dispatch-backward all-to-all
VARIANTS = {"plain": [], "ep_overlap": OVERLAP, "split_wgrad": SPLIT, "overlap+split": [*OVERLAP, *SPLIT]}


def measured(overrides: list[str]) -> dict:
    """measure's exposed_comm of one real step on 2 ranks."""
    argv = [str(Path(sys.executable).parent / "moe-train"), "measure", RECIPE, "--nproc", "2", "--json"]
    for item in overrides:
        argv += ["--set", item]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    return json.loads(subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout)["exposed_comm"]


def _seconds(run, repeats: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def machine_rates(recipe) -> tuple[float, float]:
    """(FLOP/s of this machine's fp32 GEMMs at the model's shapes, one thread; bytes/s of a large copy)."""
    import torch

    torch.set_num_threads(1)
    m = recipe.model
    tokens = recipe.train.micro_batch_size * recipe.train.seq_length
    shapes = [(tokens, m.hidden_size, m.hidden_size), (tokens, m.hidden_size, m.ffn_hidden_size),
              (tokens * m.moe.top_k // m.moe.num_experts, m.hidden_size, m.moe.ffn_hidden_size)]
    flops = seconds = 0.0
    for rows, inner, cols in shapes:
        a, b = torch.randn(rows, inner), torch.randn(inner, cols)
        flops += 2 * rows * inner * cols
        seconds += _seconds(lambda a=a, b=b: a @ b)
    src = torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    copy = _seconds(lambda: dst.copy_(src))
    return flops / seconds, 2 * src.numel() * src.element_size() / copy


def link_alone(payload_bytes: int, repeats: int = 40) -> float:
    """Bytes/s of a gloo all-to-all between 2 processes of this machine sending `payload_bytes` to the other."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "seconds"
        mp.start_processes(_exchange, args=(str(out), payload_bytes, repeats, _free_port()), nprocs=2,
                           start_method="spawn")
        return payload_bytes / float(out.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _exchange(rank: int, out: str, payload_bytes: int, repeats: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = torch.randn(2 * payload_bytes // 4)  # half of it stays on this rank
    got = torch.empty_like(rows)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(got, rows)
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(str(statistics.median(times[5:])))
    dist.destroy_process_group()


def planned(overrides: list[str], link: float | None, plain_waited: dict[str, float]):
    """The plan's exposed_comm of the recipe on this machine's measured row: the link `link` (bytes/s), or
    where None the plain step's exchanges (`plain_waited`)."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import Hardware
    from moe_train.plan.assumptions import Assumptions
    from moe_train.plan.estimate import estimate

    recipe = load_recipe(RECIPE, [*overrides, "launch.nodes=1", "launch.gpus_per_node=2"], check_files=False)
    gemm, memory = machine_rates(recipe)
    ones = Assumptions(gemm_efficiency=1.0, grouped_gemm_efficiency=1.0, attention_efficiency=1.0,
                       nvlink_efficiency=1.0, network_efficiency=1.0)
    probe = Hardware("this-cpu", "this machine", 1 << 40, gemm, 0.0, memory, 1.0, 1.0, 2, 2)
    bus = estimate(recipe, probe, ones).worst.comm.bus
    if link is None:
        link = sum(bus[k] for k in plain_waited) / sum(plain_waited.values())  # bytes/s: the plain step's waits
    plan = estimate(recipe, replace(probe, nvlink_bytes_per_s=link), ones)
    return plan, gemm, memory, link


def main() -> None:
    from moe_train.config import load_recipe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} at the start")
    for round_index in range(args.rounds):
        got_all = {label: measured([*COMMON, *extra]) for label, extra in VARIANTS.items()}
        waited = {k: v["waited_s"] for k, v in got_all["plain"].items()}
        print(f"round {round_index + 1}: EP2 all-to-all, 2 ranks, {RECIPE} fp32, 4 micro-batches a rank")
        recipe = load_recipe(RECIPE, [*COMMON, "launch.nodes=1", "launch.gpus_per_node=2"], check_files=False)
        m = recipe.model
        rows = recipe.train.micro_batch_size * recipe.train.seq_length * m.moe.top_k // 2  # one dispatch's to the peer
        alone = link_alone(rows * m.hidden_size * 4)
        for link_label, link in (("(a) link alone", alone), ("(b) plain step's waits", None)):
            exposed = {}
            for label, extra in VARIANTS.items():
                got = got_all[label]
                plan, gemm, memory, used = planned([*COMMON, *extra], link, waited)
                phases = plan.ep_phases
                for key, comm in plan.exposed_comm.items():
                    real = got[key]
                    exposed[label] = (comm.own_s - comm.hidden_s, real["waited_s"])
                    layers = plan.ranks[0].moe_layer.count
                    per_phase = comm.own_s / (2 * layers * plan.layout.micro_batches)
                    compute = f"{phases.forward_compute_s * 1e3:.2f} / {phases.backward_compute_s * 1e3:.2f}"
                    print(f"  {link_label} {label:<13} {key}: plan {comm.exposed_fraction:.2f} of {comm.own_s:.3f} s "
                          f"(exchange {per_phase * 1e3:.2f} ms a phase against compute {compute} ms forward / "
                          f"backward); measure "
                          f"{real['exposed_fraction']:.2f} of {real['own_s']:.3f} s (waited {real['waited_s']:.3f} s)")
            plan_plain, real_plain = exposed["plain"]
            for label in list(VARIANTS)[1:]:
                plan_seconds, real_seconds = exposed[label]
                print(f"  {link_label}: exposed seconds under {label} / plain: plan {plan_seconds / plan_plain:.2f}, "
                      f"measure {real_seconds / real_plain:.2f}")
            print(f"  {link_label}: link {used / 1e9:.3f} GB/s")
        print(f"  this machine: GEMMs {gemm / 1e9:.1f} GFLOP/s (one thread), copy {memory / 1e9:.1f} GB/s")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
