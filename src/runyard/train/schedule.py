"""Learning-rate schedule: linear warmup, then cosine or linear decay to a floor (or constant)."""

from __future__ import annotations

import math

from runyard.spec.job import ScheduleSpec


def lr_at(step: int, base_lr: float, schedule: ScheduleSpec, total_steps: int) -> float:
    """The learning rate for optimizer step `step` (0-based) of a `total_steps`-step stage.

    Warmup rises linearly, lr = base * (step + 1) / warmup for step < warmup, so it reaches `base_lr`
    at step `warmup - 1` and the first step never uses lr = 0.
    After warmup the rate falls from `base_lr` to `base_lr * min_lr_ratio` at the last step.
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule.decay == "constant":
        return base_lr
    floor = base_lr * schedule.min_lr_ratio
    decay_steps = max(1, total_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if schedule.decay == "linear":
        return floor + (base_lr - floor) * (1.0 - progress)
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
