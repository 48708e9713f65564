"""Does validation track training? The validation-train gap over the run, and where validation
turns up if it does (`overfitting`)."""

from __future__ import annotations

import math
import statistics

from llmtrain.core.files import Kind
from llmtrain.core.findings import Finding
from llmtrain.monitor.overfit import widening_gap
from llmtrain.runs.records import Records
from llmtrain.runs.report.smoothness import SMOOTHNESS_QUESTION
from llmtrain.runs.report.verdict import NA, OK, WARN, Verdict


def overfitting(records: Records) -> Verdict:
    """The validation-train gap at each evaluation, and whether validation turned up while the train
    loss kept falling."""
    question = "Does validation track training?"
    val = [(s, v) for s, v in zip(*records.series(Kind.EVAL, "val_loss")) if math.isfinite(v)]
    train = [(s, v) for s, v in zip(*records.series(Kind.TRAIN, "loss")) if math.isfinite(v)]
    if not val or not train:
        return Verdict("overfitting", Finding(question, NA,
                                              "no validation loss recorded (eval_interval=0?) or no train loss."))
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
        return Verdict("overfitting", Finding(
            question, WARN,
            f"overfitting from about step {best_step}: validation rose from {best:.4f} to {last:.4f} "
            f"(step {last_step}) while the train loss fell from {train_at_best[0]:.4f} to {train_last:.4f}.",
            details=details + ["Options: stop at the best step (its checkpoint is kept with checkpoint.keep_best), "
                               "more data or fewer epochs, dropout (model.dropout), weight decay (optim.weight_decay), "
                               "a smaller model."],
        ))
    if widening := _widening_gap(val, gaps):
        return Verdict("overfitting", Finding(question, WARN, widening, details=details + [
            "Options: stop at the best step (checkpoint.keep_best keeps its checkpoint), more data or fewer "
            "passes over it, dropout (model.dropout), weight decay (optim.weight_decay), a smaller model."]))
    return Verdict("overfitting", Finding(
        question, OK,
        f"validation tracks training: {_gap_text(gaps)}; best validation loss {best:.4f} at step {best_step}.",
        details=details))


MIN_TRAIN_FALL = 0.05  # nats: smaller falls are within the noise of a few logged train losses


def _widening_gap(val: list[tuple[int, float]], gaps: list[tuple[int, float]]) -> str | None:
    """The monitor's rule (monitor/overfit.py) on the whole run's evaluations: what was seen, or None."""
    seen = widening_gap(val, gaps, min_fall=MIN_TRAIN_FALL)
    if seen is None:
        return None
    return (f"the gap is widening: {seen.text()}: the model memorizes its training data more than it learns "
            "what carries over.")


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
