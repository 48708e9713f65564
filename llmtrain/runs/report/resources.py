"""The questions about the machine: peak memory and headroom (`memory`), and where a step's time
goes (`step_time`: the phases, the bottleneck, tokens/s and MFU)."""

from __future__ import annotations

import math
import statistics

from llmtrain.core.files import (
    Kind,
)
from llmtrain.runs.records import Records, number
from llmtrain.runs.report.verdict import NA, OK, WARN, Verdict

MEMORY_HEADROOM_WARN = 0.8  # peak above this share of the device's memory leaves little headroom
PHASE_NAMES = ("data", "forward", "backward", "optimizer", "other")

def memory(records: Records) -> Verdict:
    question = "Peak memory and headroom?"
    start = records.last(Kind.START) or {}
    end_records = records.of(Kind.END)
    health = records.of(Kind.HEALTH)
    cuda_peak = max([number(r["cuda_peak_mb"]) for r in end_records + health if r.get("cuda_peak_mb") is not None],
                    default=None)
    rss_peak = max([number(r["peak_rss_mb"]) for r in end_records if r.get("peak_rss_mb") is not None]
                   + [number(r["rss_mb"]) for r in health if r.get("rss_mb") is not None], default=None)
    total = start.get("device_memory_mb")
    device = str(start.get("device", "cpu"))
    # CPU ranks on one host share its memory: rank 0's peak stands for each of them.
    sharing = int(start.get("local_world_size") or 1) if not device.startswith("cuda") else 1
    peak, what = (cuda_peak, "GPU memory allocated by tensors") if cuda_peak is not None else (rss_peak, "process RSS")
    if peak is None:
        return Verdict("memory", question, NA, "no memory figures recorded (monitor off and no end record).",
                       plots=["memory.png"])
    source = "the end record (the process's high-water mark)" if end_records else "the health checks (sampled)"
    details = [f"peak {what}: {peak:,.0f} MB, from {source}."]
    if cuda_peak is not None and rss_peak is not None:
        details.append(f"host process RSS peak: {rss_peak:,.0f} MB.")
    if not total:
        return Verdict("memory", question, NA, f"peak {peak:,.0f} MB ({what}); the device's total was not recorded.",
                       details, ["memory.png"])
    if sharing > 1:
        details.append(f"{sharing} processes share this host's memory: rank 0's peak x {sharing} = "
                       f"{peak * sharing:,.0f} MB is what the host held (the other ranks' peaks are alike).")
        peak *= sharing
    share = peak / total
    details.append(f"{device} memory: {total:,.0f} MB; headroom {total - peak:,.0f} MB ({1 - share:.0%}).")
    leaks = [r for r in records.of(Kind.ALARM) if r.get("alarm") == "memory_leak"]
    if leaks:
        details.append(f"the monitor raised memory_leak at step {leaks[0].get('step')}.")
    if share > MEMORY_HEADROOM_WARN or leaks:
        why = "little headroom" if share > MEMORY_HEADROOM_WARN else "memory grew steadily (leak alarm)"
        return Verdict("memory", question, WARN,
                       f"{why}: peak {peak:,.0f} of {total:,.0f} MB ({share:.0%}) on {device}. A longer sequence or a "
                       "larger batch may not fit: activation checkpointing (model.activation_checkpointing=true), a "
                       "smaller micro_batch_size with accumulation, or bf16 cut it.", details, ["memory.png"])
    return Verdict("memory", question, OK,
                   f"peak {peak:,.0f} of {total:,.0f} MB ({share:.0%}) on {device}; {total - peak:,.0f} MB headroom.",
                   details, ["memory.png"])


def step_time(records: Records) -> Verdict:
    question = "Where does a step's time go?"
    timings = records.of(Kind.TIMING)
    speeds = [v for v in records.series(Kind.TRAIN, "tokens_per_s")[1][1:] if math.isfinite(v)]  # the first holds warm-up
    mfus = [v for v in records.series(Kind.HEALTH, "mfu")[1] if math.isfinite(v)]
    throughput = []
    if speeds:
        throughput.append(f"median {statistics.median(speeds):,.0f} tokens/s over {len(speeds)} log intervals")
    if mfus:
        mfu = statistics.median(mfus)
        throughput.append(f"MFU {mfu:.1%}" if mfu < 0.1 else f"MFU {mfu:.0%}")
        throughput[-1] += " of this device's measured matmul rate"
    if not timings:
        return Verdict("step_time", question, NA,
                       "no step was timed (a run shorter than timing_interval + 1 steps, or timing_interval=0)"
                       + (f"; {', '.join(throughput)}." if throughput else "."), plots=["throughput.png"])
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
    return Verdict("step_time", question, status, finding.rstrip(".") + ".", details, ["step_time.png", "throughput.png"])


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
