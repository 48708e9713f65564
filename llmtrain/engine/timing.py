"""Where a step's time goes: data, forward, backward, optimizer, other, timed on sampled steps.

Every `timing_interval`-th step (counted from step 1 + interval, so the first, warm-up step is never
one, and with the default intervals never a health-check or log step either) the loop calls
`lap(phase)` at each phase's end; the time since the previous lap is that phase's. On CUDA each
lap synchronizes the device first, or the host would time kernel launches, not kernels: that is
why only sampled steps are timed. On other steps `lap` does nothing.
"""

from __future__ import annotations

import time

import torch

from llmtrain.core.files import Kind

PHASES = ("data", "forward", "backward", "optimizer", "other")


class StepTimer:
    def __init__(self, interval: int, device: torch.device) -> None:
        self.interval = interval
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.active = False
        self.seconds: dict[str, float] = {}
        self.began = self.last = 0.0

    def start(self, step: int) -> None:
        """`step`: the 1-based number of the step about to be taken."""
        self.active = self.interval > 0 and step > 1 and (step - 1) % self.interval == 0
        if self.active:
            if self.sync is not None:
                self.sync()
            self.seconds = dict.fromkeys(PHASES, 0.0)
            self.began = self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the previous lap was spent in `phase` (added up over micro-batches)."""
        if self.active:
            if self.sync is not None:
                self.sync()
            now = time.perf_counter()
            self.seconds[phase] += now - self.last
            self.last = now

    def finish(self, step: int) -> dict | None:
        """The step's `timing` record (None on a step that was not timed)."""
        if not self.active:
            return None
        self.lap("other")
        self.active = False
        total = self.last - self.began
        return {"kind": Kind.TIMING, "step": step, "total_s": total, **{f"{p}_s": s for p, s in self.seconds.items()}}
