"""Wall time of `moe-train validate deepseek-v3` against `python -c pass`, side by side in one run.

The login node must answer in well under a second; the ratio to a bare interpreter start is what this
machine's noise cannot hide. Run: python bench/bench_validate.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def wall_times(command: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "moe-train validate deepseek-v3": [sys.executable, "-m", "moe_train.cli.main", "validate", "deepseek-v3"],
        "moe-train recipes show deepseek-v3": [
            sys.executable, "-m", "moe_train.cli.main", "recipes", "show", "deepseek-v3"
        ],
    }
    # Interleave the commands so drifting machine load hits all of them alike.
    results: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, command in commands.items():
            results[name] += wall_times(command, 1)
    baseline = statistics.median(results["python -c pass"])
    print(f"{'command':40s} {'median s':>9s} {'min s':>7s} {'x python':>9s}")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:40s} {median:9.3f} {min(times):7.3f} {median / baseline:9.1f}")


if __name__ == "__main__":
    main()
