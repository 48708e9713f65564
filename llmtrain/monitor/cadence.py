"""Which steps the health monitor samples block activations on, from the config alone (no torch):
the loop's watch samples by it, and the report names it when a run has no samples.

Activations are sampled on check steps only (every `monitor.interval`), every
`monitor.activation_interval` steps: on the steps that are multiples of both. A run too short to
get ACTIVATION_SAMPLES_MIN samples that way (49 steps at the default 10 and 20: two samples, a
line and not a curve) samples denser: on the largest multiple of `monitor.interval` that gives it
that many, at most every check. The cadence comes from the run's planned total of steps, never from
where a resume started, so a resumed run samples the very steps the uninterrupted one does.
"""

from __future__ import annotations

import math

from llmtrain.config.schema import MonitorConfig

# Samples a run should have at least: five points draw a curve (and fill the variance trend window,
# monitor.activation_window, at its default of 5).
ACTIVATION_SAMPLES_MIN = 5


def activation_every(cfg: MonitorConfig, total_steps: int) -> int:
    """The steps between activation samples of a run of `total_steps` steps; always a multiple of
    `cfg.interval`, so every sample falls on a check step."""
    every = math.lcm(cfg.interval, cfg.activation_interval)
    if total_steps // every >= ACTIVATION_SAMPLES_MIN:
        return every
    return cfg.interval * max(1, total_steps // ACTIVATION_SAMPLES_MIN // cfg.interval)


def samples_expected(cfg: MonitorConfig, total_steps: int) -> int:
    """How many steps of a run of `total_steps` steps are sampled (0 with the monitor off)."""
    if not cfg.enabled or total_steps <= 0:
        return 0
    return total_steps // activation_every(cfg, total_steps)


def cadence_text(cfg: MonitorConfig, total_steps: int) -> str:
    """'the monitor samples activations every 20 steps (monitor.activation_interval=20)', or why it
    samples denser on this run."""
    every = activation_every(cfg, total_steps)
    if every == math.lcm(cfg.interval, cfg.activation_interval):
        keys = f"monitor.activation_interval={cfg.activation_interval}"
        if every != cfg.activation_interval:  # not a multiple of the check interval
            keys += f" on checks, monitor.interval={cfg.interval}"
        return f"the monitor samples activations every {every} steps ({keys})"
    return (f"the monitor samples activations every {every} steps on a {total_steps}-step run: denser than "
            f"monitor.activation_interval={cfg.activation_interval}, for {ACTIVATION_SAMPLES_MIN} samples")
