"""Worker: one overlapped step (parallel.ep_overlap) recorded: every dispatch collective's issue and completion
(models/moe/collective_turns.py) and every compute phase (a hook on each attention's and expert group's forward and
backward), with the micro-batch that ran it; and the measured wait and own time per collective kind, overlapped
and plain."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def main() -> None:
    spec, result_path, rank, world = start()
    from moe_train.config import load_recipe
    from moe_train.models.moe import collective_turns as overlap
    from moe_train.train.loop import Trainer

    out = {}
    for case in spec["cases"]:
        run_dir = Path(spec["run_root"]) / case["id"]
        recipe = load_recipe(
            case["recipe"], [*case["overrides"], f"launch.gpus_per_node={world}", f"run_dir={run_dir}", "train.steps=2"]
        )
        trainer = Trainer(recipe)
        trainer.train_step(1)
        (model,) = trainer.trainable.chunks
        for name, module in model.named_modules():
            if name.endswith(("self_attn", "ffn.experts")):
                label = name.rsplit(".", 1)[-1]
                module.register_forward_pre_hook(lambda *_, label=label: overlap.record("compute", f"{label}.fwd"))
                module.register_full_backward_pre_hook(
                    lambda *_, label=label: overlap.record("compute", f"{label}.bwd")
                )
        overlap.reset_comm_wait_times()
        with overlap.recording() as events:
            trainer.train_step(2)
        out[case["id"]] = {
            "events": [list(event) for event in events],
            "times": overlap.comm_wait_times(trainer.ctx.group_name),
        }
    finish(out, result_path, rank)


if __name__ == "__main__":
    main()
