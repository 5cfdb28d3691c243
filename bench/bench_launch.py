"""Launch-side timings, each next to `python -c pass` measured in the same run (the floor of any command).

    python bench/bench_launch.py [--repeats 5]

- a 100-point sweep (10 learning rates x 10 seeds of qwen3-moe-tiny): validated, run folders written, job array
  rendered, end to end through the CLI, and in-process (what a login node pays per point);
- `render` of the full-size deepseek-v3 recipe to an sbatch script, through the CLI.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LRS = ",".join(f"{i}e-3" for i in range(1, 11))
SEEDS = ",".join(str(s) for s in range(10))


def wall(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def median_wall(argv_for_round, cwd: Path, repeats: int) -> float:
    return statistics.median(wall(argv_for_round(i), cwd) for i in range(repeats))


def in_process_sweep(root: Path) -> tuple[float, int]:
    from moe_train.launch.sweep import expand, parse_axes, submit_arrays, write_sweep

    start = time.perf_counter()
    axes = parse_axes([f"train.lr={LRS}", f"train.seed={SEEDS}"])
    sweep_dir, points = expand("qwen3-moe-tiny", [f"run_dir={root}"], axes)
    write_sweep("qwen3-moe-tiny", [], axes, sweep_dir, points)
    submit_arrays(sweep_dir, points, dry_run=True)
    return time.perf_counter() - start, sum(p.valid for p in points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="Runs of each command; the median is reported.")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "moe_train.cli.main"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        floor = median_wall(lambda i: [sys.executable, "-c", "pass"], work, args.repeats)
        sweep_cli = median_wall(
            lambda i: [*cli, "sweep", "qwen3-moe-tiny", "--set", f"run_dir={work}/cli-{i}", "--grid",
                       f"train.lr={LRS}", "--grid", f"train.seed={SEEDS}"],
            work, args.repeats)
        sweep_dry = median_wall(
            lambda i: [*cli, "sweep", "qwen3-moe-tiny", "--set", f"run_dir={work}/dry", "--grid",
                       f"train.lr={LRS}", "--grid", f"train.seed={SEEDS}", "--dry-run"],
            work, args.repeats)
        render_ds = median_wall(
            lambda i: [*cli, "render", "deepseek-v3", "-t", "slurm", "--set", f"run_dir={work}/ds-{i}", "-o",
                       f"{work}/ds-{i}.sbatch"],
            work, args.repeats)
        help_floor = median_wall(lambda i: [*cli, "--help"], work, args.repeats)
        in_proc = [in_process_sweep(work / f"inproc-{i}") for i in range(args.repeats)]
        per_sweep = statistics.median(t for t, _ in in_proc)
        points = in_proc[0][1]

    print(f"python -c pass                         {floor * 1e3:8.1f} ms   1.00x")
    print(f"moe-train --help                       {help_floor * 1e3:8.1f} ms   {help_floor / floor:5.2f}x")
    print(f"moe-train sweep, 100 points, --dry-run {sweep_dry * 1e3:8.1f} ms   {sweep_dry / floor:5.2f}x")
    print(f"moe-train sweep, 100 points, written   {sweep_cli * 1e3:8.1f} ms   {sweep_cli / floor:5.2f}x")
    print(f"moe-train render deepseek-v3 -t slurm  {render_ds * 1e3:8.1f} ms   {render_ds / floor:5.2f}x")
    print(f"in-process sweep ({points} valid points)   {per_sweep * 1e3:8.1f} ms   "
          f"{per_sweep / points * 1e3:.2f} ms per point")


if __name__ == "__main__":
    main()
