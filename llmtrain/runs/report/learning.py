"""The questions about the loss: did the model learn (`learning`), is the curve smooth
(`smoothness`: spikes against the window before them), and does validation track training
(`overfitting`: the gap over time)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from llmtrain.core.files import (
    Kind,
)
from llmtrain.monitor.detectors import SPIKE_MIN_RISE, SPIKE_MIN_SHARE, is_spike, robust_z
from llmtrain.runs.records import Records
from llmtrain.runs.report.verdict import FAIL, NA, OK, WARN, Verdict, logged

SPIKE_WINDOW = 20  # logged points a loss value is compared with
SPIKE_MIN_BEFORE = 3  # a loss is judged once this many come before it: fewer have no spread to judge by
# A spike is also large: on a flat curve (LR 1e-8: 5.39 +- 1e-4) the MAD is ~0 and any wobble has a
# huge robust z. Noise of a healthy gpt_tiny run is ~0.05 nats; a real spike is tenths of a nat.
# Did the model learn: the thresholds (docs/report.md). A healthy 100-step gpt_tiny run ends ~12%
# below the unigram baseline with its loss still falling; none of these trips on it.
LEARNING_MIN_POINTS = 5  # fewer logged train losses: too short to judge
BARELY_MOVED = 0.05  # fell by less than this share of the way from the first loss to the baseline
NEAR_BASELINE = 0.05  # a final loss less than this share below the baseline, no longer falling
FALLING_SHARE = 0.2  # "still falling": the second half fell by this share of the whole drop so far
FALLING_MIN_NATS = 0.02  # and by more than noise
RISING_SHARE = 0.05  # "rising": the second half's trend is up by this share of the final loss
RISING_MIN_NATS = 0.1  # and by more than noise
# A byte/char model reaches the token-frequency plateau within ~10 steps and leaves it some tens of
# steps later (gpt_tiny on the default data: 3.29, 3.32, 3.18, 2.97 at steps 10-40): a shorter run
# ending on the plateau is too short to judge, not a model that cannot learn.
LEARNING_MIN_STEPS = 100

# ---------------------------------------------------------------------------------------------
# the six questions
# ---------------------------------------------------------------------------------------------


def train_losses(records: Records) -> list[tuple[int, float]]:
    """(step, loss) of every logged train loss, finite ones, in step order: the train records (every
    log_interval) and the health checks (every monitor.interval), one step's loss, not an average,
    so a spike shows as it was."""
    points = dict(zip(*records.series(Kind.HEALTH, "loss")))
    points.update(zip(*records.series(Kind.TRAIN, "loss")))
    return [(s, points[s]) for s in sorted(points) if math.isfinite(points[s])]


def _rise(finite: list[tuple[int, float]], i: int) -> tuple[float, float, float]:
    """Point i against the (up to) SPIKE_WINDOW points before it: (robust z, rise above their
    median in nats, the median)."""
    window = [v for _, v in finite[max(0, i - SPIKE_WINDOW):i]]
    median = statistics.median(window)
    return robust_z(finite[i][1], window), finite[i][1] - median, median


SMOOTHNESS_QUESTION = "Is the loss curve smooth?"  # its section holds the loss plot


def smoothness(records: Records, spike_z: float) -> Verdict:
    question = SMOOTHNESS_QUESTION
    finite = train_losses(records)
    nonfinite = logged(records, Kind.NONFINITE)
    if len(finite) < 5 and not nonfinite:
        return Verdict("smoothness", question, NA, f"only {len(finite)} logged train losses; too few to judge.",
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
                       + ", ".join(str(r["step"]) for r in nonfinite[:10]) + ("..." if len(nonfinite) > 10 else "") + ".")
    if not spikes and not nonfinite:
        return Verdict("smoothness", question, OK, f"smooth: no spike among {len(finite)} logged losses "
                       f"({_largest_rise(finite, rises)}; {rule}).", details, ["loss.png"])
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
    return Verdict("smoothness", question, WARN, "; ".join(finding) + ".", details, ["loss.png"],
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


def _slope(points: list[tuple[int, float]]) -> float:
    """Theil-Sen slope (median of the pairwise slopes) of (step, loss) points, per step: a trend one
    outlier cannot tilt."""
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points) for b in points[i + 1:] if b[0] != a[0]]
    return statistics.median(slopes) if slopes else 0.0


@dataclass
class LossCourse:
    """What the loss did over the run, the numbers `learning` judges."""

    first_step: int
    first: float  # the first logged train loss
    name: str  # what `final` is: "final val loss" or "final train loss"
    final: float
    trend: float  # the loss change over the second half of the logged losses (Theil-Sen), nats
    trend_steps: tuple[int, int]  # the steps that half spans
    last_step: int  # the last logged step
    above_best: float = 0.0  # how far the loss ends above its lowest (validation, or smoothed train losses)

    @property
    def fell(self) -> float:
        return self.first - self.final

    def still_falling(self) -> bool:
        """The curve has not levelled off: the second half still fell by a good share of the whole
        drop (a too-short run), and by more than noise."""
        return -self.trend > max(FALLING_MIN_NATS, FALLING_SHARE * max(self.fell, 0.0))

    def rising(self) -> bool:
        """The loss trends up over the second half by more than noise, and ends that far above its
        best: divergence, not a spike (nor the noise of single-step losses on a run whose validation
        loss still falls)."""
        margin = max(RISING_MIN_NATS, RISING_SHARE * abs(self.final))
        return self.trend > margin and self.above_best > margin

    def trend_text(self) -> str:
        a, b = self.trend_steps
        return f"{self.trend:+.4f} over steps {a}-{b}"


def _progress(records: Records, train: list[tuple[int, float]]) -> LossCourse:
    """The first logged loss, the final one (the last validation loss when it is recent, else the
    median of the last 3 train losses) and the trend of the second half."""
    half = train[len(train) // 2:]
    trend = _slope(half) * (half[-1][0] - half[0][0])
    val = records.series(Kind.EVAL, "val_loss")
    if val[0] and val[0][-1] >= half[0][0]:
        name, final = "final val loss", val[1][-1]
    else:
        name, final = "final train loss", statistics.median(v for _, v in train[-3:])
    # How far the loss ends above its best, within one kind of loss: the validation losses when there
    # are two or more, else medians of 3 logged train losses (a single train step's loss runs well
    # below the validation loss on a good batch, so the two kinds do not compare).
    finite_val = [v for v in val[1] if math.isfinite(v)]
    if len(finite_val) >= 2:
        above_best = finite_val[-1] - min(finite_val)
    else:
        medians = [statistics.median(v for _, v in train[i:i + 3]) for i in range(max(1, len(train) - 2))]
        above_best = medians[-1] - min(medians)
    return LossCourse(train[0][0], train[0][1], name, final, trend, (half[0][0], half[-1][0]),
                    max(train[-1][0], val[0][-1] if val[0] else 0), above_best)


def learning(records: Records, baseline: float | None) -> Verdict:
    """Did the loss fall, and below the unigram baseline (the loss of a model that ignores
    context)? Judged on the final loss, how far it moved from the first, and the trend. No plot of
    its own: the loss plot, with the baseline drawn, opens the smoothness section right after it."""
    question = "Did the model learn?"
    train = train_losses(records)
    if len(train) < LEARNING_MIN_POINTS:
        return Verdict("learning", question, NA, f"too short to judge: only {len(train)} logged train losses.")
    p = _progress(records, train)
    details = [f"first logged train loss {p.first:.4f} (step {p.first_step}); {p.name} {p.final:.4f}; "
               f"train-loss trend {p.trend_text()} (the Theil-Sen slope of the second half of the logged losses, "
               "times its span: a trend one outlier cannot tilt)."]
    if baseline is not None:
        details.append(f"unigram baseline {baseline:.4f} nats/token: the loss of a model that predicts each token "
                       "from the token frequencies alone.")
    if not math.isfinite(p.final):
        return Verdict("learning", question, FAIL, f"diverged: the {p.name} is {p.final}.", details)
    status, finding = _learning_judgement(p, baseline)
    if status in (WARN, FAIL):
        details.append("Usual causes: LR far too low or too high, a schedule at its floor, broken initialization or "
                       "residual path, frozen blocks; the alarms and their causes below say which fits this run.")
    return Verdict("learning", question, status, finding, details)


def _learning_judgement(p: LossCourse, baseline: float | None) -> tuple[str, str]:
    if p.rising():
        verdict = f"the loss is rising: the train loss trends up, {p.trend_text()} (a trend, not a single spike)"
        if baseline is None:
            return WARN, verdict + "."
        if p.final >= baseline:
            return FAIL, f"{verdict}; {_against(p, baseline)}: the model learned nothing beyond token frequencies."
        return WARN, f"{verdict}; {_against(p, baseline)}."
    if baseline is None:
        if p.fell < BARELY_MOVED * abs(p.first) and not p.still_falling():
            return WARN, (f"barely moved: the loss went from {p.first:.4f} (step {p.first_step}) to {p.final:.4f}; "
                          "no unigram baseline recorded to compare with.")
        return OK, (f"the loss fell from {p.first:.4f} (step {p.first_step}) to {p.final:.4f}; no unigram baseline "
                    "recorded to compare with.")
    # The way from the first loss down to the baseline; when the first logged loss is already at the
    # baseline (logged after the model learned the frequencies) "barely moved" means nothing.
    span = p.first - baseline
    if span > NEAR_BASELINE * baseline and p.fell < BARELY_MOVED * span and not p.still_falling():
        moved = (f"barely moved from {p.first:.4f} at step {p.first_step} ({p.fell / span:.0%} of the way to the "
                 "baseline)" if p.fell > 0 else f"did not fall from {p.first:.4f} at step {p.first_step}")
        return FAIL, (f"not learning: {_against(p, baseline)}, and the loss {moved}"
                      + (": the model learned nothing beyond token frequencies." if p.final >= baseline else "."))
    falling = p.still_falling()
    if p.final >= baseline:
        if p.last_step < LEARNING_MIN_STEPS:
            why = (f"still falling ({p.trend_text()})" if falling else f"only {p.last_step} steps: a model leaves the "
                   "token-frequency plateau after some tens of steps")
            return NA, f"too short to judge: {_against(p, baseline)}, {why}; a longer run will tell."
        if falling:
            return WARN, (f"learning slowly: {_against(p, baseline)} after {p.last_step} steps, though still falling "
                          f"({p.trend_text()}): an LR far too low or a long warmup; a longer run may get there.")
        return FAIL, (f"not learning: {_against(p, baseline)}: the model learned nothing beyond token frequencies "
                      f"(train-loss trend {p.trend_text()}).")
    if p.final > (1 - NEAR_BASELINE) * baseline and not falling:  # barely below the baseline, and flat
        if p.last_step < LEARNING_MIN_STEPS:
            return NA, (f"too short to judge: {_against(p, baseline)} after only {p.last_step} steps; a model leaves "
                        "the token-frequency plateau after some tens of steps.")
        return WARN, (f"barely learning: {_against(p, baseline)} and no longer falling ({p.trend_text()}): the model "
                      "learned little beyond token frequencies.")
    return OK, (f"learning: {_against(p, baseline)}; the loss is {'still falling' if falling else 'levelling off'} "
                f"({p.trend_text()}).")


def _against(p: LossCourse, baseline: float) -> str:
    """'final val loss 5.3600 is 65% above the unigram baseline 3.2492'."""
    share = (p.final - baseline) / baseline
    where = "above" if share >= 0 else "below"
    percent = f"{abs(share):.1%}" if abs(share) < 0.1 else f"{abs(share):.0%}"  # 2.3%, not 2%, near the baseline
    return f"{p.name} {p.final:.4f} is {percent} {where} the unigram baseline {baseline:.4f}"


def overfitting(records: Records) -> Verdict:
    question = "Does validation track training?"
    val = [(s, v) for s, v in zip(*records.series(Kind.EVAL, "val_loss")) if math.isfinite(v)]
    train = [(s, v) for s, v in zip(*records.series(Kind.TRAIN, "loss")) if math.isfinite(v)]
    if not val or not train:
        return Verdict("overfitting", question, NA, "no validation loss recorded (eval_interval=0?) or no train loss.")
    gaps = []
    for step, v in val:
        near = [t for s, t in train if s <= step][-3:] or [train[0][1]]  # the train loss around that step
        gaps.append((step, v - statistics.mean(near)))
    # The loss plot, validation included, is drawn once: under the smoothness question, just before.
    details = ["Gap = validation loss - mean of the last (up to 3) logged train losses at that step: "
               + ", ".join(f"step {s}: {g:+.4f}" for s, g in _thin(gaps, 8)) + ".",
               f"The loss plot (train and validation) is under \"{SMOOTHNESS_QUESTION}\"."]
    best_step, best = min(val, key=lambda sv: sv[1])
    last_step, last = val[-1]
    train_at_best = [t for s, t in train if s <= best_step][-1:] or [train[0][1]]
    train_last = train[-1][1]
    rose = last - best
    if last_step > best_step and rose > max(0.01, 0.02 * abs(best)) and train_last < train_at_best[0]:
        return Verdict(
            "overfitting", question, WARN,
            f"overfitting from about step {best_step}: validation rose from {best:.4f} to {last:.4f} (step {last_step}) "
            f"while the train loss fell from {train_at_best[0]:.4f} to {train_last:.4f}.",
            details + ["Options: stop at the best step (its checkpoint is kept with checkpoint.keep_best), more data "
                       "or fewer epochs, dropout (model.dropout), weight decay (optim.weight_decay), a smaller model."],
        )
    return Verdict("overfitting", question, OK,
                   f"validation tracks training: {_gap_text(gaps)}; best validation loss {best:.4f} at step {best_step}.",
                   details)


def _gap_text(gaps: list[tuple[int, float]]) -> str:
    """The first and the last gap; once when they are the same evaluation (a single one)."""
    (first_step, first), (last_step, last) = gaps[0], gaps[-1]
    if first_step == last_step:
        return f"gap {last:+.4f} at step {last_step}"
    return f"gap {first:+.4f} at step {first_step}, {last:+.4f} at step {last_step}"


def _thin(points: list, n: int) -> list:
    if len(points) <= n:
        return points
    stride = (len(points) - 1) / (n - 1)
    return [points[round(i * stride)] for i in range(n)]
