"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay (WSD) or constant.

The schedule is a pure function of the step, so a resumed run needs nothing but the step to continue on the
same curve: there is no scheduler object whose state could drift from the checkpoint.
"""

from __future__ import annotations

import math

from moe_train.config.schema import TrainConfig


def lr_at(step: int, *, train: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (1-based: the first update is step 1).

    Warmup rises linearly to `lr`, reaching it at `warmup_steps`. Afterwards:
    - cosine: half a cosine from `lr` at the end of warmup down to `min_lr` at `steps`;
    - wsd: `lr` held, then a linear decay to `min_lr` over the last `wsd_decay_fraction` of the steps
      (counted after warmup);
    - constant: `lr`.
    Past `steps` (a run extended beyond its horizon) the rate stays at its final value.
    """
    peak, floor = train.lr, min(train.min_lr, train.lr)
    warmup = train.warmup_steps
    if step <= warmup:
        return peak * step / warmup
    if train.lr_schedule == "constant":
        return peak
    span = max(1, train.steps - warmup)
    done = min(step - warmup, span)
    if train.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * done / span))
    decay_steps = max(1, round(train.wsd_decay_fraction * span))
    into_decay = done - (span - decay_steps)
    if into_decay <= 0:
        return peak
    return peak + (floor - peak) * into_decay / decay_steps
