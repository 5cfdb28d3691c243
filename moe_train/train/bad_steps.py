"""Which steps may update the model: a non-finite loss or gradient norm, or a loss spike, is never applied.

The trainer asks `BadSteps.admit` after the gradient norm is known and before the optimizer step. A rejected
step applies nothing (no optimizer step, no expert-bias update: model and Adam state stay as they were), so no
checkpoint can ever hold a poisoned state; the loop then skips and counts it, or stops, per `train.on_nonfinite`
and `train.on_loss_spike` (and `train.max_skipped_steps`).

A loss spike (`train.loss_spike_threshold`, null = off): a loss above threshold x the mean of the last
`train.loss_spike_window` admitted steps' losses, checked once the window is full (early losses fall fast; a
partial window would judge against too few steps). Only admitted steps enter the window, so a run of spikes is
judged against the losses before it. The window is part of the checkpoint (Progress.recent_losses), so a
resumed run judges exactly as the uninterrupted one.

Every rank decides the same: the loss is all-reduced and the gradient norm is one all-reduce over every mesh
(grad_norm.py), and an all-reduce gives every rank the same bits.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from moe_train.config.schema import TrainConfig


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """Why a step was not applied. `kind`: nonfinite | loss_spike (which recipe field says skip or stop)."""

    kind: str
    reason: str


class BadSteps:
    def __init__(self, train: TrainConfig, *, recent_losses: tuple[float, ...] = ()) -> None:
        self.threshold = train.loss_spike_threshold
        self.window: deque[float] = deque(recent_losses[-train.loss_spike_window:], maxlen=train.loss_spike_window)

    @property
    def recent_losses(self) -> tuple[float, ...]:
        return tuple(self.window)

    def admit(self, *, loss: float, grad_norm: float) -> Rejection | None:
        """None when the step may be applied (its loss then joins the window), else why not."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return Rejection(kind="nonfinite", reason=f"non-finite loss {loss} or grad norm {grad_norm}")
        if self.threshold is not None and len(self.window) == self.window.maxlen:
            mean = math.fsum(self.window) / len(self.window)
            if loss > self.threshold * mean:
                return Rejection(kind="loss_spike", reason=f"loss spike: {loss:.6g} is over {self.threshold:g} x "
                                 f"{mean:.6g}, the mean of the last {len(self.window)} applied steps' losses")
        self.window.append(loss)
        return None
