"""Worker: the dualpipev cases of tests/test_pipeline_overlap.py in one job. A case trains (or, with `stop_at`,
stops there and resumes from its checkpoint) and rank 0 saves its record (workers/record.py); the `order` case
instead trains one step, then records the second: every dispatch collective's issue, hand-over, wait and
completion and every compute phase (a hook on each attention's and expert group's forward and backward, in every
chunk of the rank), with the stage pass that ran it, and the OVERLAP_F_B actions of every pipeline rank in the
schedule the trainer built."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def recorded_step(case: dict, run_dir: Path, world: int) -> dict:
    from moe_train.config import load_recipe
    from moe_train.models.moe import collective_turns as turns
    from moe_train.parallel.dual_pipe import overlapped_pairs
    from moe_train.train.loop import Trainer

    recipe = load_recipe(case["recipe"], [*case["overrides"], f"launch.gpus_per_node={world}", f"run_dir={run_dir}",
                                          "train.steps=2"])
    trainer = Trainer(recipe)
    trainer.train_step(1)
    for chunk in trainer.trainable.chunks:
        for name, module in chunk.named_modules():
            if name.endswith(("self_attn", "ffn.experts")):
                kind = name.rsplit(".", 1)[-1]
                module.register_forward_pre_hook(lambda *_, kind=kind: turns.record("compute", f"{kind}.fwd"))
                module.register_full_backward_pre_hook(lambda *_, kind=kind: turns.record("compute", f"{kind}.bwd"))
    with turns.recording() as events:
        trainer.train_step(2)
    schedule = trainer.trainable.pipeline.schedule
    return {"events": [list(event) for event in events],
            "pairs": {rank: [[repr(a) for a in pair] for pair in overlapped_pairs(schedule, rank)]
                      for rank in schedule.pipeline_order}}


def main() -> None:
    spec, result_path, rank, world = start()
    from workers.record import keep_record, record_resumed, record_run

    out: dict = {"saved": {}}
    root = Path(spec["run_root"])
    root.mkdir(parents=True, exist_ok=True)
    for case in spec["cases"]:
        if case["id"] == "order":
            out["order"] = recorded_step(case, root / case["id"], world)
            continue
        if case.get("stop_at"):
            record = record_resumed(case["recipe"], case["overrides"], world=world, run_dir=root / case["id"],
                                    steps=case["steps"], stop_at=case["stop_at"])
        else:
            record = record_run(case["recipe"], case["overrides"], world=world, run_dir=root / case["id"],
                                steps=case["steps"], evaluate=case.get("evaluate", False))
        keep_record(record, run_root=root, case_id=case["id"], rank=rank, saved=out["saved"])
    finish(out, result_path, rank)


if __name__ == "__main__":
    main()
