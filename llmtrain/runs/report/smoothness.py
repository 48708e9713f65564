"""Is the loss curve smooth? Spikes in the train loss, each point against the window before it
(`smoothness`); the loss plot opens its section."""

from __future__ import annotations

import statistics

from llmtrain.core.files import Kind
from llmtrain.core.findings import Finding
from llmtrain.monitor.robust import SPIKE_MIN_RISE, SPIKE_MIN_SHARE, is_spike, robust_z
from llmtrain.runs.records import Records
from llmtrain.runs.report.verdict import NA, OK, WARN, Verdict, logged, train_losses

SMOOTHNESS_QUESTION = "Is the loss curve smooth?"  # its section holds the loss plot
SPIKE_WINDOW = 20  # logged points a loss value is compared with
SPIKE_MIN_BEFORE = 3  # a loss is judged once this many come before it: fewer have no spread to judge by
# A spike is also large: on a flat curve (LR 1e-8: 5.39 +- 1e-4) the MAD is ~0 and any wobble has a
# huge robust z. Noise of a healthy gpt_tiny run is ~0.05 nats; a real spike is tenths of a nat
# (monitor/detectors.py's SPIKE_MIN_RISE and SPIKE_MIN_SHARE, which the monitor's spike alarm uses too).


def _rise(finite: list[tuple[int, float]], i: int) -> tuple[float, float, float]:
    """Point i against the (up to) SPIKE_WINDOW points before it: (robust z, rise above their
    median in nats, the median)."""
    window = [v for _, v in finite[max(0, i - SPIKE_WINDOW):i]]
    median = statistics.median(window)
    return robust_z(finite[i][1], window), finite[i][1] - median, median


def smoothness(records: Records, spike_z: float) -> Verdict:
    """Spikes in the train loss (a robust z-score against the window before each point, and a rise
    large in nats and in share) and non-finite steps; the spikes' steps are marked on the loss plot."""
    question = SMOOTHNESS_QUESTION
    finite = train_losses(records)
    nonfinite = logged(records, Kind.NONFINITE)
    if len(finite) < 5 and not nonfinite:
        return Verdict("smoothness",
                       Finding(question, NA, f"only {len(finite)} logged train losses; too few to judge."),
                       plots=["loss.png"])
    rises = [(i, *_rise(finite, i)) for i in range(SPIKE_MIN_BEFORE, len(finite))]
    spikes = [(z, finite[i][0], finite[i][1], median) for i, z, rise, median in rises
              if is_spike(z, rise, median, spike_z)]
    rule = (f"a spike is robust z > {spike_z:g} (monitor.spike_z) and more than {SPIKE_MIN_RISE:g} nats and "
            f"{SPIKE_MIN_SHARE:.0%} above the recent median")
    details = [f"{len(finite)} logged train losses (train records and health checks); each one after the first "
               f"{SPIKE_MIN_BEFORE} is compared with the median and MAD of the (up to) {SPIKE_WINDOW} before it (the "
               f"first {SPIKE_MIN_BEFORE} have too few before them to judge); {rule}."]
    if nonfinite:
        details.append(f"{len(nonfinite)} non-finite step(s) (NaN/Inf loss or gradient, never applied): steps "
                       + ", ".join(str(r["step"]) for r in nonfinite[:10])
                       + ("..." if len(nonfinite) > 10 else "") + ".")
    if not spikes and not nonfinite:
        return Verdict("smoothness", Finding(question, OK, f"smooth: no spike among {len(finite)} logged losses "
                                             f"({_largest_rise(finite, rises)}; {rule}).", details=details),
                       ["loss.png"])
    finding = []
    if spikes:
        z, step, value, median = max(spikes)
        finding.append(f"{len(spikes)} spike(s); the largest at step {step}: loss {value:.4f} against a recent median "
                       f"of {median:.4f} (z {z:.1f})")
        details.append("Spikes (step: loss, z): " + ", ".join(f"{s}: {v:.4f}, {zz:.1f}" for zz, s, v, _ in spikes[:10]))
        details.append("Usual causes: LR too high for this batch size, too short a warmup, no or loose gradient "
                       "clipping, a bad batch (check the data at those steps), fp16 overflow.")
    if nonfinite:
        finding.append(f"{len(nonfinite)} non-finite step(s)")
    return Verdict("smoothness", Finding(question, WARN, "; ".join(finding) + ".", details=details), ["loss.png"],
                   marks=[step for _, step, _, _ in spikes])


def _largest_rise(finite: list[tuple[int, float]], rises: list[tuple[int, float, float, float]]) -> str:
    """The judged point furthest above its recent median, in nats, share and z: how far from a spike
    the curve came. The sentence names what was judged: the points after the first SPIKE_MIN_BEFORE."""
    i, z, rise, median = max(rises, key=lambda r: r[2])
    if rise <= 0:
        return (f"no logged loss from step {finite[SPIKE_MIN_BEFORE][0]} on rose above the median of the (up to "
                f"{SPIKE_WINDOW}) before it")
    return (f"the largest rise above the recent median: +{rise:.4f} nats ({rise / max(abs(median), 1e-12):.1%}, "
            f"robust z {z:.1f}) at step {finite[i][0]}")
