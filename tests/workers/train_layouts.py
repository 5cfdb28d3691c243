"""Worker: train each case of the spec on this job's ranks; rank 0 saves each case's record for the test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def main() -> None:
    spec, result_path, rank, world = start()
    from workers.record import keep_record, record_resumed, record_run

    saved = {}
    Path(spec["run_root"]).mkdir(parents=True, exist_ok=True)
    for case in spec["cases"]:
        run_dir = Path(spec["run_root"]) / case["id"]
        if case.get("stop_at"):
            record = record_resumed(case["recipe"], case["overrides"], world=world, run_dir=run_dir,
                                    steps=case["steps"], stop_at=case["stop_at"],
                                    resume_overrides=tuple(case.get("resume_overrides", ())))
        else:
            record = record_run(case["recipe"], case["overrides"], world=world, run_dir=run_dir, steps=case["steps"],
                                evaluate=case.get("evaluate", False))
        keep_record(record, run_root=Path(spec["run_root"]), case_id=case["id"], rank=rank, saved=saved)
    finish(saved, result_path, rank)


if __name__ == "__main__":
    main()
