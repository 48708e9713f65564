"""Plots with nothing to show, and the one line that says why one was left out.

A curve needs CURVE_MIN_POINTS points: one or two draw a dot or a straight line, which a reader
takes for a trend. The report (runs/report/) and the sweep comparison (runs/compare.py) draw a
plot only when at least one of its curves has that many, and otherwise write no PNG and say, in
one line, what was recorded, how often the run records it, and the setting that gives a curve:

    activations.png: left out: only 2 activation samples (the monitor samples activations every 20
    steps ...; this run took 49 steps): too few for a curve; monitor.interval=9 gives 5

The run's config (its config.yaml) says how often each source records; without one (a copied or
damaged run dir) the line says what was recorded and no more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.monitor.cadence import activation_every, cadence_text

CURVE_MIN_POINTS = 3
TARGET_POINTS = 5  # what a suggested setting aims for: a curve with a shape


def plural(count: int, one: str, many: str | None = None) -> str:
    """'1 train loss', '2 train losses'."""
    return f"{count} {one if count == 1 else (many or one + 's')}"


def enough(*counts: int) -> bool:
    """Some curve of the plot has enough points to be a curve."""
    return max(counts, default=0) >= CURVE_MIN_POINTS


def denser(key: str, current: int, steps: int) -> str:
    """'; log_interval=4 gives 5': the setting of `key` (now `current`) that records TARGET_POINTS
    points over `steps` steps; "" when it is already that dense (or the run took too few steps for
    any setting to give a curve)."""
    every = max(1, steps // TARGET_POINTS)
    if every >= current or steps // every < CURVE_MIN_POINTS:
        return ""
    return f"; {key}={every} gives {steps // every}"


@dataclass
class Reasons:
    """Why a plot of one run has nothing to show: what was recorded against how often the run's
    config records it. `cfg` is the run's Config (None when config.yaml is missing or unreadable),
    `steps` the steps the run took, `planned` the steps it planned (its start record's)."""

    cfg: Any
    steps: int
    planned: int | None = None

    def _few(self, count: int, what: str, many: str | None = None) -> str:
        return f"no {many or what + 's'}" if count == 0 else f"only {plural(count, what, many)}"

    def _end(self, count: int, suggestion: str) -> str:
        return (": too few for a curve" if count else "") + suggestion

    def logged(self, name: str, count: int, what: str, many: str | None = None) -> str:
        """A plot of train records (every log_interval steps)."""
        text = f"{name}: left out: {self._few(count, 'logged ' + what, many and 'logged ' + many)}"
        if self.cfg is None:
            return text + f" (this run took {self.steps} steps)" + self._end(count, "")
        every = self.cfg.log_interval
        return (text + f" (one every log_interval={every} steps and at the end; this run took {self.steps} steps)"
                + self._end(count, denser("log_interval", every, self.steps)))

    def monitored(self, name: str, count: int, what: str) -> str:
        """A plot of health checks (every monitor.interval steps)."""
        off = self._monitor_off(name, what)
        if off:
            return off
        text = f"{name}: left out: {self._few(count, what + ' reading')}"
        if self.cfg is None:
            return text + f" (this run took {self.steps} steps)" + self._end(count, "")
        every = self.cfg.monitor.interval
        return (text + f" (the monitor checks every monitor.interval={every} steps; this run took {self.steps} steps)"
                + self._end(count, denser("monitor.interval", every, self.steps)))

    def activations(self, name: str, sampled: list[int]) -> str:
        """activations.png: the samples come at the cadence of monitor/cadence.py; `sampled` are the
        steps that were sampled."""
        off = self._monitor_off(name, "activation samples")
        if off:
            return off
        count = len(sampled)
        text = f"{name}: left out: {self._few(count, 'activation sample')}"
        at = f" at {'step' if count == 1 else 'steps'} {', '.join(map(str, sampled))}" if sampled else ""
        if self.cfg is None:
            return text + f"{at} (this run took {self.steps} steps)" + self._end(count, "")
        planned = self.planned or self.steps
        every = activation_every(self.cfg.monitor, planned)
        cadence = cadence_text(self.cfg.monitor, planned)
        if sampled and sampled != list(range(every, self.steps + 1, every)):  # a run of an older llmtrain
            cadence = f"today {cadence}"
        # Any run of at least ACTIVATION_SAMPLES_MIN checks gets that many samples; a shorter one needs denser checks.
        return (text + f"{at} ({cadence}; this run took {self.steps} steps)"
                + self._end(count, denser("monitor.interval", self.cfg.monitor.interval, self.steps)))

    def timed(self, name: str) -> str:
        """step_time.png: no timed step."""
        if self.cfg is None:
            return f"{name}: left out: no step was timed (this run took {self.steps} steps)"
        every = self.cfg.timing_interval
        if every == 0:
            return f"{name}: left out: no step was timed (timing_interval=0 times none)"
        text = (f"{name}: left out: no step was timed (every timing_interval={every}-th step is, from step {every + 1} "
                f"on; this run took {self.steps} steps)")
        fitting = max(1, (self.steps - 1) // 3)  # times steps fitting + 1, 2 x fitting + 1, ...: three of them
        return text + (f"; timing_interval={fitting} times {(self.steps - 1) // fitting}"
                       if 1 < self.steps and fitting < every else "")

    def evaluated(self, name: str, count: int) -> str:
        """eval_tasks.png: the tasks are evaluated at every evaluation (eval_interval, and at the end)."""
        text = f"{name}: left out: {self._few(count, 'evaluation')} of the tasks"
        if self.cfg is None:
            return text + f" (this run took {self.steps} steps)" + self._end(count, "")
        every = self.cfg.eval_interval
        if every == 0:
            return text + " (eval_interval=0: the run evaluates nothing)"
        return (text + f" (at every evaluation: every eval_interval={every} steps and at the end; this run took "
                f"{self.steps} steps)" + self._end(count, denser("eval_interval", every, self.steps)))

    def _monitor_off(self, name: str, what: str) -> str:
        if self.cfg is not None and not self.cfg.monitor.enabled:
            return f"{name}: left out: no {what}: the monitor was off (monitor.enabled=false)"
        return ""
