"""Measure one training step of one rank: build the model (or the layers asked for), run the step under the
FLOP counter, the saved-tensor tracker, the comm counter and the live-bytes tracker, and report.

Three ways to run: in this process at world size 1; on every rank of a torchrun job (`--nproc N`, see
moe_train/measure/rank.py), where rank R writes the report; or `fake` (moe_train/measure/fake.py), in this
process at any world size, playing rank R with fake tensors and a fake process group.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moe_train.config.fp8_auto import with_fp8_resolved
from moe_train.config.schema import Recipe
from moe_train.measure.activations import SavedTensorTracker
from moe_train.measure.derive import NotAffine, derive, sample_counts, with_micro_batches
from moe_train.measure.dtensor import local_dtensor_ops
from moe_train.measure.flops import PhaseFlopCounter
from moe_train.measure.layers import LayerTracker, in_backward
from moe_train.measure.memory import LiveBytes, gathered_param_bytes, grad_bytes, optimizer_bytes, param_bytes
from moe_train.measure.targets import as_fake_runs
from moe_train.measure.traffic import CollectiveTraffic
from moe_train.models.fp8.gemm import count_fp8_flops, count_fp8_gemms
from moe_train.models.moe.collective_turns import comm_wait_times, reset_comm_wait_times
from moe_train.parallel.bootstrap import bootstrap, shutdown
from moe_train.parallel.context import ParallelContext
from moe_train.train.batch import Batch, rank_batch
from moe_train.train.build import build_training
from moe_train.train.schedule import lr_at
from moe_train.train.step import apply_update, compute_gradients, zero_gradients


@dataclass(frozen=True, kw_only=True)
class Target:
    """What to measure: which rank, which layers (None: all), fake or real. `every_micro_batch`: walk all of the
    step's micro-batches even where a few of them fix its figures (derive.py)."""

    rank: int = 0
    layers: tuple[int, ...] | None = None
    fake: bool = False
    even_routing: bool = False  # route by the even spread (always, when fake: fake tensors have no values)
    every_micro_batch: bool = False


def _batch(recipe: Recipe, target: Target, ctx: ParallelContext) -> Batch:
    """This rank's samples of the first global batch, as the trainer reads them (train/batch.py); fake token
    ids of the same shapes under `--fake`."""
    if target.fake:
        train = recipe.train
        rows = train.global_batch_size // ctx.size("dp")
        samples = torch.randint(recipe.model.vocab_size, (rows, train.seq_length + 1), device=ctx.device)
        batch = Batch(samples[:, :-1], samples[:, 1:], packed_positions(rows, train.seq_length, ctx.device)
                      if recipe.data.reset_at_eod else None)
        if ctx.size("cp") == 1:
            return batch
        return batch.context_shard(cp=ctx.size("cp"), rank=ctx.coord("cp"), mtp_layers=recipe.model.mtp_layers)
    from moe_train.data import build_datasets

    datasets = build_datasets(recipe)
    return rank_batch(datasets.train, 0, recipe=recipe, ctx=ctx, eod=datasets.eod)


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
    """Measure one step on this rank (every rank of the job calls it) and return the report dict: under
    `--fake` from steps of a few micro-batches when they fix the step's figures (derive.py), else by walking
    every micro-batch, with a line of progress on stderr now and then."""
    recipe = with_fp8_resolved(recipe)  # auto: what the launch target runs (the table's capability, as plan)
    train = recipe.train
    micro_batches = train.global_batch_size // (train.micro_batch_size * ctx.size("dp"))
    counts = sample_counts(recipe, micro_batches) if target.fake and not target.every_micro_batch else None
    if counts is not None:
        _say(ctx, target, f"measure: {micro_batches:,} micro-batches per step; measuring steps of "
                          f"{', '.join(map(str, counts))} and deriving the step from them")
        reports = [_walk(with_micro_batches(recipe, count, dp=ctx.size("dp")), target, ctx) for count in counts]
        try:
            return derive(reports, counts, micro_batches)
        except NotAffine as reason:
            _say(ctx, target, f"measure: the samples do not fix the step ({reason}); walking every micro-batch")
    return _walk(recipe, target, ctx)


def _say(ctx: ParallelContext, target: Target, line: str) -> None:
    """A line on stderr from the reporting rank (stdout holds the report)."""
    if ctx.rank == target.rank:
        print(line, file=sys.stderr, flush=True)


def _progress(chunk: torch.nn.Module, micro_batches: int, say: Callable[[str], None], *,
              every_s: float = 30.0) -> torch.utils.hooks.RemovableHandle:
    """Every `every_s` seconds, at the start of a micro-batch's forward: how far the step is, and an estimate."""
    start = time.perf_counter()
    state = {"done": 0, "said": start}

    def forward(module: torch.nn.Module, args: tuple) -> None:
        if in_backward():
            return
        now = time.perf_counter()
        if now - state["said"] >= every_s and state["done"]:
            left = (now - start) / state["done"] * (micro_batches - state["done"])
            say(f"measure: micro-batch {state['done'] + 1:,} of {micro_batches:,}, about {left:,.0f} s left")
            state["said"] = now
        state["done"] += 1

    return chunk.register_forward_pre_hook(forward)


def _walk(recipe: Recipe, target: Target, ctx: ParallelContext) -> dict:
    """One step of the recipe under every counter, all of its micro-batches."""
    torch.manual_seed(recipe.train.seed)
    trainable = build_training(recipe, ctx, weights="fake" if target.fake else "init", layers=target.layers)
    chunks = trainable.chunks
    for chunk in chunks:
        chunk.set_even_routing(target.fake or target.even_routing)
    batch = _batch(recipe, target, ctx)
    micro_batches = len(batch.inputs) // recipe.train.micro_batch_size
    grads: dict[str, int] = {}

    def gradients_ready(*_) -> None:  # the gradients exist between backward and the update
        grads["bytes"] = sum(grad_bytes(chunk) for chunk in chunks)

    trainable.optimizers[0].register_step_pre_hook(gradients_ready)

    layers = LayerTracker(chunks)
    progress = _progress(chunks[0], micro_batches, lambda line: _say(ctx, target, line))
    saved = SavedTensorTracker(chunks, layers)
    comm = CollectiveTraffic(ctx.group_name)
    flops = PhaseFlopCounter(layers)
    live = LiveBytes([t for chunk in chunks for t in (*chunk.parameters(), *chunk.buffers())])
    # A step's reference cycles are freed when the collector runs, and when it runs depends on what this process
    # allocated before (earlier cases of a worker moved the peak 12-15%): every step starts from a collected heap.
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    reset_comm_wait_times()
    with contextlib.ExitStack() as stack:
        stack.enter_context(unmeasured_pipeline_warmup(fake=target.fake))
        for context in (local_dtensor_ops(), live, comm, flops, saved):
            stack.enter_context(context)
        fp8_gemms = stack.enter_context(count_fp8_gemms())
        fp8_flops = stack.enter_context(count_fp8_flops())
        # The trainer's step without its host-side figures (fake tensors have no values): the all-reduce of the
        # loss sums and MoE telemetry and the expert-bias update it feeds; the update is taken whatever the norm.
        compute_gradients(trainable, batch, recipe=recipe, ctx=ctx)
        with flops.optimizer_step():  # Muon's Newton-Schulz products: flops.optimizer, outside flops.total
            apply_update(trainable, lr=lr_at(1, train=recipe.train))
        zero_gradients(trainable)
    layers.close()
    progress.remove()
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else live.peak
    per_layer = saved.per_layer()
    offloaded: dict[str, int] = {}  # the first micro-batch's saves that left the device (parallel/offload.py)
    for chunk in chunks:
        pool = getattr(chunk, "offload_pool", None)
        offloaded.update({str(layer): b for layer, b in pool.offloaded_bytes_per_layer.items()} if pool else {})
    return {
        "world_size": ctx.world_size,
        "rank": ctx.rank,
        "layers": sorted(layers.layers),
        "activation_bytes_per_layer": per_layer,
        "activation_bytes_total": sum(per_layer.values()),
        "offloaded_bytes_per_layer": offloaded,
        "param_bytes": sum(param_bytes(chunk) for chunk in chunks),
        "grad_bytes": grads.get("bytes", 0),
        "optimizer_bytes": sum(optimizer_bytes(optimizer) for optimizer in trainable.optimizers),
        "flops": flops.totals(),
        "comm_bytes": dict(sorted(comm.bytes.items())),
        "peak_memory_bytes": peak,
        # Extras (docs/measure.md): how the step was run.
        "fake": target.fake,
        "micro_batches": micro_batches,
        "activation_bytes_peak": saved.peak,
        "tokens": micro_batches * recipe.train.micro_batch_size * recipe.train.seq_length,
        "comm_calls": dict(sorted(comm.calls.items())),
        # fp8 GEMMs by "kind/product/mode" (linear|grouped, forward|input_grad|weight_grad, real|emulated)
        "fp8_gemms": {"/".join(key): count for key, count in sorted(fp8_gemms.items())},
        # their FLOPs (part of `flops`, every phase): plan's fp8_gemm_flops, what its fp8 GEMM speed-up applies to
        "fp8_gemm_flops": sum(fp8_flops.values()),
        # every FSDP2 unit's gathered parameters (fp8-gathered weights at 1 byte): plan's params.gathered_bytes
        "gathered_param_bytes": sum(gathered_param_bytes(chunk) for chunk in chunks),
        # per <group>/<op> of the dispatchers' collectives: the compute thread's wait against the collective's
        # own time, issue to completion (docs/measure.md); real runs only (fake tensors take no time)
        "exposed_comm": {} if target.fake else exposed_comm(ctx),
    }


def exposed_comm(ctx: ParallelContext) -> dict[str, dict[str, float]]:
    """The step's ledger of dispatch collectives (models/moe/collective_turns.py) in the report's keys."""
    keys = ("own_s", "waited_s", "exposed_fraction")
    return {kind: {key: times[key] for key in keys} for kind, times in comm_wait_times(ctx.group_name).items()}


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
    on_cpu = as_fake_runs(recipe)  # the meshes are real (built before fake mode), the tensors fake
    threads = torch.get_num_threads()  # bootstrap sets one thread per rank; this process is one rank of none
    with fake_process_group(rank=target.rank, world_size=recipe.world_size):
        ctx = bootstrap(on_cpu, distinct_groups=True)
        torch.set_num_threads(threads)
        with fake_tensors():
            return measure_step(on_cpu, target, ctx)
