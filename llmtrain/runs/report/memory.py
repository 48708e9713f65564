"""Peak memory and headroom? The peak against what the device has, and the leak alarm (`memory`)."""

from __future__ import annotations

from llmtrain.core.files import Kind
from llmtrain.core.findings import Finding
from llmtrain.runs.records import Records, number
from llmtrain.runs.report.verdict import NA, OK, WARN, Verdict

MEMORY_HEADROOM_WARN = 0.8  # peak above this share of the device's memory leaves little headroom


def memory(records: Records) -> Verdict:
    """The peak memory (GPU tensors, else the process's RSS; every CPU rank of a host counted) against
    the device's, and the leak alarm."""
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
        return Verdict("memory", Finding(question, NA, "no memory figures recorded (monitor off and no end record)."),
                       plots=["memory.png"])
    source = "the end record (the process's high-water mark)" if end_records else "the health checks (sampled)"
    details = [f"peak {what}: {peak:,.0f} MB, from {source}."]
    if cuda_peak is not None and rss_peak is not None:
        details.append(f"host process RSS peak: {rss_peak:,.0f} MB.")
    if not total:
        return Verdict("memory", Finding(question, NA, f"peak {peak:,.0f} MB ({what}); the device's total was not "
                                         "recorded.", details=details), ["memory.png"])
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
        return Verdict("memory", Finding(
            question, WARN, f"{why}: peak {peak:,.0f} of {total:,.0f} MB ({share:.0%}) on {device}. A longer sequence "
            "or a larger batch may not fit: activation checkpointing (model.activation_checkpointing=full, or op for "
            "less recompute), a smaller micro_batch_size with accumulation, or bf16 cut it.", details=details),
            ["memory.png"])
    return Verdict("memory", Finding(
        question, OK, f"peak {peak:,.0f} of {total:,.0f} MB ({share:.0%}) on {device}; {total - peak:,.0f} MB "
        "headroom.", details=details), ["memory.png"])
