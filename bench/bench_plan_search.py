"""`plan --search` of deepseek-v3 on 1,024 B200s (128 nodes), in-process, this tree against a git ref (default
main) side by side, interleaved so drifting load hits both alike; prints each median (wall and the process's
CPU time, which a shared machine's load disturbs less) and the ratios, and says when the results differ. Target:
under 2 s on a quiet login node (14 s before the search pruned by a lower bound, 3.5 s before cp, etp and the
dispatchers joined the search).

This tree runs twice, as it is and with search(memo=False) (the candidates' shared memo off).

Run: python bench/bench_plan_search.py [--ref main] [--repeats N] [--nodes 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMED = """
import sys, time
from moe_train.config import load_recipe
from moe_train.config.hardware import hardware_table
from moe_train.plan.search import search
recipe = load_recipe("deepseek-v3", ["launch.nodes={nodes}"])
start, cpu = time.perf_counter(), time.process_time()
best, valid, fits = search(recipe, hardware_table()[recipe.launch.gpu]{options})
print(time.perf_counter() - start, time.process_time() - cpu, valid, fits, round(best[0].plan.tokens_per_s))
"""


def run(tree: Path, nodes: int, options: str = "") -> tuple[float, float, str]:
    out = subprocess.run([sys.executable, "-c", TIMED.format(nodes=nodes, options=options)], capture_output=True,
                         text=True,
                         cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr.strip().splitlines()[-1]}")
    seconds, cpu, *rest = out.stdout.split()
    return float(seconds), float(cpu), " ".join(rest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ref", default="main")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.ref], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        # this tree twice: as it runs, and without the memo its candidates share (search(memo=False))
        trees = {args.ref: (Path(tmp), ""), "this tree": (ROOT, ""), "no memo": (ROOT, ", memo=False")}
        times: dict[str, list[float]] = {name: [] for name in trees}
        cpu: dict[str, list[float]] = {name: [] for name in trees}
        found = {}
        for _ in range(args.repeats):
            for name, (tree, options) in trees.items():
                seconds, used, found[name] = run(tree, args.nodes, options)
                times[name].append(seconds)
                cpu[name].append(used)
    for name, values in times.items():
        print(f"{name:10s} median {statistics.median(values):7.2f} s wall, {statistics.median(cpu[name]):7.2f} s "
              f"CPU  (min {min(values):.2f} wall; valid, fitting, best tokens/s: {found[name]})")
    for label, series in (("wall", times), ("CPU", cpu)):
        mine = statistics.median(series["this tree"])
        print(f"ratio {label} {mine / statistics.median(series[args.ref]):.2f} (this tree / {args.ref}), "
              f"{mine / statistics.median(series['no memo']):.2f} (this tree / no memo)")
    for name in (args.ref, "no memo"):
        if found["this tree"] != found[name]:
            print(f"DIFFERENT RESULT: {found['this tree']} against {name}'s {found[name]}")


if __name__ == "__main__":
    main()
