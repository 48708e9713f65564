"""Learning-rate schedules as pure functions of the optimizer step (nothing to checkpoint)."""

from __future__ import annotations

import math

from llmtrain.config import ScheduleConfig, ScheduleName, warmup_steps


def lr_at(step: int, peak_lr: float, total_steps: int, cfg: ScheduleConfig) -> float:
    """LR for optimizer step `step` (0-based) of a run of `total_steps` steps.

    Warmup is linear from peak/warmup up to the peak, so the first step already moves; the decay
    then reaches `min_lr_ratio x peak` exactly on the last step.
    """
    warmup = warmup_steps(cfg, total_steps)
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    floor = peak_lr * cfg.min_lr_ratio
    if cfg.name is ScheduleName.constant:
        return peak_lr
    if cfg.name is ScheduleName.wsd:
        decay_start = max(warmup, total_steps - max(1, round(cfg.decay_fraction * total_steps)))
        if step < decay_start:
            return peak_lr
        progress = (step - decay_start) / max(1, total_steps - 1 - decay_start)
        return peak_lr - (peak_lr - floor) * min(1.0, progress)
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    if cfg.name is ScheduleName.linear:
        return peak_lr - (peak_lr - floor) * progress
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
