"""Did the model learn? The final loss against the unigram baseline (the loss of a model that
ignores context), how far it moved from the first logged loss, and the trend (`learning`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from llmtrain.core.files import Kind
from llmtrain.core.findings import Finding, Status
from llmtrain.runs.records import Records
from llmtrain.runs.report.verdict import FAIL, NA, OK, WARN, Verdict, train_losses

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
        return Verdict("learning", Finding(question, NA, f"too short to judge: only {len(train)} logged train losses."))
    p = _progress(records, train)
    details = [f"first logged train loss {p.first:.4f} (step {p.first_step}); {p.name} {p.final:.4f}; "
               f"train-loss trend {p.trend_text()} (the Theil-Sen slope of the second half of the logged losses, "
               "times its span: a trend one outlier cannot tilt)."]
    if baseline is not None:
        details.append(f"unigram baseline {baseline:.4f} nats/token: the loss of a model that predicts each token "
                       "from the token frequencies alone.")
    if not math.isfinite(p.final):
        return Verdict("learning", Finding(question, FAIL, f"diverged: the {p.name} is {p.final}.", details=details))
    status, finding = _learning_judgement(p, baseline)
    if status in (WARN, FAIL):
        details.append("Usual causes: LR far too low or too high, a schedule at its floor, broken initialization or "
                       "residual path, frozen blocks; the alarms and their causes below say which fits this run.")
    return Verdict("learning", Finding(question, status, finding, details=details))


def _learning_judgement(p: LossCourse, baseline: float | None) -> tuple[Status, str]:
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
