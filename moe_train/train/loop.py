"""The trainer: from a resolved recipe to trained steps, metrics and checkpoints.

One optimizer step ("step N", 1-based) trains on global batch N-1 of the data (samples [(N-1)*G, N*G)), split
over data-parallel ranks and then into micro-batches whose gradients accumulate. The optimised loss is the
token-summed cross-entropy divided by the global batch's token count, plus the weighted MTP loss and balancing
losses of each micro-batch times its share 1 / (micro-batches x dp), so the gradient is the same whatever the
micro-batch size or the number of data-parallel ranks (FSDP2 sums the gradients, reduced once per step).
The model is built on the meta device, parallelised (`moe_train.parallel.parallelize`), then allocated and
initialised by name, or allocated and filled from a checkpoint without being initialised first.

The state that decides the next step is the model, the optimizer and the step number (data order and learning
rate are functions of the step), which is exactly what a checkpoint holds: a run stopped at step K and resumed
reproduces the uninterrupted run bit for bit in fp32.

Stops at a step boundary: `train.steps` (writes COMPLETE), `train.exit_at_step`, SIGINT/SIGTERM or the
launcher's preemption notice file (all three: checkpoint, then a clean return). A non-finite loss or gradient
norm skips the update (the model stays as it was) or stops with a TrainingError, per `train.on_nonfinite`;
no checkpoint is ever written after a non-finite update because none is ever applied.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_train.checkpoint.resume import start_point
from moe_train.checkpoint.save import save_checkpoint
from moe_train.checkpoint.state import Progress, load_model_weights, load_training_state
from moe_train.config import RecipeError
from moe_train.config.schema import Recipe
from moe_train.data import build_datasets, global_batch, position_ids
from moe_train.launch.rundir import COMPLETE_FILE, PREEMPT_FILE
from moe_train.models import build_model
from moe_train.models.decoder import DecoderBlock
from moe_train.models.init import init_weights, materialize
from moe_train.models.moe import MoELayer, update_expert_bias
from moe_train.models.moe.aux_loss import set_aux_loss_scale
from moe_train.parallel import parallelize
from moe_train.parallel.context import ParallelContext
from moe_train.parallel.data_parallel import set_gradient_sync
from moe_train.parallel.tensor import reduce_replicated_gradients
from moe_train.plan.flops import training_flops_per_token
from moe_train.train.errors import TrainingError
from moe_train.train.grad_norm import clip_grad_norm
from moe_train.train.metrics import MetricsLogger, eval_record, expert_balance, train_record
from moe_train.train.optimizer import build_optimizer, set_lr
from moe_train.train.peak import peak_flops
from moe_train.train.schedule import lr_at


@dataclass(frozen=True, kw_only=True)
class Summary:
    """What a run did. `status`: complete (train.steps reached), exited (exit_at_step) or preempted."""

    status: str
    step: int
    steps_run: int
    tokens: int
    first_loss: float | None
    final_loss: float | None
    tokens_per_s: float
    mfu: float
    wall_s: float
    run_dir: Path
    checkpoint: Path | None
    logs: bool = True  # whether this rank is the one that reports (ParallelContext.logs)

    def describe(self, *, total_steps: int) -> str:
        """The few lines printed when a run ends."""
        loss = "no step trained"
        if self.final_loss is not None:
            loss = f"loss {self.first_loss:.4f} -> {self.final_loss:.4f}"
        lines = [
            f"{self.status} at step {self.step}/{total_steps}: {self.steps_run} steps in {self.wall_s:.1f} s, {loss}",
            f"tokens {self.tokens:,} in total, {self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}",
            f"run dir {self.run_dir}" + (f", checkpoint {self.checkpoint}" if self.checkpoint else ""),
        ]
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class StepResult:
    loss: float
    lm_loss: float
    aux_loss: float
    mtp_loss: float
    grad_norm: float
    moe: dict[str, dict[str, float]] | None

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN or infinity: a skipped step's poisoned figures are written as null."""
    return value if math.isfinite(value) else None


class Trainer:
    """Builds model, optimizer, data and the start point from a recipe; `train()` runs the steps.

    Every rank of a job constructs one Trainer with the same resolved recipe and its parallel context
    (`moe_train.parallel.bootstrap.bootstrap`); without one, the recipe must be a world-size-1 layout and
    the context is bootstrapped here.
    """

    def __init__(self, recipe: Recipe, ctx: ParallelContext | None = None) -> None:
        self.recipe = recipe
        train = recipe.train
        if recipe.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise RecipeError(["logging.tensorboard: TensorBoard events need the tensorboard package "
                               "(pip install tensorboard)"])
        if ctx is None:
            from moe_train.parallel.bootstrap import bootstrap

            ctx = bootstrap(recipe)
        self.ctx = ctx
        self.rank = ctx.rank
        self.dp_size = ctx.size("dp")
        self.device = ctx.device
        torch.manual_seed(train.seed)
        self.run_dir = Path(recipe.resolved_run_dir())
        self.ckpt_dir = Path(recipe.checkpoint_dir())
        self.datasets = build_datasets(recipe)
        if train.eval_interval is not None and self.datasets.valid is None:
            raise RecipeError(["train.eval_interval: evaluation needs a validation split (data.valid_fraction > 0)"])
        start = start_point(
            ckpt_dir=self.ckpt_dir, resume=recipe.checkpoint.resume, init_from=recipe.checkpoint.init_from
        )
        self.model = parallelize(build_model(recipe.model, device="meta"), recipe, ctx)
        materialize(self.model, device=self.device)
        if start.resume_from is None and start.init_from is None:
            init_weights(self.model, seed=train.seed, init_std=recipe.model.init_std)
        self.model.train()
        self.optimizer = build_optimizer(self.model, train=train)
        # MTP blocks count as layers num_layers + k.
        self.moe_layers: dict[int, MoELayer] = {
            m.layer_index: m.mlp for m in self.model.modules() if isinstance(m, DecoderBlock) and m.is_moe
        }
        self.progress = Progress()
        self.started_from: Path | None = None
        if start.resume_from is not None:
            self.progress = load_training_state(start.resume_from, model=self.model, optimizer=self.optimizer)
            self.started_from = start.resume_from
        elif start.init_from is not None:
            load_model_weights(start.init_from, self.model)
            self.started_from = start.init_from
        self.tokens_per_step = train.global_batch_size * train.seq_length
        self.flops_per_token = training_flops_per_token(recipe.model, seq_length=train.seq_length)
        self.peak = peak_flops(device=recipe.launch.device, gpu=recipe.launch.gpu, precision=train.precision)
        self._stop_signal: str | None = None

    # ------------------------------------------------------------------------------------------ one step

    def _all_reduce(self, tensor: torch.Tensor, dims: tuple[str, ...] = ("dp",)) -> torch.Tensor:
        """Sum a small tensor over mesh dimensions `dims` in place; a host tensor goes through the device (NCCL)."""
        on_device = tensor.to(self.device)
        for dim in dims:
            if self.ctx.size(dim) > 1:
                dist.all_reduce(on_device, group=self.ctx.group(dim))
        if on_device is not tensor:
            tensor.copy_(on_device)
        return tensor

    def _micro_batches(self, source, batch_index: int) -> list[torch.Tensor]:
        train = self.recipe.train
        tokens = global_batch(
            source,
            step=batch_index,
            global_batch_size=train.global_batch_size,
            dp_rank=self.ctx.coord("dp"),
            dp_size=self.dp_size,
        ).to(self.device)
        return list(tokens.split(train.micro_batch_size))

    def _inputs(self, micro: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        inputs, labels = micro[:, :-1], micro[:, 1:]
        positions = position_ids(inputs, self.datasets.eod) if self.recipe.data.reset_at_eod else None
        return inputs, labels, positions

    def train_step(self, step: int) -> StepResult:
        """Forward/backward over this rank's micro-batches of global batch step-1, then clip and update."""
        train = self.recipe.train
        micro_batches = self._micro_batches(self.datasets.train, step - 1)
        share = 1.0 / (len(micro_batches) * self.dp_size)  # of each micro-batch's mean losses
        set_aux_loss_scale(share)
        self._reset_telemetry()
        self.optimizer.zero_grad(set_to_none=True)
        # Accumulated on the device: the host reads them once per step, after the all-reduces, not per micro-batch.
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # lm and mtp contributions to the mean
        for index, micro in enumerate(micro_batches):
            # FSDP2 reduces gradients once per step, in the last micro-batch's backward.
            set_gradient_sync(self.model, index == len(micro_batches) - 1)
            inputs, labels, positions = self._inputs(micro)
            terms = self.model(inputs, positions, labels=labels)
            lm = terms.lm_sum / self.tokens_per_step
            mtp = terms.mtp * share
            (lm + mtp).backward()
            sums += torch.stack([lm.detach(), mtp.detach()]).double()
        reduce_replicated_gradients(self.model, self.ctx.group("tp"))
        self._all_reduce(sums)  # every tp rank computed the same loss: summed over dp only
        counts, moe, aux_loss = self._telemetry(share)
        grad_norm = clip_grad_norm(self.model.parameters(), train.grad_clip, stage_group=self.ctx.group("pp"))
        lm_loss, mtp_loss = sums.tolist()
        result = StepResult(
            loss=lm_loss + aux_loss + mtp_loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            mtp_loss=mtp_loss,
            grad_norm=grad_norm,
            moe=moe,
        )
        if result.finite:
            set_lr(self.optimizer, lr_at(step, train=train))
            self.optimizer.step()
            self._update_expert_bias(counts)
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _reset_telemetry(self) -> None:
        for layer in self.moe_layers.values():
            layer.reset_telemetry()
        self.model.aux_loss_value.zero_()

    def _telemetry(self, share: float) -> tuple[dict[int, torch.Tensor], dict | None, float]:
        """The step's expert counts per MoE layer (summed over micro-batches and ranks, for the bias update),
        the per-layer balance figures, and the weighted balancing loss averaged over the global batch.

        One all-reduce and one host read per step: every figure travels in one float64 tensor (counts are exact
        in float64 far beyond any step's token count). Each tp rank routes (and counts) its own slice of the
        micro-batch's tokens, so the figures sum over dp and tp."""
        layers = [self.moe_layers[i] for i in sorted(self.moe_layers)]
        aux = torch.stack([layer.aux_loss_value for layer in layers] + [self.model.aux_loss_value]).sum().view(1)
        rows = [torch.cat([layer.tokens_per_expert.double(), torch.stack([layer.dropped_assignments,
                                                                          layer.assignments]).double(),
                           layer.router_entropy_sum.view(1)]) for layer in layers]
        figures = self._all_reduce(torch.cat([aux.double(), *rows]), ("dp", "tp"))
        on_host = figures.cpu()
        aux_loss = on_host[0].item() * share
        if not layers:
            return {}, None, aux_loss
        experts, top_k = layers[0].tokens_per_expert.numel(), self.recipe.model.moe.top_k
        per_layer = figures[1:].view(len(layers), experts + 3)
        on_host = on_host[1:].view(len(layers), experts + 3)
        moe = {}
        for row, index in enumerate(sorted(self.moe_layers)):
            dropped, assignments, entropy = on_host[row, experts:].tolist()
            moe[str(index)] = expert_balance(on_host[row, :experts], dropped / assignments,
                                             router_entropy=entropy * top_k / assignments)
        counts = {index: per_layer[row, :experts] for row, index in enumerate(sorted(self.moe_layers))}
        return counts, moe, aux_loss

    def _update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        """Aux-loss-free balancing from the whole global batch's counts (identical on every rank)."""
        for index, layer in self.moe_layers.items():
            bias = layer.router.expert_bias
            if bias is not None:
                update_expert_bias(bias, counts[index], layer.moe.router.bias_update_rate)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Cross-entropy on the validation split's first eval_steps global batches (the same ones every time)."""
        train = self.recipe.train
        self.model.eval()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for batch_index in range(train.eval_steps):
            for micro in self._micro_batches(self.datasets.valid, batch_index):
                inputs, labels, positions = self._inputs(micro)
                total += self.model(inputs, positions, labels=labels).lm_sum
        self.model.train()
        self._all_reduce(total)
        return total.item() / (train.eval_steps * self.tokens_per_step)

    # ------------------------------------------------------------------------------------------ the loop

    def _on_signal(self, signum: int, frame) -> None:
        self._stop_signal = signal.Signals(signum).name

    def _stop_requested(self) -> str | None:
        """A signal or the preemption notice on any rank stops every rank at the same step boundary."""
        reason = self._stop_signal
        if reason is None and (self.run_dir / PREEMPT_FILE).exists():
            reason = f"preemption notice {self.run_dir / PREEMPT_FILE}"
        flag = torch.tensor([1 if reason else 0], device=self.device)
        dist.all_reduce(flag)  # every rank of the job, whatever its place in the meshes
        if flag.item() and reason is None:
            reason = "a stop requested on another rank"
        return reason

    def _save(self, logger: MetricsLogger | None) -> Path:
        path = save_checkpoint(
            self.ckpt_dir,
            model=self.model,
            optimizer=self.optimizer,
            progress=self.progress,
            model_config=self.recipe.model.model_dump(mode="json"),
            keep=self.recipe.checkpoint.keep,
        )
        if logger is not None:
            logger.message(f"checkpoint saved: {path}")
        return path

    def _memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def train(self) -> Summary:
        """Run steps until train.steps, exit_at_step or a stop request; see the module docstring."""
        train, recipe = self.recipe.train, self.recipe
        last = train.steps if train.exit_at_step is None else min(train.steps, train.exit_at_step)
        logger = None
        if self.ctx.logs:
            logger = MetricsLogger(
                Path(recipe.logging_dir()),
                total_steps=train.steps,
                start_step=self.progress.step,
                tensorboard=recipe.logging.tensorboard,
            )
            logger.message(f"data: {self.datasets.description}")
            if self.started_from is not None:
                logger.message(f"started from {self.started_from} at step {self.progress.step}")
        handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: the launcher's notice file still works
                handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            return self._loop(last, logger)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if logger is not None:
                logger.close()

    def _loop(self, last: int, logger: MetricsLogger | None) -> Summary:
        train, recipe = self.recipe.train, self.recipe
        start_time = time.perf_counter()
        first_step = self.progress.step
        timed_tokens, timed_seconds = 0, 0.0
        first_loss, final_loss, checkpoint, status = None, None, None, None
        saved_step = self.progress.step if self.started_from is not None else None
        while self.progress.step < last:
            reason = self._stop_requested()
            if reason is not None:
                status = "preempted"
                if logger is not None:
                    logger.message(f"stopping at step {self.progress.step}: {reason}")
                break
            step = self.progress.step + 1
            t0 = time.perf_counter()
            result = self.train_step(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
            skipped = self.progress.skipped + (0 if result.finite else 1)
            self.progress = Progress(
                step=step,
                consumed_samples=self.progress.consumed_samples + train.global_batch_size,
                skipped=skipped,
            )
            if step > first_step + 1 or step == last:  # the first step of a process warms caches
                timed_tokens += self.tokens_per_step
                timed_seconds += seconds
            tokens_per_s = self.tokens_per_step / seconds
            tflops = self.flops_per_token * tokens_per_s / self.ctx.world_size / 1e12
            if logger is not None and (step % recipe.logging.interval == 0 or step == last or not result.finite):
                logger.train(
                    train_record(
                        step=step,
                        loss=_finite_or_none(result.loss),
                        lm_loss=_finite_or_none(result.lm_loss),
                        aux_loss=_finite_or_none(result.aux_loss),
                        grad_norm=_finite_or_none(result.grad_norm),
                        lr=lr_at(step, train=train),
                        tokens=step * self.tokens_per_step,
                        tokens_per_s=tokens_per_s,
                        tflops_per_device=tflops,
                        mfu=tflops * 1e12 / self.peak,
                        memory_bytes=self._memory_bytes(),
                        skipped=skipped,
                        moe=result.moe,
                        mtp_loss=_finite_or_none(result.mtp_loss) if recipe.model.mtp_layers else None,
                    )
                )
            if not result.finite:
                what = f"non-finite loss {result.loss} or grad norm {result.grad_norm} at step {step}"
                if train.on_nonfinite == "stop":
                    raise TrainingError(self.rank, f"{what} (train.on_nonfinite: stop)")
                if skipped > train.max_skipped_steps:
                    raise TrainingError(self.rank, f"{what}: {skipped} steps skipped, over train.max_skipped_steps")
                if logger is not None:
                    logger.message(f"step {step} skipped: {what}")
            else:
                final_loss = result.loss
                first_loss = result.loss if first_loss is None else first_loss
            if train.eval_interval and step % train.eval_interval == 0:
                loss = self.evaluate()
                if logger is not None:
                    logger.eval(eval_record(step=step, loss=loss))
            interval = recipe.checkpoint.interval
            if interval and step % interval == 0 and step != last:
                checkpoint, saved_step = self._save(logger), step
        if self.progress.step > 0 and saved_step != self.progress.step:
            checkpoint = self._save(logger)
        if status is None:
            status = "complete" if self.progress.step >= train.steps else "exited"
        if status == "complete" and self.ctx.logs:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / COMPLETE_FILE).write_text(f"step {self.progress.step}\n", encoding="utf-8")
        tokens_per_s = timed_tokens / timed_seconds if timed_seconds else 0.0
        return Summary(
            status=status,
            step=self.progress.step,
            steps_run=self.progress.step - first_step,
            tokens=self.progress.step * self.tokens_per_step,
            first_loss=first_loss,
            final_loss=final_loss,
            tokens_per_s=tokens_per_s,
            mfu=self.flops_per_token * tokens_per_s / self.ctx.world_size / self.peak,
            wall_s=time.perf_counter() - start_time,
            run_dir=self.run_dir,
            checkpoint=checkpoint,
            logs=self.ctx.logs,
        )
