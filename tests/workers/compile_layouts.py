"""Worker: train each case of the spec on this job's ranks (compiled blocks, the chunked loss); rank 0 saves each
case's record, with the graphs torch.compile had made after each step (`graphs`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def counting_graphs(graphs: list[int]):
    """A `prepare` for record_run: append the graphs torch.compile has made so far, before the first step and
    after every step (counts of this process: a case's own are the differences)."""
    from torch._dynamo.utils import counters

    def prepare(trainer) -> None:
        step = trainer.train_step
        graphs.append(counters["stats"]["unique_graphs"])

        def counted(*args, **kwargs):
            result = step(*args, **kwargs)
            graphs.append(counters["stats"]["unique_graphs"])
            return result

        trainer.train_step = counted

    return prepare


def main() -> None:
    spec, result_path, rank, world = start()
    from workers.record import keep_record, record_run

    saved = {}
    Path(spec["run_root"]).mkdir(parents=True, exist_ok=True)
    for case in spec["cases"]:
        graphs: list[int] = []
        record = record_run(case["recipe"], case["overrides"], world=world, run_dir=Path(spec["run_root"]) / case["id"],
                            steps=case["steps"], prepare=counting_graphs(graphs))
        keep_record({**record, "graphs": graphs}, run_root=Path(spec["run_root"]), case_id=case["id"], rank=rank,
                    saved=saved)
    finish(saved, result_path, rank)


if __name__ == "__main__":
    main()
