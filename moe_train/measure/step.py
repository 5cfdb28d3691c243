"""The one training step `measure` runs: the trainer's step (Trainer.train_step, moe_train/train/loop.py) with
the same passes (moe_train/train/step.py) but without its host-side figures.

Left out, because they only produce figures the host reads (fake tensors have no values): the all-reduce of the
loss sums and the MoE telemetry (a few bytes per MoE layer) and the expert-bias update that follows it. The
update is taken whatever the gradient norm (a fake step's norm is NaN).
"""

from __future__ import annotations

from moe_train.config.schema import Recipe
from moe_train.models.model import Transformer
from moe_train.models.moe import MoELayer
from moe_train.parallel.context import ParallelContext
from moe_train.train.grad_norm import clip_grad_norm
from moe_train.train.step import Batch, StepLoss, StepParts, forward_backward, reduce_gradients


def reset_telemetry(chunks: list[Transformer]) -> None:
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                module.reset_telemetry()
        chunk.aux_loss_value.zero_()


def train_step(chunks: list[Transformer], parts: StepParts, batch: Batch, *, recipe: Recipe,
               ctx: ParallelContext) -> None:
    train = recipe.train
    micro_batches = len(batch.inputs) // train.micro_batch_size
    loss = StepLoss(tokens_per_step=train.global_batch_size * train.seq_length,
                    share=1.0 / (micro_batches * ctx.size("dp")), device=batch.inputs.device)
    reset_telemetry(chunks)
    for optimizer in parts.optimizers:
        optimizer.zero_grad(set_to_none=True)
    forward_backward(chunks, parts.pipeline, batch, micro_batch_size=train.micro_batch_size, loss=loss)
    reduce_gradients(chunks, tp_group=ctx.group("tp"), shared_embedding=parts.shared_embedding)
    clip_grad_norm([p for chunk in chunks for p in chunk.parameters()], train.grad_clip,
                   stage_group=ctx.group("pp"), duplicates=parts.duplicates, device=ctx.device)
    for optimizer in parts.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
