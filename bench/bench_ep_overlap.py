"""Overlapped micro-batches (`parallel.ep_overlap`) against the plain step on this machine: the exposed fraction
of the expert-parallel communication and tokens/s, with and without overlap and `parallel.split_wgrad` (the
experts' weight gradients delayed into the dispatch's backward all-to-all), on 2 and 4 gloo ranks (1 thread
each), side by side in one run.

Each layout runs plain and overlapped in turn (the same recipe, global batch and FSDP2 cadence: parameters
gathered once a step, which ep_overlap needs): tokens/s is a real `moe-train run` (bench_dp.py's runner, the
median of the steps after the first two), the exposed fraction one step of `moe-train measure --nproc N --json`
on real ranks: the summed wait of the compute thread on the dispatchers' collectives over their summed own
time (`exposed_comm`, docs/measure.md). 4 micro-batches a rank: 3 overlapped pairs a step, F0 and B3 alone.

    python bench/bench_ep_overlap.py [--steps 6] [--rounds 1] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dp import run  # noqa: E402

RECIPE = "qwen3-moe-tiny"
COMMON = ["train.global_batch_size=16", "train.micro_batch_size=2", "parallel.param_gather=per_step"]
LAYOUTS = {  # name: (ranks, overrides); 4 micro-batches a rank at dp 2
    "EP2 alltoall, 2 ranks": (2, ["parallel.ep=2"]),
    "EP2 x TP2 + SP, 4 ranks": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
}
OVERLAP = ["parallel.ep_overlap=true"]
SPLIT = ["parallel.split_wgrad=true"]  # the experts' weight gradients delayed into the dispatch-backward all-to-all
VARIANTS = (("plain", []), ("split_wgrad", SPLIT), ("ep_overlap", OVERLAP), ("overlap+split", [*OVERLAP, *SPLIT]))


def exposed_fraction(overrides: list[str], ranks: int) -> tuple[float, dict]:
    """One measured step on `ranks` real ranks: summed waited / summed own seconds of its EP collectives."""
    argv = [str(Path(sys.executable).parent / "moe-train"), "measure", RECIPE, "--nproc", str(ranks), "--json"]
    for item in [*overrides, "train.precision=fp32"]:
        argv += ["--set", item]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    exposed = json.loads(out)["exposed_comm"]
    waited = sum(times["waited_s"] for times in exposed.values())
    own = sum(times["own_s"] for times in exposed.values())
    return waited / own, exposed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=None, help="only the layouts on this many ranks")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for name, (ranks, layout) in LAYOUTS.items():
                if args.ranks is not None and ranks != args.ranks:
                    continue
                rows = {}
                for label, extra in VARIANTS:
                    overrides = [*COMMON, *layout, *extra]
                    run_dir = Path(tmp) / f"{round_index}-{ranks}-{label}"
                    rate = run(RECIPE, overrides, ranks, 1, run_dir, args.steps)
                    fraction, exposed = exposed_fraction(overrides, ranks)
                    rows[label] = (rate, fraction, exposed)
                print(f"{name} ({RECIPE}, round {round_index + 1}):")
                base = rows["plain"][0]
                for label, (rate, fraction, exposed) in rows.items():
                    kinds = ", ".join(
                        f"{kind} {t['exposed_fraction']:.2f} of {t['own_s']:.3f} s" for kind, t in exposed.items()
                    )
                    print(
                        f"  {label:<13} {rate:>8,.0f} tokens/s  x{rate / base:.2f}  exposed EP comm {fraction:.2f}"
                        f"  ({kinds})"
                    )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
