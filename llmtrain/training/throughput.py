"""The mid-run slowdown warning: tokens/s collapsed because the machine became busy.

Progress hands over every log interval's tokens/s. The reference is the best median of the last
REFERENCE_INTERVALS clean intervals seen so far (a median: one odd interval neither makes nor
breaks it); when LOW_INTERVALS clean intervals in a row run below COLLAPSE_FRACTION of it, the run
warns, once, with the figures, how busy the CPU cores are with other processes (measured between
log lines from /proc/stat, distributed/cores.py) and what helps. Intervals that include an
evaluation, a save or a rollback are not counted either way, and a new sequence-length stage
starts a new reference (its tokens/s differ by design). Nothing changes in the run itself here:
where threads=auto follows the machine (threads_follow.py: it switches at step boundaries, never
under a running step) the warning names the count it has now, and intervals with a thread trial
are not clean.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

from llmtrain.core.files import Kind
from llmtrain.distributed.cores import CoreMeter, CpuSample

REFERENCE_INTERVALS = 5
MIN_REFERENCE_INTERVALS = 3  # intervals before there is a reference at all
COLLAPSE_FRACTION = 0.5
LOW_INTERVALS = 2
BUSY_ELSEWHERE_CORES = 0.5  # below this the cores are not the explanation


class SlowdownWatch:
    """Warns once (console + a `slowdown` record in metrics.jsonl) when tokens/s collapses."""

    def __init__(self, warn: Callable[[str], None], metrics: Any, threads: int, meter: CoreMeter | None = None,
                 sibling_cores: float = 0.0, threads_now: Callable[[], int] | None = None) -> None:
        self.warn, self.metrics, self.threads, self.meter = warn, metrics, threads, meter
        # threads=auto following the machine: the count now, which the advice then leaves to it
        self.threads_now = threads_now
        # The run's other local processes (ranks) use cores too: they are not "elsewhere".
        self.sibling_cores = sibling_cores
        self.recent: deque[float] = deque(maxlen=REFERENCE_INTERVALS)
        self.reference: float | None = None
        self.reference_step = 0
        self.low: list[tuple[int, float]] = []  # (first step, tokens/s) of the current run of low intervals
        self.last_step = 0  # where the previous interval ended
        self.stage: object = None
        self.warned = False
        self.last_sample: CpuSample | None = meter.sample() if meter is not None else None
        self.busy: float | None = None  # cores busy elsewhere over the last interval

    def interval(self, step: int, tokens_per_s: float, clean: bool, stage: object = None) -> None:
        """A log interval ended at `step` with this rate; `clean`: no evaluation, save or rollback in it."""
        self._measure_cores()
        began, self.last_step = self.last_step, step
        if self.warned:
            return
        if stage != self.stage:  # a new sequence-length stage: its own tokens/s, its own reference
            self.stage, self.reference, self.low = stage, None, []
            self.recent.clear()
        if not clean:
            return
        if self.reference is not None and tokens_per_s < COLLAPSE_FRACTION * self.reference:
            self.low.append((began, tokens_per_s))
            if len(self.low) >= LOW_INTERVALS:
                self._warn(step)
            return  # a collapsed interval is no part of the reference
        self.low = []
        self.recent.append(tokens_per_s)
        if len(self.recent) >= MIN_REFERENCE_INTERVALS:
            median = statistics.median(self.recent)
            if self.reference is None or median > self.reference:
                self.reference, self.reference_step = median, step

    def _measure_cores(self) -> None:
        if self.meter is None:
            return
        sample = self.meter.sample()
        if sample is not None and self.last_sample is not None:
            busy = self.meter.busy_elsewhere(self.last_sample, sample)
            self.busy = None if busy is None else max(0.0, busy - self.sibling_cores)
        self.last_sample = sample

    def _warn(self, step: int) -> None:
        assert self.reference is not None
        self.warned = True
        since = self.low[0][0]
        now = statistics.median(rate for _, rate in self.low)
        cores = self.meter.cores if self.meter is not None else None
        threads = self.threads_now() if self.threads_now is not None else self.threads
        message = f"tokens/s fell from {self.reference:,.0f} to {now:,.0f} since step {since}; "
        if self.busy is not None and cores and self.busy >= BUSY_ELSEWHERE_CORES:
            if self.threads_now is not None:
                helps = (f"freeing the cores helps (threads=auto follows them: this run has {threads} "
                         f"thread{'s' if threads != 1 else ''} now)")
            elif threads > 1:
                helps = (f"threads=1 or freeing the cores helps (this run has {threads} threads; Ctrl-C saves a "
                         "checkpoint, and the same command with threads=1, or threads=auto, resumes from it)")
            else:
                helps = "freeing the cores helps (this run already has 1 thread)"
            message += f"other processes are using the CPU cores ({self.busy:.1f} of {cores} busy): {helps}"
        elif self.busy is not None and cores:
            message += (f"the CPU cores are not busy elsewhere ({self.busy:.1f} of {cores}), so the slowdown is in "
                        "this run or its device (data loading, memory swapping, a throttled or shared GPU)")
        else:
            message += "other work on this machine or its device (a shared GPU, thermal throttling) may be the cause"
        self.warn(message)
        self.metrics.write({"kind": Kind.SLOWDOWN, "step": step, "since_step": since, "tokens_per_s": now,
                            "reference_tokens_per_s": self.reference, "reference_step": self.reference_step,
                            "busy_cores_elsewhere": self.busy, "cores": cores, "threads": threads})


class NullSlowdownWatch:
    """The slowdown warning of a rank that does not speak (every rank but 0): nothing to do."""

    def interval(self, step: int, tokens_per_s: float, clean: bool, stage: object = None) -> None:
        pass
