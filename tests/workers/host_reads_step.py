"""Worker: for each case, train one step, then count the host reads of a second (tests/host_reads.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def main() -> None:
    spec, result_path, rank, world = start()
    from host_reads import HostReads

    from moe_train.config import load_recipe
    from moe_train.train.loop import Trainer

    out = {}
    for case in spec["cases"]:
        run_dir = Path(spec["run_root"]) / case["id"]
        recipe = load_recipe(case["recipe"], [*case["overrides"], f"launch.gpus_per_node={world}",
                                              f"run_dir={run_dir}", "train.steps=2"])
        trainer = Trainer(recipe)
        trainer.train_step(1)
        reads = HostReads()
        with reads.counting():
            trainer.train_step(2)
        out[case["id"]] = dict(reads.by_line)
    finish(out, result_path, rank)


if __name__ == "__main__":
    main()
