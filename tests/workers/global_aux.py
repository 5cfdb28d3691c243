"""Worker: global_aux_loss over the data-parallel group. Every rank runs two micro-batches of its own tokens
through the same MoE model (plain, no sharding) whose layers count loads over the whole world; rank 0 gathers
each rank's router scores, chosen experts, recorded loss values and attached router gradients for the test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def main() -> None:
    spec, result_path, rank, world = start()
    import torch
    import torch.distributed as dist

    from moe_train.config import load_recipe
    from moe_train.models import build_model
    from moe_train.models.moe import MoELayer

    recipe = load_recipe("qwen3-moe-tiny", ["model.num_layers=2", "model.moe.router.load_balancing=global_aux_loss",
                                            "model.moe.router.aux_loss_coeff=0.1"])
    model = build_model(recipe.model, seed=5)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    seen: list[list] = [[] for _ in layers]
    for index, layer in enumerate(layers):
        layer.balance_group = dist.group.WORLD
        layer.router.register_forward_hook(
            lambda mod, args, out, index=index: seen[index].append((args[0].detach(), out)))
    micro_batches = [torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(100 * rank + m))
                     for m in range(spec["micro_batches"])]
    record = {"values": [], "grads": [], "scores": [], "indices": []}
    for tokens in micro_batches:
        before = [layer.aux_loss_value.item() for layer in layers]
        model.zero_grad()
        out = model(tokens, labels=tokens)
        (out.lm_sum * 0).backward()  # the attached balancing gradients alone
        record["values"].append([layer.aux_loss_value.item() - b for layer, b in zip(layers, before, strict=True)])
        record["grads"].append([layer.router.weight.grad.tolist() for layer in layers])
    record["inputs"] = [[x.tolist() for x, _ in per_layer] for per_layer in seen]
    record["indices"] = [[r.topk_indices.tolist() for _, r in per_layer] for per_layer in seen]
    record["weights"] = [layer.router.weight.tolist() for layer in layers]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, record)
    finish({"ranks": gathered}, result_path, rank)


if __name__ == "__main__":
    main()
