"""How long the run has left: seconds per step from the steps' own durations, and the ETA the
progress bar and the log lines show.

Before the first step ends there is only the start-up estimate (the banner's, from the measured
matmul rate and an assumed MFU): shown with a `~`. The first step includes the warm-up (allocator,
kernels, caches), so it alone is also rough (`~`). From the second step on the rate is the mean of
the last RECENT_STEPS steps: it follows a machine that became busier or quieter within a minute
or so. Time spent evaluating or saving is kept out of the step durations (`paused`), and added back
to the time left as the share of the run it has taken so far, so an evaluation neither makes the
next step look slow nor is forgotten.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

RECENT_STEPS = 50
SLOW_STEP_S = 10.0  # steps slower than this are each logged, with their time
FIRST_LINE_WAIT_S = 30.0  # piped output: the first line comes at step 1 when the first interval would take longer


def clock_text(seconds: float) -> str:
    """'0:07', '2:31', '1:02:03'."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class StepClock:
    """Step durations in, seconds per step and time left out. `clock` is injectable (tests)."""

    def __init__(self, total_steps: int, estimate_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, recent: int = RECENT_STEPS,
                 first_step_compiles: bool = False) -> None:
        self.total_steps, self.estimate_s, self.clock = total_steps, estimate_s, clock
        # The first step compiles the optimizer's step (optim=adamw8bit/4bit: ~40 s on CPU): its time
        # says nothing of the steps after it, so until a second step ends the ETA is the estimate's.
        self.first_step_compiles = first_step_compiles
        self.recent: deque[float] = deque(maxlen=recent)
        self.begin(0)

    def begin(self, step: int) -> None:
        """The loop starts at `step` (0, or where a resume left off)."""
        self.start = self.last = self.clock()
        self.begin_step = self.step = step
        self.first_s: float | None = None
        self.recent.clear()
        self.stepped_s = self.paused_s = 0.0  # from the second step on: the steps' time, and the pauses'

    def step_done(self, step: int) -> float:
        """Step `step` (1-based) ended now; returns its duration."""
        now = self.clock()
        duration, self.last, self.step = now - self.last, now, step
        if self.first_s is None:
            self.first_s = duration
        else:
            self.recent.append(duration)
            self.stepped_s += duration
        return duration

    def set_aside_last(self) -> None:
        """The last step's time was mostly something else (compile=auto compiling the blocks): it
        counts neither as a step's time nor as a pause that recurs."""
        if self.recent:
            self.stepped_s -= self.recent.pop()

    def paused(self) -> None:
        """The time since the last step ended was no step's (an evaluation, a save, a rollback)."""
        now = self.clock()
        if self.first_s is not None:
            self.paused_s += now - self.last
        self.last = now

    def moved_to(self, step: int) -> None:
        """A rollback: the run goes on from `step`."""
        self.step = step
        self.paused()

    def per_step(self) -> tuple[float | None, bool]:
        """(seconds per step, whether measured): the recent steps' mean from the second step on;
        before that the first step's time, or the estimate, not measured (None: nothing to go by)."""
        if self.recent:
            return sum(self.recent) / len(self.recent), True
        first = None if self.first_step_compiles else self.first_s
        return (first if first is not None else self.estimate_s), False

    def remaining_s(self) -> float | None:
        per_step, _ = self.per_step()
        if per_step is None:
            return None
        overhead = self.paused_s / self.stepped_s if self.stepped_s > 0 else 0.0
        return per_step * max(0, self.total_steps - self.step) * (1 + overhead)

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def eta_text(self) -> str:
        """'ETA 2:31' (measured), 'ETA ~6:48' (the estimate, or the first step only), 'ETA -:--'."""
        remaining = self.remaining_s()
        if remaining is None:
            return "ETA -:--"
        return f"ETA {'' if self.per_step()[1] else '~'}{clock_text(remaining)}"

    def status_text(self) -> str:
        """'1:02 elapsed, ETA 2:31': the end of a log line."""
        return f"{clock_text(self.elapsed_s())} elapsed, {self.eta_text()}"

    def slow(self, duration: float | None = None) -> bool:
        """Steps are slow (each one is logged): the last one took longer than SLOW_STEP_S, or the
        steps do on average (before the first ends: as estimated)."""
        per_step, _ = self.per_step()
        return (duration is not None and duration > SLOW_STEP_S) or (per_step is not None and per_step > SLOW_STEP_S)

    def first_line_due(self, step: int, log_interval: int) -> bool:
        """Step `step` is the first of this session and the first log line would come more than
        FIRST_LINE_WAIT_S later: show a line now (piped output has no bar to show the ETA)."""
        per_step, _ = self.per_step()
        return (step == self.begin_step + 1 and log_interval > 1 and per_step is not None
                and per_step * (log_interval - 1) > FIRST_LINE_WAIT_S)
