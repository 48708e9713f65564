"""threads=auto, mid-run: the thread count follows the machine.

Start-up picks the count from the cores free at that moment (distributed/cores.py). A run started
while another process was busy kept 1 thread for all its steps after that process ended (114 ms
per step against ~65 with 2). So the run keeps measuring, at no cost to the step: every window
of about WINDOW_SECONDS (and at least WINDOW_STEPS steps) it reads its own tokens/s and, from two
/proc/stat samples at the window's ends (no sleep: the steps are the wait), the cores other
processes kept busy. The count those free cores pick (`pick_threads`, as at start-up) is the
signal that the machine changed; the tokens/s are the judge:

    settle  the pick differs from the count in SETTLE_WINDOWS windows in a row (one busy second is
            no change); the rate of those windows, at the current count, is the baseline
    trial   torch.set_num_threads(pick) at the step boundary; TRIAL_WINDOWS windows at the new count
    verdict the trial's tokens/s beat the baseline by KEEP_MARGIN: kept; else the old count comes
            back. The count that lost (either one) is not tried again until the free cores move
            FORGET_CORES away from where it lost (the machine changed again): no oscillation

Each switch (trial, kept, reverted) is a `threads` record in metrics.jsonl and one console line.
A window that holds an evaluation, a save or a rollback is dropped (Progress says `paused`), and a
new sequence-length stage ends a trial (its tokens/s differ by design).

Who follows (`thread_follower`): threads=auto only, on the CPU (on an accelerator the step is the
device's time: a trial would measure noise), with one process: the ranks of a multi-process run
step together, the slowest one sets the pace, and a switch would have to be agreed by all at the
same step; starting with one process keeps it simple and correct. Not a SLURM task (its cores are
its own). Blocks compiled on the CPU follow too: llmtrain compiles them with Inductor's dynamic
thread count (engine/compiling.py), where by default a kernel has the count written in and a switch
would compile it again. Not while compile=auto's trial times its steps (`hold`). And only where
/proc/stat is readable (Linux). A switch changes the numbers a little: the forward is
bit-identical with 1 or 2 threads, LayerNorm's weight and bias gradients are not (their reduction
over the rows is split by thread: ~1e-9 apart), and the losses then drift as with any rounding
difference (docs/performance.md, "Threads that follow the machine").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from llmtrain.config.threads import parse_threads
from llmtrain.core.files import Kind
from llmtrain.distributed.cores import CoreMeter, CpuSample, cgroup_cpu_quota, pick_threads
from llmtrain.distributed.layout import local_world_size, slurm_task_cores

WINDOW_SECONDS = 1.0  # ~100 scheduler ticks per core: a busy-core reading steady to a tenth of a core
WINDOW_STEPS = 5  # and never fewer steps than this (slow steps: a window per 5 of them)
SETTLE_WINDOWS = 2  # windows in a row that must show the machine changed before a trial
TRIAL_WINDOWS = 2  # windows a trial count runs before its verdict (>= 10 steps)
KEEP_MARGIN = 0.05  # a trial count stays only when this much faster: a tie keeps the count that ran
FORGET_CORES = 0.5  # a count that lost is tried again once the free cores moved this far (the machine changed)


@dataclass(frozen=True)
class Reading:
    """One window: where it ended, its tokens/s, the cores free of other processes over it, and
    the count those cores pick."""

    step: int
    tokens_per_s: float
    free_cores: float
    pick: int


@dataclass
class Trial:
    """A count on trial: what ran before it, at what rate (the baseline), on how many free cores,
    and the trial windows' rates so far."""

    before: int
    count: int
    baseline: float
    free_cores: float
    rates: list[float] = field(default_factory=list)


@dataclass
class Window:
    """The window being measured: where it began."""

    step: int
    tokens: int
    time: float
    sample: CpuSample | None


def plural(count: int) -> str:
    return f"{count} thread{'s' if count != 1 else ''}"


class ThreadFollower:
    """Follows the free cores with the thread count (see the module docstring). `step_done` is
    called after every counted step, `paused` after an evaluation, a save or a rollback; the
    setter, the clock and the meter are injectable (the tests drive them)."""

    def __init__(self, *, threads: int, meter: CoreMeter, metrics: Any, say: Callable[[str], None],
                 quota: float | None = None, set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.perf_counter, hold: Callable[[], bool] = lambda: False) -> None:
        self.threads, self.meter, self.metrics, self.say = threads, meter, metrics, say
        # True while the count must stay: compile=auto's trial is timing the steps.
        self.hold = hold
        self.quota, self.set_threads, self.clock = quota, set_threads, clock
        self.window: Window | None = None
        self.stage: object = None
        self.changed: list[Reading] = []  # the windows in a row whose pick differs from the count
        self.trial: Trial | None = None
        self.lost: dict[int, float] = {}  # count -> free cores when it lost its trial

    def step_done(self, step: int, tokens: int, stage: object = None) -> bool:
        """A step ended (a step boundary: the count may change here). True when it ran on a count
        on trial: Progress keeps such steps' intervals out of the slowdown watch."""
        trying = self.trial is not None
        if not trying and self.hold():
            self.window, self.changed = None, []
            return False
        now = self.clock()
        if stage != self.stage:  # a new sequence-length stage: its own tokens/s, no baseline left
            self.stage, self.window, self.changed = stage, None, []
            if self.trial is not None:
                self._switch(step, self.trial.count, self.trial.before, "reverted",
                             "a new sequence-length stage began during the trial", self.trial.free_cores,
                             None, self.trial.baseline)
                self.trial = None
            return trying
        window = self.window
        if window is None:
            self.window = Window(step, tokens, now, self.meter.sample())
            return trying
        if step - window.step < WINDOW_STEPS or now - window.time < WINDOW_SECONDS:
            return trying
        sample = self.meter.sample()
        self.window = Window(step, tokens, now, sample)
        busy = (self.meter.busy_elsewhere(window.sample, sample)
                if window.sample is not None and sample is not None else None)
        if busy is not None:
            free = self.meter.cores - busy
            pick = pick_threads(min(free, self.quota) if self.quota is not None else free, self.meter.cores, 1)
            self._decide(Reading(step, (tokens - window.tokens) / max(now - window.time, 1e-9), free, pick))
        return trying

    def paused(self) -> None:
        """An evaluation, a save or a rollback: the window in progress is not the steps' rate."""
        self.window = None

    # ---- the decision, once per window --------------------------------------------------------

    def _decide(self, reading: Reading) -> None:
        if self.trial is not None:
            self.trial.rates.append(reading.tokens_per_s)
            if len(self.trial.rates) >= TRIAL_WINDOWS:
                self._verdict(reading.step)
            return
        # A count that lost may win again once the machine changed: its free cores moved enough.
        self.lost = {count: free for count, free in self.lost.items()
                     if abs(reading.free_cores - free) < FORGET_CORES}
        if reading.pick == self.threads or reading.pick in self.lost:
            self.changed = []
            return
        if self.changed and self.changed[-1].pick != reading.pick:
            self.changed = []
        self.changed.append(reading)
        if len(self.changed) >= SETTLE_WINDOWS:
            baseline = statistics.median(r.tokens_per_s for r in self.changed)
            self.changed = []
            self.trial = Trial(self.threads, reading.pick, baseline, reading.free_cores)
            cores = self.meter.cores
            why = (f"cores freed: {reading.free_cores:.1f} of {cores} free" if reading.pick > self.threads
                   else f"cores taken: {cores - reading.free_cores:.1f} of {cores} busy elsewhere")
            self._switch(reading.step, self.trial.before, reading.pick, "trial", why, reading.free_cores,
                         baseline, None)

    def _verdict(self, step: int) -> None:
        trial = self.trial
        assert trial is not None
        self.trial = None
        rate = statistics.median(trial.rates)
        figures = (f"{rate:,.0f} tok/s with {plural(trial.count)} against {trial.baseline:,.0f} with "
                   f"{plural(trial.before)}")
        if rate >= trial.baseline * (1 + KEEP_MARGIN):
            self.lost[trial.before] = trial.free_cores  # the count it beat, on this machine: not worth a trial back
            self._record(step, trial.before, trial.count, "kept", f"measured faster: {figures}", trial.free_cores,
                         trial.baseline, rate)
            self.say(f"threads: {trial.count} kept at step {step} (measured faster: {figures})")
            return
        self.lost[trial.count] = trial.free_cores
        self._switch(step, trial.count, trial.before, "reverted", f"measured slower: {figures}", trial.free_cores,
                     rate, trial.baseline)

    def _switch(self, step: int, before: int, after: int, phase: str, why: str, free: float,
                before_rate: float | None, after_rate: float | None) -> None:
        """torch's thread count set (the caller is at a step boundary), the record and the line."""
        self.set_threads(after)
        self.threads = after
        self._record(step, before, after, phase, why, free, before_rate, after_rate)
        self.say(f"threads: {before} -> {after} at step {step}, {'on trial' if phase == 'trial' else phase} ({why})")

    def _record(self, step: int, before: int, after: int, phase: str, why: str, free: float,
                before_rate: float | None, after_rate: float | None) -> None:
        self.metrics.write({"kind": Kind.THREADS, "step": step, "phase": phase, "from": before, "to": after,
                            "why": why, "free_cores": free, "cores": self.meter.cores,
                            "from_tokens_per_s": before_rate, "to_tokens_per_s": after_rate})


class NullThreadFollower:
    """The count stays: an explicit `threads`, or a run that does not follow (see `thread_follower`)."""

    def step_done(self, step: int, tokens: int, stage: object = None) -> bool:
        return False

    def paused(self) -> None:
        pass


def thread_follower(setting: object, *, threads: int, device: torch.device, world_size: int,
                    metrics: Any, say: Callable[[str], None],
                    meter: CoreMeter | None = None, hold: Callable[[], bool] = lambda: False,
                    ) -> ThreadFollower | NullThreadFollower:
    """A `ThreadFollower` where the run may change its count (threads=auto, CPU, one process, not
    a SLURM task, /proc/stat readable); a `NullThreadFollower` elsewhere."""
    if (parse_threads(setting) is not None or device.type != "cpu" or world_size > 1 or local_world_size() > 1
            or slurm_task_cores()):
        return NullThreadFollower()
    meter = meter or CoreMeter()
    if meter.sample() is None:  # no /proc/stat (macOS, Windows): nothing to follow with
        return NullThreadFollower()
    return ThreadFollower(threads=threads, meter=meter, metrics=metrics, say=say, quota=cgroup_cpu_quota(),
                          hold=hold)
