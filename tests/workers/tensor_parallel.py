"""Worker: train each case of the spec on this job's ranks (tensor/sequence parallel layouts); rank 0 saves each
case's record. Every rank also checks that its full copy of every parameter and buffer after the last step is
bit-equal to every other rank's: parameters replicated over tp (norms, router, MLA down projections) must not
drift apart, and the expert bias must move identically everywhere."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def force_expert(expert: int):
    """A `prepare` for record_run: a selection bias so large that every token picks `expert` first."""
    import torch

    def prepare(trainer) -> None:
        with torch.no_grad():
            for layer in trainer.moe_layers.values():
                layer.router.expert_bias[expert] = 100.0

    return prepare


def differing_across_ranks(state: dict) -> list[str]:
    """Names whose tensor is not bit-equal on every rank."""
    import torch
    import torch.distributed as dist

    differing = []
    for name, value in state.items():
        gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, value.contiguous())
        if not all(torch.equal(other, value) for other in gathered):
            differing.append(name)
    return differing


def main() -> None:
    spec, result_path, rank, world = start()
    import torch
    from workers.record import record_run

    saved = {}
    Path(spec["run_root"]).mkdir(parents=True, exist_ok=True)
    for case in spec["cases"]:
        prepare = force_expert(case["force_expert"]) if case.get("force_expert") is not None else None
        record = record_run(case["recipe"], case["overrides"], world=world, run_dir=Path(spec["run_root"]) / case["id"],
                            steps=case["steps"], prepare=prepare)
        record["differing_across_ranks"] = differing_across_ranks(record["state"])
        if rank == 0:
            path = Path(spec["run_root"]) / f"{case['id']}.pt"
            torch.save(record, path)
            saved[case["id"]] = str(path)
    finish(saved, result_path, rank)


if __name__ == "__main__":
    main()
