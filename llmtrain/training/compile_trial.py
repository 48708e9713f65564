"""compile=auto: compile the blocks where it was measured to pay, on this machine, for this work.

Whether torch.compile pays depends on the device and the shape: on a GPU it nearly always does; on a
CPU the fused elementwise kernels save OpenMP barriers and memory passes, worth ~10% on small models
with 2 threads, and nothing (or a loss) where the matmuls dominate (measured: a 6 x 384 block at
context 256 ran 635 ms/step compiled against 612 eager). So `auto` decides from measurement:

    cuda     compile from the start, as `on`
    record   this machine measured this work before (engine/compiling.py's records, keyed by the CPU,
             torch, threads, the block's shape, micro-batch, context and precision): its verdict
    trial    no record, one process, eager CPU, a run long enough to repay a compile (TRIAL_MIN_RUN_S
             by the banner's estimate): the run starts eager, times WARM_STEPS-skipped steps, compiles
             at a step boundary, times as many compiled steps, keeps the faster (compiled only when
             KEEP_MARGIN faster) and records the verdict for the next run
    else     eager

A trial's compile step and the steps it times are kept out of the slowdown watch and the thread
follower (their tokens/s change by design); the compile step's time is kept out of the ETA. The
verdict is one `compile` record in metrics.jsonl and one console line. Not tried with several
processes (every rank would have to switch at the same step), a pipeline or tensor parallel
(`compile=on` compiles those from the start), or `deterministic=true`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmtrain.config.schema import CompileMode
from llmtrain.core.errors import ConfigError
from llmtrain.core.files import Kind
from llmtrain.engine.compiling import CompileRecords, compile_blocks, cpu_compiler, decision_key, uncompile_blocks

# A cold compile costs 10-30 s on a 2-core CPU (~3 s from Inductor's cache), and where compiling pays on a
# CPU it gains ~10%: a run shorter than this would lose a quarter of its time or more to a trial that
# fails, and could not win back the compile if it succeeds. Such runs stay eager (compile=on compiles them).
TRIAL_MIN_RUN_S = 120.0
WARM_STEPS = 3  # the first steps after start or a change (allocator, caches) are not timed
TIMED_STEPS = 12  # steps timed on each side (the median: robust to one slow step)
TIMED_SECONDS = 1.0  # and at least this long on each side
KEEP_MARGIN = 0.02  # compiled must be this much faster to stay: compiling changes the numbers' last bits


@dataclass(frozen=True)
class CompileChoice:
    """What `auto` (or on/off) decided before step 1: compile from the start, try it mid-run, or not;
    `why` is the banner's words; `record` the measured verdict it came from (None: not measured)."""

    compile: bool
    trial: bool
    why: str
    key: str | None = None
    record: dict[str, Any] | None = None


def choose_compile(cfg: Any, device: torch.device, threads: int, seq_len: int, *, alone: bool,
                   estimated_run_s: float | None, records: CompileRecords | None = None) -> CompileChoice:
    """compile=on|off as set; compile=auto as the module docstring says (`alone`: one process, no
    pipeline or tensor parallel, one sequence length; `estimated_run_s`: the steps left, estimated)."""
    if cfg.compile is CompileMode.off:
        return CompileChoice(False, False, "compile=off")
    if device.type == "cpu" and cpu_compiler() is None:
        if cfg.compile is CompileMode.on:
            raise ConfigError(f"compile=on, but this machine has no C++ compiler ({os.environ.get('CXX') or 'g++'} is "
                              "not on the PATH), which torch.compile needs to build its CPU kernels; install one "
                              "(e.g. apt install g++), name yours in $CXX, or set compile=auto or compile=off.")
        return CompileChoice(False, False, "auto: eager, no C++ compiler for torch.compile's CPU kernels")
    if cfg.compile is CompileMode.on:
        return CompileChoice(True, False, "compile=on")
    if device.type == "cuda":
        return CompileChoice(True, False, "auto: compiled on CUDA")
    if cfg.deterministic:
        return CompileChoice(False, False, "auto: eager under deterministic=true")
    if not alone:
        return CompileChoice(False, False, "auto: eager on a CPU with several processes, a pipeline, tensor parallel "
                                           "or sequence-length stages (compile=on compiles them)")
    key = decision_key(cfg, device, threads, seq_len)
    record = (records or CompileRecords()).get(key)
    if record is not None:
        ratio = record["eager_ms"] / max(record["compiled_ms"], 1e-9)
        if record["faster"]:
            return CompileChoice(True, False, f"auto: measured {ratio:.2f}x faster compiled on this machine", key,
                                 record)
        return CompileChoice(False, False, f"auto: eager, measured no faster compiled on this machine "
                                           f"({ratio:.2f}x)", key, record)
    if estimated_run_s is None or estimated_run_s < TRIAL_MIN_RUN_S:
        return CompileChoice(False, False, "auto: eager, the run is too short to repay a compile", key)
    return CompileChoice(False, True, "auto: eager, then compiled for a few steps to measure which is faster", key)


class CompileTrial:
    """The mid-run measurement (module docstring). `step_done` after every counted step (a step
    boundary), `paused` after an evaluation, a save or a rollback; the clock is injectable."""

    def __init__(self, *, model: nn.Module, key: str, records: CompileRecords, metrics: Any,
                 say: Callable[[str], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self.model, self.key, self.records = model, key, records
        self.metrics, self.say, self.clock = metrics, say, clock
        self.phase = "eager"
        self.skip = WARM_STEPS
        self.durations: list[float] = []
        self.eager_ms: float | None = None
        self.compile_s = 0.0
        self.last: float | None = None

    @property
    def running(self) -> bool:
        return self.phase != "done"

    def paused(self) -> None:
        """The time since the last step was no step's: the next duration is not timed."""
        self.last = None

    def step_done(self, step: int) -> tuple[bool, float | None]:
        """Step `step` ended. (whether the step was part of the trial: its tokens/s are neither a
        collapse nor a reference; the seconds of this step that were compiling, for the ETA)."""
        if self.phase == "done":
            return False, None
        now = self.clock()
        duration = None if self.last is None else now - self.last
        self.last = now
        if self.phase == "compiling":
            # The step after compile_blocks compiled the forward and backward graphs: that is the cost.
            self.compile_s = duration or 0.0
            self.phase, self.skip, self.durations = "compiled", 1, []
            return True, self.compile_s
        if duration is None:
            return True, None
        if self.skip > 0:
            self.skip -= 1
            return True, None
        self.durations.append(duration)
        if len(self.durations) < TIMED_STEPS or sum(self.durations) < TIMED_SECONDS:
            return True, None
        median_ms = statistics.median(self.durations) * 1e3
        if self.phase == "eager":
            self.eager_ms = median_ms
            # A compile that fails (a broken toolchain) runs those blocks eager, with torch's warning,
            # instead of ending the run mid-way: the trial then measures no gain and stays eager.
            torch._dynamo.config.suppress_errors = True
            compile_blocks(self.model)
            self.phase = "compiling"
        else:
            self._verdict(step, median_ms)
        return True, None

    def _verdict(self, step: int, compiled_ms: float) -> None:
        assert self.eager_ms is not None
        faster = compiled_ms < self.eager_ms * (1 - KEEP_MARGIN)
        if not faster:
            uncompile_blocks(self.model)
        self.phase = "done"
        record = {"faster": faster, "eager_ms": round(self.eager_ms, 3), "compiled_ms": round(compiled_ms, 3),
                  "compile_s": round(self.compile_s, 2)}
        saved = self.records.put(self.key, record)
        self.metrics.write({"kind": Kind.COMPILE, "step": step, **record, "kept": faster, "recorded": saved})
        ratio = self.eager_ms / max(compiled_ms, 1e-9)
        self.say(f"compile=auto: {self.eager_ms:.1f} ms/step eager, {compiled_ms:.1f} compiled ({ratio:.2f}x, "
                 f"compiling took {self.compile_s:.1f} s) -> {'compiled' if faster else 'eager'} from step {step + 1}"
                 + ("; recorded for the next run of this shape on this machine" if saved else ""))


class NullCompileTrial:
    """No trial (compile decided before step 1)."""

    running = False

    def paused(self) -> None:
        pass

    def step_done(self, step: int) -> tuple[bool, float | None]:
        return False, None
