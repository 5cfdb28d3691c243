"""Measure one training step of one rank: build the model (or the layers asked for), run the step under the
FLOP counter, the saved-tensor tracker, the comm counter and the live-bytes tracker, and report.

Three ways to run: in this process at world size 1; on every rank of a torchrun job (`--nproc N`, see
moe_train/measure/rank.py), where rank R writes the report; or `fake` (moe_train/measure/fake.py), in this
process at any world size, playing rank R with fake tensors and a fake process group.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_train.config.schema import Recipe
from moe_train.measure.activations import SavedTensorTracker
from moe_train.measure.comm import CommCounter, mesh_group_namer
from moe_train.measure.dtensor import local_dtensor_ops
from moe_train.measure.flops import PhaseFlopCounter
from moe_train.measure.layers import LayerTracker
from moe_train.measure.memory import LiveBytes, grad_bytes, optimizer_bytes, param_bytes
from moe_train.measure.step import MicroBatch, train_step
from moe_train.models.model import Transformer
from moe_train.parallel.mesh import Meshes, MeshShape, build_meshes


@dataclass(frozen=True, kw_only=True)
class Target:
    """What to measure: which rank, which layers (None: all), fake or real."""

    rank: int = 0
    layers: tuple[int, ...] | None = None
    fake: bool = False


def keep_layers(model: Transformer, layers: tuple[int, ...]) -> None:
    """Drop every other layer (and MTP module) from the model, as a pipeline stage does."""
    num_layers = model.cfg.num_layers
    for name in list(model.layers):
        if int(name) not in layers:
            del model.layers[name]
    for name in list(model.mtp):
        if num_layers + int(name) not in layers:
            del model.mtp[name]


def _build(recipe: Recipe, target: Target, device: torch.device) -> Transformer:
    """The model cut to the target's layers: fake tensors (built directly under fake mode, shapes only), or
    built on the meta device, cut, then materialised and initialised by name."""
    from moe_train.models.init import materialize

    with torch.device(device if target.fake else "meta"):
        model = Transformer(recipe.model)
    if target.layers is not None:
        keep_layers(model, target.layers)
    if not target.fake:
        materialize(model, device=device, seed=recipe.train.seed, init_std=recipe.model.init_std)
    model.train()
    return model


def _micro_batches(recipe: Recipe, target: Target, device: torch.device, dp_rank: int, dp_size: int) -> list:
    train = recipe.train
    count = train.global_batch_size // (train.micro_batch_size * dp_size)
    if target.fake:  # as the trainer lays them out: micro-batches are views of this rank's [B, s + 1] samples
        samples = torch.randint(recipe.model.vocab_size, (count * train.micro_batch_size, train.seq_length + 1),
                                device=device)
        return [MicroBatch(inputs=t[:, :-1], labels=t[:, 1:], positions=None)
                for t in samples.split(train.micro_batch_size)]
    from moe_train.data import build_datasets, global_batch, position_ids

    datasets = build_datasets(recipe)
    tokens = global_batch(
        datasets.train, step=0, global_batch_size=train.global_batch_size, dp_rank=dp_rank, dp_size=dp_size
    ).to(device)
    out = []
    for micro in tokens.split(train.micro_batch_size):
        inputs, labels = micro[:, :-1], micro[:, 1:]
        positions = position_ids(inputs, datasets.eod) if recipe.data.reset_at_eod else None
        out.append(MicroBatch(inputs=inputs, labels=labels, positions=positions))
    return out


def device_of(recipe: Recipe, target: Target) -> torch.device:
    if recipe.launch.device == "cuda" and not target.fake:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def measure_step(recipe: Recipe, target: Target, meshes: Meshes | None) -> dict:
    """Run one step on this rank and return the report dict; `meshes` exist when a process group does."""
    from moe_train.train.optimizer import build_optimizer

    device = device_of(recipe, target)
    torch.manual_seed(recipe.train.seed)
    distributed = meshes is not None
    dp_group = meshes.dense.get_group("dp") if meshes is not None else None
    dp_rank, dp_size = (dp_group.rank(), dp_group.size()) if dp_group is not None else (0, 1)

    model = _build(recipe, target, device)
    optimizer = build_optimizer(model, train=recipe.train)
    micro_batches = _micro_batches(recipe, target, device, dp_rank, dp_size)
    grads: dict[str, int] = {}

    def gradients_ready(*_) -> None:  # the gradients exist between backward and the update
        grads["bytes"] = grad_bytes(model)

    optimizer.register_step_pre_hook(gradients_ready)

    layers = LayerTracker(model)
    saved = SavedTensorTracker(model, layers)
    comm = CommCounter(mesh_group_namer([meshes.dense, meshes.expert]) if meshes is not None else str)
    flops = PhaseFlopCounter(layers)
    live = LiveBytes([*model.parameters(), *model.buffers()])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with contextlib.ExitStack() as stack:
        for context in (local_dtensor_ops(), live, comm, flops, saved):
            stack.enter_context(context)
        train_step(model, optimizer, micro_batches, recipe=recipe, device=device, dp_group=dp_group)
    layers.close()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else live.peak
    per_layer = saved.per_layer()
    return {
        "world_size": recipe.world_size,
        "rank": dist.get_rank() if distributed else 0,
        "layers": sorted(layers.layers),
        "activation_bytes_per_layer": per_layer,
        "activation_bytes_total": sum(per_layer.values()),
        "param_bytes": param_bytes(model),
        "grad_bytes": grads.get("bytes", 0),
        "optimizer_bytes": optimizer_bytes(optimizer),
        "flops": flops.totals(),
        "comm_bytes": dict(sorted(comm.bytes.items())),
        "peak_memory_bytes": peak,
        # Extras (docs/measure.md): how the step was run.
        "fake": target.fake,
        "micro_batches": len(micro_batches),
        "tokens": len(micro_batches) * recipe.train.micro_batch_size * recipe.train.seq_length,
        "comm_calls": dict(sorted(comm.calls.items())),
    }


def measure(recipe: Recipe, target: Target) -> dict:
    """measure_step in this process: fake (any world size) or real at world size 1."""
    if not target.fake:
        if int(os.environ.get("WORLD_SIZE", "1")) != recipe.world_size:
            raise ValueError(f"the recipe asks for {recipe.world_size} ranks; run it with --nproc or --fake")
        return measure_step(recipe, target, None)
    from moe_train.measure.fake import even_routing, fake_process_group, fake_tensors

    with contextlib.ExitStack() as stack:
        meshes = None
        if recipe.world_size > 1:
            stack.enter_context(fake_process_group(rank=target.rank, world_size=recipe.world_size))
            meshes = build_meshes(MeshShape.from_recipe(recipe), "cpu")  # real mesh tensors: before fake mode
        stack.enter_context(even_routing())
        stack.enter_context(fake_tensors())
        return measure_step(recipe, target, meshes)

