"""The trainer: from a resolved recipe to trained steps, metrics and checkpoints.

One optimizer step ("step N", 1-based) trains on global batch N-1 of the data (samples [(N-1)*G, N*G)), split
over data-parallel ranks and then into micro-batches whose gradients accumulate. The optimised loss is the
token-summed cross-entropy divided by the global batch's token count, plus the weighted MTP loss and balancing
losses of each micro-batch times its share 1 / (micro-batches x dp), so the gradient is the same whatever the
micro-batch size, the number of data-parallel ranks or the pipeline schedule (FSDP2 sums the gradients,
reduced once per step; the step's passes are moe_train/train/step.py). The model is built on the meta device,
parallelised (`moe_train.parallel.parallelize`) into this rank's model chunks (the whole model, or its pipeline
stages, each with its own optimizer), then allocated and initialised by name, or allocated and filled from a
checkpoint without being initialised first.

The state that decides the next step is the model, the optimizer and the step number (data order and learning
rate are functions of the step), which is exactly what a checkpoint holds: a run stopped at step K and resumed
reproduces the uninterrupted run bit for bit in fp32.

Stops at a step boundary: `train.steps` (writes COMPLETE), `train.exit_at_step`, SIGINT/SIGTERM to any rank or
the launcher's preemption notice file (agreed on by every rank: stops.py; all three: checkpoint, then a clean
return). A non-finite loss or gradient norm, or a loss spike, skips the update (the model stays as it was) or
stops with a TrainingError, per `train.on_nonfinite` and `train.on_loss_spike` (bad_steps.py); no checkpoint is
ever written after a poisoned update because none is ever applied. The start point is chosen by rank 0 among
the checkpoints that match their manifest, and broadcast (checkpoint/collective.py).
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_train.checkpoint.async_save import Checkpointer
from moe_train.checkpoint.collective import agreed_start_point
from moe_train.checkpoint.state import Progress, load_model_weights, load_training_state
from moe_train.config import RecipeError
from moe_train.config.schema import Recipe
from moe_train.data import build_datasets
from moe_train.models.decoder import DecoderBlock
from moe_train.models.moe import MoELayer, update_expert_bias
from moe_train.parallel.context import ParallelContext
from moe_train.plan.flop_count import training_flops_per_token
from moe_train.run_files import COMPLETE_FILE, PREEMPT_FILE
from moe_train.runtime import use_step_timeout
from moe_train.train.bad_steps import BadSteps, Rejection
from moe_train.train.batch import rank_batch
from moe_train.train.build import build_training
from moe_train.train.device_stats import device_mismatch, memory_figures, start_interval
from moe_train.train.errors import TrainingError
from moe_train.train.grad_norm import host_norm
from moe_train.train.hang_report import HangWatch
from moe_train.train.metrics import MetricsLogger, eval_record, expert_balance, train_record
from moe_train.train.peak import peak_flops
from moe_train.train.rank_load import RoutingTrace, rank_figures
from moe_train.train.schedule import lr_at
from moe_train.train.step import StepLoss, apply_update, compute_gradients, forward_only, zero_gradients
from moe_train.train.stops import StopRequests
from moe_train.train.tally import RunTally


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
    moe_ranks: dict[str, dict] | None = None  # per-rank load per MoE layer (rank_load.py)
    rejection: Rejection | None = None  # why the update was not applied (bad_steps.py)

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


@dataclass(frozen=True, kw_only=True)
class StepFigures:
    """The step's figures once read on the host (`Trainer._figures`), summed over every rank."""

    lm_sum: float  # cross-entropy summed over the global batch's tokens
    grad_norm: float  # the global gradient norm before clipping; NaN when not finite (train/grad_norm.py)
    mtp_loss: float  # the weighted MTP loss of the global batch
    aux_loss: float  # the weighted balancing loss, averaged over the global batch
    expert_counts: dict[int, torch.Tensor]  # this rank's MoE layers: tokens per expert (device), for the bias
    moe: dict[str, dict[str, float]] | None  # every MoE layer's balance figures (metrics.expert_balance)
    moe_ranks: dict[str, dict] | None  # every MoE layer's per-rank load (rank_load.rank_figures): layout-dependent


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
        if recipe.logging.wandb is not None and importlib.util.find_spec("wandb") is None:
            raise RecipeError(["logging.wandb: W&B logging needs the wandb package (pip install wandb)"])
        if ctx is None:
            from moe_train.parallel.bootstrap import bootstrap

            ctx = bootstrap(recipe)
        self.ctx = ctx
        self.rank = ctx.rank
        self.device = ctx.device
        torch.manual_seed(train.seed)
        self.run_dir = Path(recipe.resolved_run_dir())
        self.ckpt_dir = Path(recipe.checkpoint_dir())
        self.checkpointer = Checkpointer(self.ckpt_dir, keep=recipe.checkpoint.keep)
        self.hang_watch = HangWatch(rank=self.rank, timeout_s=recipe.launch.timeout_minutes * 60,
                                    step=lambda: self.progress.step + 1, log_dir=self.run_dir / "logs") \
            if ctx.world_size > 1 else None
        self.datasets = build_datasets(recipe)
        if train.eval_interval is not None and self.datasets.valid is None:
            raise RecipeError(["train.eval_interval: evaluation needs a validation split (data.valid_fraction > 0)"])
        self.start = agreed_start_point(
            ckpt_dir=self.ckpt_dir, resume=recipe.checkpoint.resume, init_from=recipe.checkpoint.init_from
        )
        start = self.start
        self.started_from = start.resume_from or start.init_from
        # This rank's model chunks (the whole model, or its pipeline stages), allocated empty when a checkpoint
        # fills them.
        fresh = start.resume_from is None and start.init_from is None
        self.trainable = build_training(recipe, ctx, weights="init" if fresh else "empty")
        self.chunks = self.trainable.chunks
        # This rank's MoE layers by index (MTP blocks count as layers num_layers + k), and every MoE layer of the
        # whole model, whose figures all ranks exchange in one tensor of the same shape whatever their stage.
        self.moe_layers: dict[int, MoELayer] = {
            m.layer_index: m.ffn for chunk in self.chunks for m in chunk.modules()
            if isinstance(m, DecoderBlock) and m.is_moe
        }
        cfg = recipe.model
        self.all_moe_layers = [i for i in range(cfg.num_layers + cfg.mtp_layers) if cfg.is_moe_layer(i)]
        self.progress = Progress()
        model_keys = self.trainable.model_keys
        if start.resume_from is not None:
            self.progress = load_training_state(start.resume_from, chunks=self.chunks,
                                                optimizers=self.optimizers, model_keys=model_keys, own=start.own)
        elif start.init_from is not None:
            for chunk in self.chunks:
                load_model_weights(start.init_from, chunk, model_keys)
        self.bad_steps = BadSteps(train, recent_losses=self.progress.recent_losses)
        self.tokens_per_step = train.global_batch_size * train.seq_length
        self.flops_per_token = training_flops_per_token(recipe.model, seq_length=train.seq_length)
        self.peak = peak_flops(device=recipe.launch.device, gpu=recipe.launch.gpu, precision=train.precision)
        self.device_warning = device_mismatch(recipe.launch.gpu, torch.cuda.get_device_name(self.device)) \
            if self.device.type == "cuda" else None
        self.stops = StopRequests(notice=self.run_dir / PREEMPT_FILE, reads_notice=ctx.logs, device=self.device)

    # ------------------------------------------------------------------------------------------ one step

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor of step figures over every rank of the job, in place."""
        if self.ctx.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """One AdamW per model chunk (`trainable.optimizers`)."""
        return self.trainable.optimizers

    def train_step(self, step: int) -> StepResult:
        """The step's gradients (step.py), then its figures read on the host, then the update if admitted."""
        train = self.recipe.train
        batch = rank_batch(self.datasets.train, step - 1, recipe=self.recipe, ctx=self.ctx, eod=self.datasets.eod)
        gradients = compute_gradients(self.trainable, batch, recipe=self.recipe, ctx=self.ctx)
        figures = self._figures(gradients.loss.sums, gradients.loss.share, gradients.grad_norm)
        grad_norm = figures.grad_norm
        lm_loss = figures.lm_sum / self.tokens_per_step
        total = lm_loss + figures.aux_loss + figures.mtp_loss
        result = StepResult(
            loss=total,
            lm_loss=lm_loss,
            aux_loss=figures.aux_loss,
            mtp_loss=figures.mtp_loss,
            grad_norm=grad_norm,
            moe=figures.moe,
            moe_ranks=figures.moe_ranks,
            rejection=self.bad_steps.admit(loss=total, grad_norm=grad_norm),
        )
        if result.rejection is None:
            apply_update(self.trainable, lr=lr_at(step, train=train))
            self._update_expert_bias(figures.expert_counts)
        zero_gradients(self.trainable)
        return result

    def _figures(self, loss_sums: torch.Tensor, share: float, grad_norm: torch.Tensor) -> StepFigures:
        """The step's loss sums, the expert counts per MoE layer of this rank (summed over micro-batches and
        ranks, for the bias update), the per-layer balance figures of every MoE layer, the weighted balancing
        loss averaged over the global batch, and the gradient norm (already global: read, not reduced).

        One all-reduce over every rank and one host read per step: every figure travels in one float64 tensor
        (counts are exact in float64 far beyond any step's token count) laid out alike on every rank, each
        filling the rows of the layers it holds, so a stage without MoE layers (or without the loss) takes part
        as every other. Each tp rank routes (and counts) its own slice of the micro-batch's tokens, so the MoE
        figures sum over dp and tp; the loss, computed alike by every tp rank of the last stage, is sent by tp
        rank 0 alone."""
        experts = self.recipe.model.moe.num_experts if self.all_moe_layers else 0
        rows = torch.zeros(len(self.all_moe_layers), 2 * experts + 3, dtype=torch.float64, device=self.device)
        for row, index in enumerate(self.all_moe_layers):
            layer = self.moe_layers.get(index)
            if layer is not None:
                rows[row, :experts + 3] = torch.cat([layer.tokens_per_expert.double(), torch.stack([
                    layer.dropped_assignments, layer.assignments]).double(), layer.router_entropy_sum.view(1)])
                rows[row, experts + 3:] = self._rows_by_slot(layer)
        aux = torch.stack([layer.aux_loss_value for layer in self.moe_layers.values()]
                          + [chunk.aux_loss_value for chunk in self.chunks]).sum().view(1)
        sends_loss = 1.0 if self.ctx.coord("tp") == 0 else 0.0
        figures = self._all_reduce(torch.cat([loss_sums * sends_loss, aux.double(), rows.flatten()]))
        packed = torch.cat([figures, grad_norm.detach().double().view(1)]).cpu()
        on_host, norm = packed[:-1], host_norm(packed[-1])
        lm_sum, mtp_loss, aux_loss = on_host[0].item(), on_host[1].item(), on_host[2].item() * share
        if not self.all_moe_layers:
            return StepFigures(lm_sum=lm_sum, grad_norm=norm, mtp_loss=mtp_loss, aux_loss=aux_loss,
                               expert_counts={}, moe=None, moe_ranks=None)
        per_layer, on_host = figures[3:].view(rows.shape), on_host[3:].view(rows.shape)
        top_k = self.recipe.model.moe.top_k
        moe, moe_ranks = {}, {}
        for row, index in enumerate(self.all_moe_layers):
            dropped, assignments, entropy = on_host[row, experts:experts + 3].tolist()
            moe[str(index)] = expert_balance(on_host[row, :experts], dropped / assignments,
                                             router_entropy=entropy * top_k / assignments)
            moe_ranks[str(index)] = rank_figures(on_host[row, experts + 3:].tolist(), ep=self.ctx.size("ep"))
        counts = {index: per_layer[row, :experts] for row, index in enumerate(self.all_moe_layers)
                  if index in self.moe_layers}
        return StepFigures(lm_sum=lm_sum, grad_norm=norm, mtp_loss=mtp_loss, aux_loss=aux_loss, expert_counts=counts,
                           moe=moe, moe_ranks=moe_ranks)

    def _rows_by_slot(self, layer: MoELayer) -> torch.Tensor:
        """[E] float64: the rows this rank's experts received at their slots' positions (zeros elsewhere), a
        share 1/etp of them (etp ranks receive the same rows), for the all-reduce to sum into per-slot loads."""
        local = layer.dispatcher.num_local_experts
        out = torch.zeros(layer.cfg.num_experts, dtype=torch.float64, device=self.device)
        first = self.ctx.coord("ep") * local
        out[first:first + local] = layer.rows_per_local_expert[:local].double() / self.ctx.size("etp")
        return out

    def _update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        """Aux-loss-free balancing from the whole global batch's counts (identical on every rank)."""
        for index, layer in self.moe_layers.items():
            bias = layer.router.expert_bias
            if bias is not None:
                update_expert_bias(bias, counts[index], layer.cfg.router.bias_update_rate)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Cross-entropy on the validation split's first eval_steps global batches (the same ones every time)."""
        train = self.recipe.train
        for chunk in self.chunks:
            chunk.eval()
        loss = StepLoss(tokens_per_step=self.tokens_per_step, share=0.0, device=self.device)
        for batch_index in range(train.eval_steps):
            batch = rank_batch(self.datasets.valid, batch_index, recipe=self.recipe, ctx=self.ctx,
                               eod=self.datasets.eod)
            forward_only(self.chunks, self.trainable.pipeline, batch, micro_batch_size=train.micro_batch_size,
                         loss=loss)
        for chunk in self.chunks:
            chunk.train()
        # The last stage's tp rank 0 of each data-parallel slice holds a sum.
        total = self._all_reduce(loss.sums[:1] * (1.0 if self.ctx.coord("tp") == 0 else 0.0))
        return total.item() / (train.eval_steps * self.tokens_per_step)

    # ------------------------------------------------------------------------------------------ the loop

    def _save(self, logger: MetricsLogger | None, *, background: bool = False) -> Path:
        """Save this step; `background` (interval saves, with checkpoint.async_save) returns once it is staged."""
        background = background and self.recipe.checkpoint.async_save
        path = self.checkpointer.save(
            chunks=self.chunks,
            optimizers=self.optimizers,
            progress=self.progress,
            model_config=self.recipe.model.model_dump(mode="json"),
            background=background,
        )
        if logger is not None:
            logger.message(f"checkpoint {'staged, writing in the background' if background else 'saved'}: {path}")
        return path

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
                wandb=recipe.logging.wandb,
                run_config=recipe.model_dump(mode="json"),
            )
            logger.message(f"data: {self.datasets.description}")
            if train.precision == "fp8":
                from moe_train.models.fp8.runtime import fp8_stack

                logger.message(fp8_stack(train.fp8.recipe, self.ctx.device, backend=train.fp8.backend))
            for note in self.start.notes:
                logger.message(note)
            if self.started_from is not None:
                logger.message(f"started from {self.started_from} at step {self.progress.step}")
            if self.device_warning is not None:
                logger.message(f"warning: {self.device_warning}")
        self.trace = None
        if logger is not None and recipe.logging.routing_trace and self.all_moe_layers:
            self.trace = RoutingTrace(Path(recipe.logging_dir()), start_step=self.progress.step,
                                      ep=self.ctx.size("ep"))
        try:
            with self.stops:
                return self._loop(last, logger)
        finally:
            if logger is not None:
                logger.close()
            if self.trace is not None:
                self.trace.close()

    def _loop(self, last: int, logger: MetricsLogger | None) -> Summary:
        """What happens per step, in order; each piece is a method of its own below."""
        start_time = time.perf_counter()
        # A stop before the first step still saves (step 0 of a fresh run): a requeued job resumes with
        # `resume: required` and must find a checkpoint of this run.
        tally = RunTally(first_step=self.progress.step, last=last, tokens_per_step=self.tokens_per_step,
                         saved_step=self.progress.step if self.start.resume_from is not None else None)
        status = None
        while self.progress.step < last:
            status = self._stop_requested(logger)
            if status is not None:
                break
            step = self.progress.step + 1
            result, seconds = self._timed_step(step)
            if step == tally.first_step + 1:  # start-up is over: a hung step now fails after launch.timeout_minutes
                use_step_timeout(self.ctx, self.recipe.launch.timeout_minutes)
            self._advance(step, result)
            tally.timed(step, seconds)
            self._log_step(logger, step, result, seconds, last=last)
            if self.trace is not None:
                self.trace.write(step, result.moe, result.moe_ranks)
            if result.rejection is None:
                tally.applied(result.loss)
            else:
                self._skip_or_stop(logger, step, result.rejection)
            self._evaluate_at(logger, step)
            self._checkpoint_at(logger, step, last=last, tally=tally)
        return self._finish(logger, status, tally, start_time=start_time)

    def _stop_requested(self, logger: MetricsLogger | None) -> str | None:
        """"preempted" when a signal reached any rank or the notice file appeared: every rank stops here."""
        reason = self.stops.agreed()
        if reason is None:
            return None
        if logger is not None:
            logger.message(f"stopping at step {self.progress.step}: {reason}")
        return "preempted"

    def _timed_step(self, step: int) -> tuple[StepResult, float]:
        """The step and its wall time (on CUDA, up to the device's end of it)."""
        t0 = time.perf_counter()
        result = self.train_step(step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return result, time.perf_counter() - t0

    def _advance(self, step: int, result: StepResult) -> None:
        """The progress a checkpoint holds: the step and data position move on whether or not it was applied."""
        self.progress = Progress(
            step=step,
            consumed_samples=self.progress.consumed_samples + self.recipe.train.global_batch_size,
            skipped=self.progress.skipped + (0 if result.rejection is None else 1),
            recent_losses=self.bad_steps.recent_losses,
        )

    def _log_step(self, logger: MetricsLogger | None, step: int, result: StepResult, seconds: float, *,
                  last: int) -> None:
        """A metrics record every logging.interval steps, at the last step and for every rejected step."""
        if logger is None or not (step % self.recipe.logging.interval == 0 or step == last or result.rejection):
            return
        tokens_per_s = self.tokens_per_step / seconds
        tflops = self.flops_per_token * tokens_per_s / self.ctx.world_size / 1e12
        logger.train(
            train_record(
                step=step,
                loss=_finite_or_none(result.loss),
                lm_loss=_finite_or_none(result.lm_loss),
                aux_loss=_finite_or_none(result.aux_loss),
                grad_norm=_finite_or_none(result.grad_norm),
                lr=lr_at(step, train=self.recipe.train),
                tokens=step * self.tokens_per_step,
                tokens_per_s=tokens_per_s,
                tflops_per_device=tflops,
                mfu=tflops * 1e12 / self.peak,
                **memory_figures(self.device),
                skipped=self.progress.skipped,
                moe=result.moe,
                moe_ranks=result.moe_ranks,
                mtp_loss=_finite_or_none(result.mtp_loss) if self.recipe.model.mtp_layers else None,
            )
        )
        start_interval(self.device)  # the next record's memory peak is its own interval's

    def _skip_or_stop(self, logger: MetricsLogger | None, step: int, rejected: Rejection) -> None:
        """A rejected step is skipped (logged) or stops the run, per train.on_nonfinite / on_loss_spike and
        train.max_skipped_steps."""
        train = self.recipe.train
        what = f"{rejected.reason} at step {step}"
        field = "on_nonfinite" if rejected.kind == "nonfinite" else "on_loss_spike"
        if getattr(train, field) == "stop":
            raise TrainingError(self.rank, f"{what} (train.{field}: stop)")
        skipped = self.progress.skipped
        if skipped > train.max_skipped_steps:
            raise TrainingError(self.rank, f"{what}: {skipped} steps skipped, over train.max_skipped_steps")
        if logger is not None:
            logger.message(f"step {step} skipped: {what}")

    def _evaluate_at(self, logger: MetricsLogger | None, step: int) -> None:
        interval = self.recipe.train.eval_interval
        if interval and step % interval == 0:
            loss = self.evaluate()
            if logger is not None:
                logger.eval(eval_record(step=step, loss=loss))

    def _checkpoint_at(self, logger: MetricsLogger | None, step: int, *, last: int, tally: RunTally) -> None:
        """Every checkpoint.interval steps; the last step's checkpoint is `_finish`'s."""
        interval = self.recipe.checkpoint.interval
        if interval and step % interval == 0 and step != last:
            tally.saved(step, self._save(logger, background=True))

    def _finish(self, logger: MetricsLogger | None, status: str | None, tally: RunTally, *,
                start_time: float) -> Summary:
        """Save the step the run stops at (unless saved already), mark a complete run COMPLETE, summarise."""
        if tally.saved_step != self.progress.step:
            tally.saved(self.progress.step, self._save(logger))
        self.checkpointer.close()  # the last checkpoint is on disk, and `latest` names it, before the run ends
        if self.hang_watch is not None:
            self.hang_watch.stop()
        if status is None:
            status = "complete" if self.progress.step >= self.recipe.train.steps else "exited"
        if status == "complete" and self.ctx.logs:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / COMPLETE_FILE).write_text(f"step {self.progress.step}\n", encoding="utf-8")
        return Summary(
            status=status,
            step=self.progress.step,
            steps_run=self.progress.step - tally.first_step,
            tokens=self.progress.step * self.tokens_per_step,
            first_loss=tally.first_loss,
            final_loss=tally.final_loss,
            tokens_per_s=tally.tokens_per_s,
            mfu=self.flops_per_token * tally.tokens_per_s / self.ctx.world_size / self.peak,
            wall_s=time.perf_counter() - start_time,
            run_dir=self.run_dir,
            checkpoint=tally.checkpoint,
            logs=self.ctx.logs,
        )
