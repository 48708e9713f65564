"""Learning-rate schedules as pure functions of the optimizer step (nothing to checkpoint)."""

from __future__ import annotations

import math

from llmtrain.config.derived import resolved_warmup_steps
from llmtrain.config.schema import ScheduleConfig, ScheduleName


def lr_at(step: int, peak_lr: float, total_steps: int, cfg: ScheduleConfig) -> float:
    """LR for optimizer step `step` (0-based) of a schedule of `total_steps` steps (`schedule_steps`:
    the run's length unless schedule.total_steps sets another).

    Warmup is linear from peak/warmup up to the peak, so the first step already moves; the decay
    then reaches `min_lr_ratio x peak` exactly on the schedule's last step and stays there for any
    step past its end (a constant schedule stays at the peak).
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


def final_lr(peak_lr: float, total_steps: int, cfg: ScheduleConfig) -> float:
    """The LR a schedule of `total_steps` steps holds from its end on: the floor (min_lr_ratio x peak,
    0 when that is 0), or the peak for a constant schedule."""
    return lr_at(total_steps, peak_lr, total_steps, cfg)


def held_lr_text(lr: float, peak_lr: float) -> str:
    """How the banner and `check` name the LR held past a schedule's end: "LR 0", "the floor LR
    0.0003" or "the peak LR 0.003"."""
    if lr == 0:
        return "LR 0"
    return f"the {'peak' if lr >= peak_lr else 'floor'} LR {lr:.3g}"
