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


def layer_saved_bytes(recipe_name: str, overrides: list[str], *, world: int, layers: list[int]) -> tuple[dict, dict]:
    """{layer index: (bytes this rank's forward of the layer saves for backward, the plan's formula)}, and
    {layer index: where each GEMM of that forward came from} (helpers.gemm_origins).

    The model is tensor-parallelised (no FSDP: its gathered weights would be saved storages to tell apart from
    activations); each storage counts once, parameters and the rotary tables every layer shares excluded."""
    import torch
    from torch.distributed.tensor import DTensor

    from moe_train.config import load_recipe
    from moe_train.models import build_model
    from moe_train.models.init import init_weights, materialize
    from moe_train.parallel.bootstrap import bootstrap
    from moe_train.parallel.tensor import apply_tensor_parallel
    from moe_train.plan.activation_memory import layer_activation_bytes
    from moe_train.plan.saved_tensors import ActivationLayout

    recipe = load_recipe(recipe_name, [*overrides, f"launch.gpus_per_node={world}"])
    ctx = bootstrap(recipe)
    cfg, train, tp = recipe.model, recipe.train, ctx.size("tp")
    model = build_model(cfg, device="meta")
    apply_tensor_parallel(model, recipe, ctx)
    materialize(model, device="cpu")
    init_weights(model, seed=train.seed, init_std=cfg.init_std)
    params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()}
    seq = train.seq_length
    cos, sin = model.rope(torch.arange(seq).unsqueeze(0))
    params |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    rows = seq // tp if recipe.parallel.sequence_parallel else seq
    torch.manual_seed(ctx.coord("tp"))
    from helpers import gemm_origins

    out, gemms = {}, {}
    for index in layers:
        x = torch.randn(train.micro_batch_size, rows, cfg.hidden_size, requires_grad=True)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen=seen) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), gemm_origins() as origins:
            model.layers[str(index)](x, cos, sin, None)
        gemms[index] = origins.origins
        lay = ActivationLayout(micro_batch=train.micro_batch_size, seq_length=seq, act_bytes=4, tp=tp,
                               sequence_parallel=recipe.parallel.sequence_parallel)
        out[index] = (sum(seen.values()), layer_activation_bytes(cfg, lay, layer_index=index))
    return out, gemms


def main() -> None:
    spec, result_path, rank, world = start()
    from workers.record import keep_record, record_run

    saved = {}
    Path(spec["run_root"]).mkdir(parents=True, exist_ok=True)
    for case in spec.get("activations", []):
        measured, gemms = layer_saved_bytes(case["recipe"], case["overrides"], world=world, layers=case["layers"])
        if rank == 0:
            saved[case["id"]] = measured
            saved[case["id"].replace("bytes-", "gemms-", 1)] = gemms
    for case in spec["cases"]:
        prepare = force_expert(case["force_expert"]) if case.get("force_expert") is not None else None
        record = record_run(case["recipe"], case["overrides"], world=world, run_dir=Path(spec["run_root"]) / case["id"],
                            steps=case["steps"], prepare=prepare)
        record["differing_across_ranks"] = differing_across_ranks(record["state"])
        keep_record(record, run_root=Path(spec["run_root"]), case_id=case["id"], rank=rank, saved=saved)
    finish(saved, result_path, rank)


if __name__ == "__main__":
    main()
