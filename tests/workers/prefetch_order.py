"""Worker: one bf16 step of qwen3-tiny (3 layers) under FSDP2 on this job's ranks; rank 0 reports, for each decoder
block, which block had last been entered when its parameters were first gathered in the first forward."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def main() -> None:
    spec, result_path, rank, world = start()
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from moe_train.config import load_recipe
    from moe_train.train.loop import Trainer

    recipe = load_recipe("qwen3-tiny", ["model.num_layers=3", "train.seq_length=16", "train.micro_batch_size=1",
                                        f"train.global_batch_size={world}", "train.precision=bf16",
                                        "checkpoint.interval=null", "train.eval_interval=null",
                                        f"launch.gpus_per_node={world}", f"run_dir={spec['run_dir']}",
                                        "train.steps=1"])
    trainer = Trainer(recipe)
    (model,) = trainer.chunks
    blocks = {id(block): name for name, block in model.layers.items()}
    entered: list[str] = []
    first: dict[str, str | None] = {}  # block -> block last entered when it was first gathered
    for name, block in model.layers.items():  # before FSDP2's own pre-forward hook, which gathers
        block.register_forward_pre_hook(lambda module, args, name=name: entered.append(name), prepend=True)
    unshard = FSDPParamGroup.unshard

    def recording(group, *args, **kwargs):
        names = [blocks[id(module)] for module in group.modules if id(module) in blocks]
        if names and len(entered) < len(blocks):  # the first forward, before its last block is entered
            first.setdefault(names[0], entered[-1] if entered else None)
        return unshard(group, *args, **kwargs)

    FSDPParamGroup.unshard = recording
    trainer.train_step(1)
    finish({"order": list(model.layers), "first": first}, result_path, rank)


if __name__ == "__main__":
    main()
