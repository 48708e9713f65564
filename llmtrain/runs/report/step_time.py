"""Where does a step's time go? The phases of the timed steps, the bottleneck, tokens/s and MFU, and
the log intervals that ran far slower than the rest (`step_time`)."""

from __future__ import annotations

import math
import statistics

from llmtrain.core.files import Kind
from llmtrain.core.findings import Finding
from llmtrain.runs.records import Records, number
from llmtrain.runs.report.verdict import NA, OK, WARN, Verdict

PHASE_NAMES = ("data", "forward", "backward", "optimizer", "other")


def _mfu_text(mfu: float) -> str:
    """The MFU against the matmul rate measured at start-up, or why it is not shown: above 100% the
    measurement read low (other work held the cores while it was timed), and the figure would claim
    more than the device can do."""
    if mfu > 1.0:
        return (f"MFU not shown: the run computed {mfu:.1f}x the matmul rate measured at start-up, so that "
                "measurement read low (the machine was busy while it was timed)")
    return (f"MFU {mfu:.1%}" if mfu < 0.1 else f"MFU {mfu:.0%}") + " of this device's measured matmul rate"


def step_time(records: Records) -> Verdict:
    """The phases of the timed steps (data, forward, backward, optimizer, other), the bottleneck,
    tokens/s and MFU, and log intervals far slower than the rest."""
    question = "Where does a step's time go?"
    timings = records.of(Kind.TIMING)
    # the first logged speed holds the warm-up
    speeds = [v for v in records.series(Kind.TRAIN, "tokens_per_s")[1][1:] if math.isfinite(v)]
    mfus = [v for v in records.series(Kind.HEALTH, "mfu")[1] if math.isfinite(v)]
    throughput = []
    if speeds:
        throughput.append(f"median {statistics.median(speeds):,.0f} tokens/s over {len(speeds)} log intervals")
    if mfus:
        throughput.append(_mfu_text(statistics.median(mfus)))
    if not timings:
        return Verdict("step_time", Finding(
            question, NA, "no step was timed (a run shorter than timing_interval + 1 steps, or timing_interval=0)"
            + (f"; {', '.join(throughput)}." if throughput else ".")), plots=["throughput.png"])
    medians = {p: statistics.median(number(t[f"{p}_s"]) for t in timings) for p in PHASE_NAMES}
    total = statistics.median(number(t["total_s"]) for t in timings)
    shares = {p: medians[p] / max(sum(medians.values()), 1e-12) for p in PHASE_NAMES}
    bottleneck = max(PHASE_NAMES, key=lambda p: shares[p])
    split = ", ".join(f"{p} {shares[p]:.0%}" for p in PHASE_NAMES)
    details = [f"{len(timings)} timed step(s) (every timing_interval-th); median {total * 1000:,.1f} ms per step: "
               + ", ".join(f"{p} {medians[p] * 1000:,.1f} ms" for p in PHASE_NAMES) + "."]
    details += [t[0].upper() + t[1:] + "." for t in throughput]
    advice = {
        "data": "the model waits for batches: prepare the data once (llmtrain prepare), keep it on a local disk, "
                "or a larger micro-batch per read.",
        "optimizer": "the optimizer step dominates: use a fused or foreach optimizer (optim.fused=true), fewer "
                     "parameter groups, or a larger batch per step.",
        "other": "host-side overhead dominates (logging syncs, Python between kernels): raise log_interval and "
                 "monitor.interval, or compile (compile=on on GPU).",
    }
    status = WARN if bottleneck in advice and shares[bottleneck] > 0.25 else OK
    finding = f"{split} of {total * 1000:,.1f} ms/step; bottleneck: {bottleneck}"
    if status == WARN:
        finding += f" ({advice[bottleneck]})"
    else:
        finding += " (compute, as it should be)" if bottleneck in ("forward", "backward") else ""
    if throughput:
        finding += f"; {throughput[0]}" + (f", {throughput[1]}" if len(throughput) > 1 else "")
    slow = _slow_intervals(records)
    if slow:
        status = WARN
        finding += f". {slow}"
    return Verdict("step_time", Finding(question, status, finding.rstrip(".") + ".", details=details),
                   ["step_time.png", "throughput.png"])


def _slow_intervals(records: Records) -> str:
    """Log intervals at under half the median speed, when they are more than a stray one or two: the
    machine was shared, or something stalled the loop. The same code ran at full speed elsewhere."""
    points = [(s, v) for s, v in zip(*records.series(Kind.TRAIN, "tokens_per_s"))][1:]
    points = [(s, v) for s, v in points if math.isfinite(v)]
    if len(points) < 10:
        return ""
    median = statistics.median(v for _, v in points)
    slow = [(s, v) for s, v in points if v < 0.5 * median]
    if len(slow) <= max(2, len(points) // 20):
        return ""
    slowest = min(slow, key=lambda sv: sv[1])
    return (f"Throughput fell below half its median in {len(slow)} of {len(points)} log intervals (slowest "
            f"{slowest[1]:,.0f} tokens/s, at step {slowest[0]}; steps {slow[0][0]}-{slow[-1][0]}): another process "
            "competing for the CPU or GPU, swapping, a stalled file system, or thermal throttling; the same code ran "
            "at full speed in the other intervals")
