"""Robust statistics the health monitor and the report judge metric streams by: trends one outlier
cannot fake, z-scores from the median and MAD, what a spike is, and what independent draws give."""

from __future__ import annotations

import statistics


def theil_sen_slope(values: list[float]) -> float:
    """Median of pairwise slopes: a trend that one outlier cannot fake."""
    n = len(values)
    slopes = [(values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n)]
    return statistics.median(slopes) if slopes else 0.0


def steady_rise(values: list[float], threshold: float, segments: int = 5) -> bool:
    """A rise of more than `threshold` over the window that keeps going: the median of each of
    `segments` consecutive stretches above the previous one's. One step up (a bigger batch, a cache
    filling once) is not a leak; a ramp or a staircase is."""
    if theil_sen_slope(values) * (len(values) - 1) <= threshold:
        return False
    size = len(values) // segments
    medians = [statistics.median(values[i * size:(i + 1) * size]) for i in range(segments)]
    step = threshold / (2 * (segments - 1))
    return all(b - a > step for a, b in zip(medians, medians[1:]))


SPIKE_MIN_RISE = 0.1  # a loss spike rises this many nats above the recent median
SPIKE_MIN_SHARE = 0.02  # and this share of it


def is_spike(z: float, rise: float, median: float, spike_z: float) -> bool:
    """A spike is unusual (robust z above spike_z) AND large: more than SPIKE_MIN_RISE nats and
    SPIKE_MIN_SHARE above the recent median. The z alone is not enough: on a flat curve the MAD is
    ~0, so a wobble of 1e-4 nats gets a z in the hundreds. The monitor and the report use this."""
    return z > spike_z and rise > SPIKE_MIN_RISE and rise > SPIKE_MIN_SHARE * abs(median)


def robust_z(value: float, window: list[float]) -> float:
    """How many robust standard deviations (1.4826 x MAD) `value` lies above the window's median."""
    median = statistics.median(window)
    mad = statistics.median(abs(v - median) for v in window)
    scale = 1.4826 * mad if mad > 0 else max(abs(median) * 1e-3, 1e-12)
    return (value - median) / scale


def independent_ratio(n: int) -> float:
    """E[sum of squared successive differences] / E[sum of squares] of the residuals of n independent
    equal-variance draws around their least-squares line: (n - 1)(2 - 1 / sum(t^2)) / (n - 2), with
    t centred on 0 (sum(t^2) = n(n^2 - 1) / 12). Independent draws have twice their variance between
    neighbours; neighbours that move together have less."""
    return (n - 1) * (2 - 12 / (n * (n * n - 1))) / (n - 2)


def trend_factors(first: float, mid: float, last: float) -> tuple[float, float]:
    """(growth, shrink) of a positive quantity over a window sampled at its start, middle and end:
    how many times it grew (shrank) over the window, counted only as far as its second half kept
    going the same way (the root of it there): min(last / first, (last / mid)^2) and its mirror. A
    rise or fall that levelled off halfway (a fresh model's transient) counts little."""
    if min(first, mid, last) <= 0:
        return 0.0, 0.0
    return min(last / first, (last / mid) ** 2), min(first / last, (mid / last) ** 2)
