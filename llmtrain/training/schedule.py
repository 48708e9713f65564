"""Learning-rate schedules as pure functions of the optimizer step (nothing to checkpoint)."""

from __future__ import annotations

import math

from llmtrain.config.derived import resolved_warmup_steps
from llmtrain.config.schema import ScheduleConfig, ScheduleName


def lr_at(step: int, peak_lr: float, total_steps: int, cfg: ScheduleConfig) -> float:
    """LR for optimizer step `step` (0-based) of a run of `total_steps` steps.

    Warmup is linear from peak/warmup up to the peak, so the first step already moves; the decay
    then reaches `min_lr_ratio x peak` exactly on the last step.
    """
    warmup = resolved_warmup_steps(cfg, total_steps)
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    floor = peak_lr * cfg.min_lr_ratio
    if cfg.name is ScheduleName.constant:
        return peak_lr
    decay_start = warmup
    if cfg.name is ScheduleName.wsd:
        decay_start = max(warmup, total_steps - max(1, round(cfg.decay_fraction * total_steps)))
        if step < decay_start:
            return peak_lr
    progress = _decay_progress(step, decay_start, total_steps)
    if cfg.name is ScheduleName.cosine:
        return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak_lr - (peak_lr - floor) * progress  # linear, and wsd's final decay


def _decay_progress(step: int, start: int, total_steps: int) -> float:
    """0 on the first decay step, 1 on the last; a one-step decay goes straight to the floor."""
    decay_steps = total_steps - start
    if decay_steps <= 1:
        return 1.0
    return min(1.0, (step - start) / (decay_steps - 1))
