"""Measure one training step of one rank: build the model (or the layers asked for), run the step under the
FLOP counter, the saved-tensor tracker, the comm counter and the live-bytes tracker, and report.

Three ways to run: in this process at world size 1; on every rank of a torchrun job (`--nproc N`, see
moe_train/measure/rank.py), where rank R writes the report; or `fake` (moe_train/measure/fake.py), in this
process at any world size, playing rank R with fake tensors and a fake process group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_train.config.schema import Recipe
from moe_train.measure.activations import SavedTensorTracker
from moe_train.measure.comm import CommCounter
from moe_train.measure.dtensor import local_dtensor_ops
from moe_train.measure.flops import PhaseFlopCounter
from moe_train.measure.layers import LayerTracker
from moe_train.measure.memory import LiveBytes, grad_bytes, optimizer_bytes, param_bytes
from moe_train.measure.step import train_step
from moe_train.models.init import init_weights, materialize
from moe_train.models.model import Transformer
from moe_train.parallel import parallelize
from moe_train.parallel.bootstrap import bootstrap, shutdown
from moe_train.parallel.context import ParallelContext
from moe_train.train.step import Batch, step_parts


@dataclass(frozen=True, kw_only=True)
class Target:
    """What to measure: which rank, which layers (None: all), fake or real."""

    rank: int = 0
    layers: tuple[int, ...] | None = None
    fake: bool = False
    even_routing: bool = False  # route by the even spread (always, when fake: fake tensors have no values)


def keep_layers(model: Transformer, layers: tuple[int, ...]) -> None:
    """Drop every other layer (and MTP module) from the model, as a pipeline stage does."""
    num_layers = model.cfg.num_layers
    for name in list(model.layers):
        if int(name) not in layers:
            del model.layers[name]
    for name in list(model.mtp):
        if num_layers + int(name) not in layers:
            del model.mtp[name]


def _build(recipe: Recipe, target: Target, ctx: ParallelContext) -> list[Transformer]:
    """The trainer's model chunks (one without a pipeline), cut to the target's layers: built on the meta
    device (fake: directly as fake tensors, shapes only), cut, parallelised, then (real) allocated and
    initialised by name."""
    with torch.device(ctx.device if target.fake else "meta"):
        model = Transformer(recipe.model)
    if target.layers is not None:
        keep_layers(model, target.layers)
    chunks = parallelize(model, recipe, ctx)
    for chunk in chunks:
        if not target.fake:
            materialize(chunk, device=ctx.device)
            init_weights(chunk, seed=recipe.train.seed, init_std=recipe.model.init_std)
        chunk.train()
    return chunks


def _batch(recipe: Recipe, target: Target, device: torch.device, dp_rank: int, dp_size: int) -> Batch:
    """This rank's samples of the first global batch, as the trainer lays them out (micro-batches are views of
    this rank's [B, s + 1] samples); fake token ids of the same shapes under `--fake`."""
    train = recipe.train
    rows = train.global_batch_size // dp_size
    if target.fake:
        samples = torch.randint(recipe.model.vocab_size, (rows, train.seq_length + 1), device=device)
        return Batch(samples[:, :-1], samples[:, 1:], packed_positions(rows, train.seq_length, device)
                     if recipe.data.reset_at_eod else None)
    from moe_train.data import build_datasets, global_batch, position_ids

    datasets = build_datasets(recipe)
    tokens = global_batch(
        datasets.train, step=0, global_batch_size=train.global_batch_size, dp_rank=dp_rank, dp_size=dp_size
    ).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    return Batch(inputs, labels, position_ids(inputs, datasets.eod) if recipe.data.reset_at_eod else None)


def packed_positions(rows: int, seq_length: int, device: torch.device) -> torch.Tensor:
    """Position ids of two packed documents per row (the second starts half-way): with data.reset_at_eod the
    step attends through a document mask, which `--fake` must measure (its values are unknown to the model,
    which takes fake positions as restarting: moe_train/models/attention.py)."""
    half = seq_length // 2
    row = torch.cat([torch.arange(half, device=device), torch.arange(seq_length - half, device=device)])
    return row.expand(rows, seq_length)


@contextlib.contextmanager
def unmeasured_pipeline_warmup(*, fake: bool) -> Iterator[None]:
    """Keep torch's one-time pipeline warm-up out of the step's figures: on its first step every stage votes
    whether its shapes are static, a 4-byte send and receive per stage boundary each way, which later steps do
    not repeat. The vote runs with the counters paused; under fake tensors (no values to vote with) it is not
    run but settled as "static", which is what every stage votes here (static inputs and outputs, pipeline.py)."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.utils._python_dispatch import _disable_current_modes

    original = _PipelineSchedule._warmup_p2p

    def warmup(schedule, stages, *args, **kwargs) -> None:
        if fake:
            for stage in stages:
                stage._inference_mode = InferenceMode.STATIC
            return
        with _disable_current_modes():
            original(schedule, stages, *args, **kwargs)

    _PipelineSchedule._warmup_p2p = warmup
    try:
        yield
    finally:
        _PipelineSchedule._warmup_p2p = original


def measure_step(recipe: Recipe, target: Target, ctx: ParallelContext) -> dict:
    """Run one step on this rank (every rank of the job calls it) and return the report dict."""
    torch.manual_seed(recipe.train.seed)
    chunks = _build(recipe, target, ctx)
    for chunk in chunks:
        chunk.set_even_routing(target.fake or target.even_routing)
    parts = step_parts(chunks, recipe, ctx)
    batch = _batch(recipe, target, ctx.device, ctx.coord("dp"), ctx.size("dp"))
    micro_batches = len(batch.inputs) // recipe.train.micro_batch_size
    grads: dict[str, int] = {}

    def gradients_ready(*_) -> None:  # the gradients exist between backward and the update
        grads["bytes"] = sum(grad_bytes(chunk) for chunk in chunks)

    parts.optimizers[0].register_step_pre_hook(gradients_ready)

    layers = LayerTracker(chunks)
    saved = SavedTensorTracker(chunks, layers)
    comm = CommCounter(ctx.group_name)
    flops = PhaseFlopCounter(layers)
    live = LiveBytes([t for chunk in chunks for t in (*chunk.parameters(), *chunk.buffers())])
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(unmeasured_pipeline_warmup(fake=target.fake))
        for context in (local_dtensor_ops(), live, comm, flops, saved):
            stack.enter_context(context)
        train_step(chunks, parts, batch, recipe=recipe, ctx=ctx)
    layers.close()
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else live.peak
    per_layer = saved.per_layer()
    return {
        "world_size": ctx.world_size,
        "rank": ctx.rank,
        "layers": sorted(layers.layers),
        "activation_bytes_per_layer": per_layer,
        "activation_bytes_total": sum(per_layer.values()),
        "param_bytes": sum(param_bytes(chunk) for chunk in chunks),
        "grad_bytes": grads.get("bytes", 0),
        "optimizer_bytes": sum(optimizer_bytes(optimizer) for optimizer in parts.optimizers),
        "flops": flops.totals(),
        "comm_bytes": dict(sorted(comm.bytes.items())),
        "peak_memory_bytes": peak,
        # Extras (docs/measure.md): how the step was run.
        "fake": target.fake,
        "micro_batches": micro_batches,
        "activation_bytes_peak": saved.peak,
        "tokens": micro_batches * recipe.train.micro_batch_size * recipe.train.seq_length,
        "comm_calls": dict(sorted(comm.calls.items())),
    }


def measure(recipe: Recipe, target: Target) -> dict:
    """measure_step in this process: fake (any world size, playing `target.rank`) or real at world size 1.

    Raises RecipeError for a recipe the engine cannot train yet (bootstrap checks), ValueError for a real
    measurement of more than one rank (that needs torchrun: `--nproc`)."""
    if not target.fake:
        if recipe.world_size != 1:
            raise ValueError(f"the recipe asks for {recipe.world_size} ranks; run it with --nproc or --fake")
        ctx = bootstrap(recipe, distinct_groups=True)
        try:
            return measure_step(recipe, target, ctx)
        finally:
            shutdown(ctx)
    from moe_train.measure.fake import fake_process_group, fake_tensors

    if torch.distributed.is_initialized():
        raise RuntimeError("--fake plays one rank of its own fake process group; this process already has one")
    # Fake tensors have CPU semantics whatever the recipe's device; the meshes are real (built before fake mode).
    on_cpu = recipe.model_copy(update={"launch": recipe.launch.model_copy(update={"device": "cpu"})})
    threads = torch.get_num_threads()  # bootstrap sets one thread per rank; this process is one rank of none
    with fake_process_group(rank=target.rank, world_size=recipe.world_size):
        ctx = bootstrap(on_cpu, distinct_groups=True)
        torch.set_num_threads(threads)
        with fake_tensors():
            return measure_step(on_cpu, target, ctx)
