"""`llmtrain report <run dir>`: the post-run review of one run, with plots.

Seven questions, each answered with a verdict (ok / warn / fail / n/a) and the numbers behind it:

    learning      did the loss fall, and below the unigram baseline (the loss of a model that
                  ignores context)? From the final loss, its distance to the first one and the trend
    smoothness    spikes in the train loss (robust z-score against the preceding window, and a rise
                  large in nats and in share: a flat curve is flat)
    overfitting   the validation-train gap over time, and where validation turns up if it does
    inference     the final weights reloaded: eval mode twice identical, equal to train mode with
                  dropout off, a few sampled tokens
    memory        peak memory against what the device has
    step time     data / forward / backward / optimizer / other on the timed steps, the
                  bottleneck, tokens/s and MFU
    alarms        the health alarms raised (with their most likely cause when the record ranks
                  causes) and the actions taken, non-finite steps, failed saves

The section over the health plots carries the monitor's verdict too (ok only without alarms), and
the loss plot draws the unigram baseline and marks the steps where alarms fired. An Evaluation
section (information, no verdict) lists the evaluation tasks' results: `llmtrain eval`'s eval.json
in the run dir, and the eval.tasks evaluated during training (eval_tasks.png: one panel per task).

Everything comes from the run dir, so a run that was interrupted or crashed gets its report too:
the logs through runs/records.py (the run as it finally went: a resume's redone steps replace the
first take), the headline facts from compare's `summarize`, the weights through runs/artifacts.py,
config.yaml and tokenizer.json. Writes report/*.png, report.md (which links the PNGs) and
report.html (self-contained: the PNGs are inside it).

torch, matplotlib, the model and the data are imported inside the functions that need them, so
`llmtrain report --no-inference` never loads torch.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from llmtrain.config.saved import read_saved
from llmtrain.config.schema import REPORT_FULL_AFTER_S, DataSource
from llmtrain.errors import UserError
from llmtrain.health.detectors import SPIKE_MIN_RISE, SPIKE_MIN_SHARE, is_spike, robust_z
from llmtrain.preflight.parameters import ParameterCounts
from llmtrain.runs.compare import recorded_overrides, summarize
from llmtrain.runs.files import (
    CONFIG,
    EVAL_RESULTS,
    EVENTS,
    METRICS,
    REPORT_HTML,
    REPORT_MD,
    TOKENIZER,
    TRAINER_STATE,
    Kind,
)
from llmtrain.runs.leftout import Reasons, enough
from llmtrain.runs.records import Record, Records, number, read_records
from llmtrain.sinks import TASK_COUNTS, TASK_HEADLINE, is_number, scored_text, task_metrics_text

OK, WARN, FAIL, NA = "ok", "warn", "fail", "n/a"
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
MEMORY_HEADROOM_WARN = 0.8  # peak above this share of the device's memory leaves little headroom
PHASE_NAMES = ("data", "forward", "backward", "optimizer", "other")


@dataclass
class Verdict:
    key: str
    question: str
    status: str
    finding: str
    details: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # PNG names under report/
    marks: list[int] = field(default_factory=list)  # steps to mark on its plot (the spikes)


@dataclass
class Evaluation:
    """The Evaluation section: what the evaluation tasks measured, as information (no verdict: a
    task's score has no threshold that holds for every model and data set)."""

    summary: str  # one line, for the terminal
    saved: str | None = None  # what eval.json is (or why it cannot be read); its tasks are the rows
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # eval.json: (task, kind, metrics, scored)
    training: str | None = None  # the tasks evaluated during training: their latest figures; the plots
    plots: list[str] = field(default_factory=list)  # eval_tasks.png: the tasks over the run's steps


@dataclass
class Report:
    run_dir: Path
    title: str
    facts: list[tuple[str, str]]
    verdicts: list[Verdict]
    plots: dict[str, Path]
    markdown: Path | None = None
    html: Path | None = None
    evaluation: Evaluation | None = None  # eval.tasks results: during training, and `llmtrain eval`'s eval.json
    left_out: dict[str, str] = field(default_factory=dict)  # plot name -> the line that says why it was not drawn
    seconds: float | None = None  # the run's wall time (run_seconds), for report.console=auto


# ---------------------------------------------------------------------------------------------
# reading the run
# ---------------------------------------------------------------------------------------------


def unigram_baseline(records: Records, cfg: Any) -> float | None:
    """The loss to beat, the unigram entropy of the train split (nats/token): from the start record
    when it carries it, else from the prepared data's meta in the cache (never prepared here);
    None when neither has it."""
    start = records.last(Kind.START) or {}
    for key in ("unigram_entropy", "unigram_entropy_nats"):
        if _positive(start.get(key)):
            return float(start[key])
    if cfg is None:
        return None
    from llmtrain.data.cache import cached_meta

    try:
        meta = cached_meta(cfg.data) or {}
    except Exception:  # noqa: BLE001 - a moved corpus, an unloadable dataset: no baseline, the rest stands
        return None
    return float(meta["unigram_entropy_nats"]) if _positive(meta.get("unigram_entropy_nats")) else None


def _positive(value: Any) -> bool:
    try:
        return value is not None and math.isfinite(float(value)) and float(value) > 0
    except (TypeError, ValueError):
        return False


def _load_config(run_dir: Path) -> Any:
    """The run's config (read within bounds: config/saved.py); None when it is missing or unusable."""
    path = run_dir / CONFIG
    if not os.path.lexists(path):
        return None
    try:
        return read_saved(path)
    except UserError:
        return None


# ---------------------------------------------------------------------------------------------
# the six questions
# ---------------------------------------------------------------------------------------------


def _train_losses(records: Records) -> list[tuple[int, float]]:
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
    finite = _train_losses(records)
    nonfinite = _logged(records, Kind.NONFINITE)
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
class Progress:
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


def _progress(records: Records, train: list[tuple[int, float]]) -> Progress:
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
    return Progress(train[0][0], train[0][1], name, final, trend, (half[0][0], half[-1][0]),
                    max(train[-1][0], val[0][-1] if val[0] else 0), above_best)


def learning(records: Records, baseline: float | None) -> Verdict:
    """Did the loss fall, and below the unigram baseline (the loss of a model that ignores
    context)? Judged on the final loss, how far it moved from the first, and the trend. No plot of
    its own: the loss plot, with the baseline drawn, opens the smoothness section right after it."""
    question = "Did the model learn?"
    train = _train_losses(records)
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


def _learning_judgement(p: Progress, baseline: float | None) -> tuple[str, str]:
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


def _against(p: Progress, baseline: float) -> str:
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


def inference(run_dir: Path, cfg: Any) -> Verdict:
    """Reload the final weights; eval twice (identical), train mode with dropout off (equal to eval),
    a few sampled tokens."""
    question = "Does inference behave like training?"
    if cfg is None:
        return Verdict("inference", question, NA, "config.yaml is missing or unreadable; cannot rebuild the model.")
    import torch

    from llmtrain.data.cache import cached_data
    from llmtrain.model import GPT
    from llmtrain.runs.artifacts import newest_weights

    try:  # weights that are not exactly config.yaml's model are passed over: nothing of a forged size is built
        state = newest_weights(run_dir, warn=lambda message: None, model=cfg.model)
        data = cached_data(cfg.data)
    except Exception as err:  # noqa: BLE001 - unreadable weights or data: this question has no answer, the others do
        return Verdict("inference", question, NA, f"not checked: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
                       if str(err) else f"not checked: {type(err).__name__}")
    if data is None:  # a report never tokenizes a corpus: that is `llmtrain prepare`'s job
        return Verdict("inference", question, NA,
                       "not checked: the run's prepared data is not in the cache (deleted, or the corpus changed "
                       "since); `llmtrain prepare` with the run's data settings brings it back.")
    vocab = state["wte.weight"].shape[0]
    model = GPT(cfg.model, vocab)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:  # e.g. an old model.pt left in a reused run dir
        first = (str(err).strip().splitlines()[1:2] or [str(err)])[0].strip()[:300]
        return Verdict("inference", question, NA, f"not checked: the weights do not fit config.yaml ({first})")
    tokens = data.tokens("val")
    if len(tokens) < 3:
        tokens = data.tokens("train")
    length = min(cfg.model.block_size, len(tokens) - 1, 128)
    count = max(1, min(4, (len(tokens) - 1) // length))
    x = torch.stack([torch.from_numpy(tokens[i * length:(i + 1) * length].astype("int64")) for i in range(count)])
    with torch.no_grad():
        model.eval()
        first, second = model(x), model(x)
        no_dropout = GPT(_without_dropout(cfg.model), vocab)
        no_dropout.load_state_dict(state)
        no_dropout.train()
        train_mode = no_dropout(x)
    identical = torch.equal(first, second)
    difference = (first - train_mode).abs().max().item()
    text = _sample_text(run_dir, model, [int(t) for t in x[0, :32]], cfg)
    details = [f"{count} validation sequence(s) of {length} tokens through the reloaded final weights.",
               f"eval mode twice: {'identical' if identical else 'DIFFERENT'} logits.",
               f"eval mode vs train mode with dropout off: largest logit difference {difference:.2e}.",
               f"model.dropout={cfg.model.dropout:g} (train mode with dropout on is stochastic by design)."]
    if text:
        details.append(f"sampled continuation (temperature 1): {text}")
    if not identical or difference > 1e-4:
        what = "eval mode is not deterministic" if not identical else "train mode (dropout off) differs from eval mode"
        return Verdict("inference", question, WARN,
                       f"{what} (largest logit difference {difference:.2e}): a layer behaves differently by mode "
                       "beyond dropout (e.g. a norm with running statistics, a mode-dependent branch).", details)
    return Verdict("inference", question, OK,
                   f"yes: the reloaded weights give identical logits in eval mode twice, and train mode with dropout off "
                   f"matches eval mode (largest difference {difference:.1e}).", details)


def _without_dropout(model_cfg: Any) -> Any:
    return dataclasses.replace(model_cfg, dropout=0.0)


def _sample_text(run_dir: Path, model: Any, prompt: list[int], cfg: Any) -> str:
    """A validation prompt and 48 sampled tokens (temperature 1, seed 0), decoded; "" without a
    readable tokenizer.json."""
    import torch

    from llmtrain.data.tokenizers import load_tokenizer
    from llmtrain.runs.sample import generate

    try:
        tokenizer = load_tokenizer(run_dir / TOKENIZER)
    except (OSError, ValueError, KeyError, UserError):
        return ""
    continuation = generate(model, prompt, 48, temperature=1.0, generator=torch.Generator().manual_seed(0),
                            context=cfg.model.block_size, vocab_limit=tokenizer.vocab_size, stop_id=tokenizer.eos_id)
    text = f"{tokenizer.decode(prompt)!r} -> {tokenizer.decode(continuation)!r}"
    return text[:400]


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


def _logged(records: Records, kind: str) -> list[Record]:
    """Each record of a kind the monitor may write to both logs, once: events.jsonl's when it has
    any (the monitor's own log), else metrics.jsonl's (older runs, monitor off)."""
    return records.written(kind, EVENTS) or records.written(kind, METRICS)


def raised_alarms(records: Records) -> list[Record]:
    """The alarm records in the order raised, one per (alarm, step): a resume that redoes a step
    may log its alarm twice."""
    seen: set[tuple[str, Any]] = set()
    raised = []
    for alarm in _logged(records, Kind.ALARM):
        key = (str(alarm.get("alarm", "?")), alarm.get("step"))
        if key not in seen:
            seen.add(key)
            raised.append(alarm)
    return raised


def top_cause(alarm: Record) -> dict | None:
    """The alarm's most likely cause (the first of its ranked `causes`); None for a record without
    them (runs from before the monitor ranked causes)."""
    causes = alarm.get("causes")
    if isinstance(causes, list) and causes and isinstance(causes[0], dict):
        return causes[0]
    return None


def cause_text(cause: dict, evidence: bool = True) -> str:
    """'Learning rate too high (LR 0.1 is 11x ...; fix: optim.lr=0.003)'; the title alone without
    `evidence`."""
    title = str(cause.get("title") or cause.get("cause") or "unnamed cause")
    extra = [str(cause["evidence"])] if evidence and cause.get("evidence") else []
    extra += [f"fix: {cause['fix']}"] if evidence and cause.get("fix") else []
    return title + (f" ({'; '.join(extra)})" if extra else "")


def _alarm_line(alarm: Record, action: str) -> str:
    """One alarm as the details list it: step, name, severity, the band it left, the action, the
    top-ranked cause when the record has one."""
    line = f"step {alarm.get('step')}: {alarm.get('alarm', '?')} ({alarm.get('severity', '?')})"
    if alarm.get("metric") is not None or alarm.get("band") is not None:
        line += f": {alarm.get('metric', '?')} left the band {alarm.get('band', '?')}"
    line += f" -> {action}"
    cause = top_cause(alarm)
    return line + (f"; most likely: {cause_text(cause)}" if cause else "")


def _steps_text(steps: list[Any]) -> str:
    shown = ", ".join(str(s) for s in steps[:5]) + (", ..." if len(steps) > 5 else "")
    return f"step {shown}" if len(steps) == 1 else f"steps {shown}"


def _alarm_summary(raised: list[Record]) -> list[str]:
    """Per alarm name, in the order first raised: 'grad_norm_high at step 30 (most likely: Learning
    rate too high)'."""
    by_name: dict[str, list[Record]] = {}
    for alarm in raised:
        by_name.setdefault(str(alarm.get("alarm", "?")), []).append(alarm)
    parts = []
    for name, records in by_name.items():
        cause = next((c for c in map(top_cause, records) if c), None)
        parts.append(f"{name} at {_steps_text([r.get('step') for r in records])}"
                     + (f" (most likely: {cause_text(cause, evidence=False)})" if cause else ""))
    return parts


def health_quantities(records: Records, plots: list[str]) -> Verdict:
    """The section over the health plots: its verdict is the monitor's, ok only when no alarm fired
    and no step was non-finite."""
    question = "The health quantities over the run"
    raised, nonfinite = raised_alarms(records), _logged(records, Kind.NONFINITE)
    what = ("learning rate, gradient norm, parameter norm, block activations (the monitor's bands are in "
            "docs/monitoring.md)")
    if raised or nonfinite:
        parts = [f"{len(raised)} alarm(s) fired: " + "; ".join(_alarm_summary(raised))] if raised else []
        if nonfinite:
            parts.append(f"{len(nonfinite)} non-finite step(s) at {_steps_text([r.get('step') for r in nonfinite])}")
        # The evidence and the actions are listed once, under the alarms question.
        return Verdict("curves", question, WARN, "; ".join(parts)
                       + f" (evidence and actions under the alarms question). The plots: {what}.", plots=plots)
    if not records.of(Kind.HEALTH):
        return Verdict("curves", question, NA, f"no health checks recorded (monitor off?); the plots: {what}.", plots=plots)
    return Verdict("curves", question, OK, f"every health check stayed in its band; the plots: {what}.", plots=plots)


def alarms(records: Records) -> Verdict:
    question = "Which alarms were raised, and what was done?"
    raised = raised_alarms(records)
    actions = _logged(records, Kind.ACTION)
    rollbacks, save_errors = _logged(records, Kind.ROLLBACK), _logged(records, Kind.CHECKPOINT_ERROR)
    nonfinite = _logged(records, Kind.NONFINITE)
    details = []
    for alarm in raised:
        taken = [a for a in actions if a.get("alarm") == alarm.get("alarm") and a.get("step") == alarm.get("step")]
        action = "; ".join(f"{a.get('action')}: {a.get('detail')}" for a in taken) or alarm.get("action") or "warn"
        details.append(_alarm_line(alarm, str(action)))
    for record in nonfinite:
        details.append(f"step {record.get('step')}: non-finite loss/gradient -> {record.get('action')}")
    for record in rollbacks:
        details.append(f"step {record.get('step')}: rolled back to step {record.get('to_step')} "
                       f"(LR scale {record.get('lr_scale')})")
    for record in save_errors:
        details.append(f"step {record.get('step')}: checkpoint save failed: {record.get('error')}")
    if not (raised or nonfinite or rollbacks or save_errors):
        return Verdict("alarms", question, OK, "none: every health check stayed in its band.")
    counts: dict[str, int] = {}
    for alarm in raised:
        counts[alarm.get("alarm", "?")] = counts.get(alarm.get("alarm", "?"), 0) + 1
    parts = [f"{name} x{n}" if n > 1 else name for name, n in counts.items()]
    if nonfinite:
        parts.append(f"{len(nonfinite)} non-finite step(s)")
    if rollbacks:
        parts.append(f"{len(rollbacks)} rollback(s)")
    if save_errors:
        parts.append(f"{len(save_errors)} failed save(s)")
    first = next(((a, c) for a in raised if (c := top_cause(a))), None)
    if first:
        parts.append(f"most likely cause of {first[0].get('alarm')} (step {first[0].get('step')}): "
                     f"{cause_text(first[1], evidence=False)}")
    return Verdict("alarms", question, WARN, "; ".join(parts) + " (details below and in events.jsonl).", details)


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------


def _plot_series(ax: Any, series: tuple[list[int], list[float]], label: str) -> bool:
    """Draw one (steps, values) curve; False when there is nothing to draw."""
    if not series[0]:
        return False
    ax.plot(*series, label=label or None)
    return True


def alarm_marks(records: Records) -> dict[str, list[int]]:
    """The steps the loss plot marks, per alarm name in the order first raised (any name the
    monitor writes), and the non-finite steps."""
    marks: dict[str, list[int]] = {}
    for alarm in raised_alarms(records):
        if alarm.get("step") is not None:
            marks.setdefault(str(alarm.get("alarm", "?")), []).append(int(alarm["step"]))
    nonfinite = [int(r["step"]) for r in _logged(records, Kind.NONFINITE) if r.get("step") is not None]
    if nonfinite:
        marks["non-finite step"] = nonfinite
    return marks


def draw_loss(ax: Any, records: Records, spikes: list[int], baseline: float | None,
              marks: dict[str, list[int]]) -> None:
    """The loss plot: train and validation loss, the spikes, the unigram baseline (dashed) and a
    vertical line per alarm step, one colour and one legend entry per alarm name."""
    steps, losses = records.series(Kind.TRAIN, "loss")
    val_steps, val = records.series(Kind.EVAL, "val_loss")
    ax.plot(steps, losses, label="train", lw=1, color="C0")
    if val:
        ax.plot(val_steps, val, "o-", label="validation", ms=3, color="C1")
    spike_points = [(s, v) for s, v in _train_losses(records) if s in spikes]  # health checks' losses too
    if spike_points:
        ax.plot(*zip(*spike_points), "rx", ms=8, label="spike")
    if baseline is not None:
        ax.axhline(baseline, ls="--", lw=1, color="grey", label=f"unigram baseline {baseline:.4f}")
    for i, (name, at) in enumerate(marks.items()):
        colour = f"C{(i + 2) % 10}"  # C0 and C1 are train and validation
        for j, step in enumerate(at):
            ax.axvline(step, ls=":", lw=1.2, color=colour, label=f"{name} ({_steps_text(at)})" if j == 0 else None)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="Loss")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _plots(records: Records, folder: Path, spikes: list[int], baseline: float | None,
           reasons: Reasons) -> tuple[dict[str, Path], dict[str, str]]:
    """Draw the plots that have something to show (a curve of CURVE_MIN_POINTS points or more, a
    timed step); the others are left out, each with its one-line reason, and a PNG of that name
    from an earlier report is removed (it would show the run as it was then). Returns (the PNGs
    written, by name; the reasons, by name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    left_out: dict[str, str] = {}

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=90)
        plt.close(fig)
        written[name] = folder / name

    def count(kind: str, key: str) -> int:
        return len(records.series(kind, key)[0])

    train_losses, val_losses = count(Kind.TRAIN, "loss"), count(Kind.EVAL, "val_loss")
    if enough(train_losses, val_losses):
        fig, ax = plt.subplots(figsize=(8, 4))
        draw_loss(ax, records, spikes, baseline, alarm_marks(records))
        save(fig, "loss.png")
    else:
        left_out["loss.png"] = reasons.logged("loss.png", train_losses, "train loss", "train losses")

    sched = records.series(Kind.HEALTH, "lr_schedule")
    if enough(count(Kind.TRAIN, "lr"), len(sched[0])):
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot(*records.series(Kind.TRAIN, "lr"), label="applied")
        if sched[0]:
            ax.plot(*sched, "--", label="schedule (health checks)")
        ax.set(xlabel="step", ylabel="learning rate", title="Learning rate")
        ax.legend()
        save(fig, "lr.png")
    else:
        left_out["lr.png"] = reasons.logged("lr.png", count(Kind.TRAIN, "lr"), "learning rate")

    g_steps, g = records.series(Kind.TRAIN, "grad_norm")
    finite = [(s, v) for s, v in zip(g_steps, g) if math.isfinite(v) and v > 0]
    if enough(len(finite)):
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.semilogy(*zip(*finite), lw=1)
        ax.axhspan(0.1, 10, color="green", alpha=0.08, label="healthy band (0.1-10)")
        ax.legend()
        ax.set(xlabel="step", ylabel="gradient norm (pre-clip)", title="Gradient norm")
        save(fig, "grad_norm.png")
    else:
        left_out["grad_norm.png"] = reasons.logged("grad_norm.png", len(finite), "finite gradient norm")

    def lines(name: str, title: str, ylabel: str, curves: list[tuple[str, str, str]]) -> bool:
        """One plot of record fields against the step: (kind, key, legend label) per curve; False
        (nothing drawn) when no curve has enough points."""
        if not enough(*(count(kind, key) for kind, key, _ in curves)):
            return False
        fig, ax = plt.subplots(figsize=(8, 3))
        drawn = [label for kind, key, label in curves if _plot_series(ax, records.series(kind, key), label)]
        if any(drawn):  # named curves (memory's) get a legend
            ax.legend()
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        save(fig, name)
        return True

    if not lines("param_norm.png", "Parameter norm", "parameter norm", [(Kind.HEALTH, "param_norm", "")]):
        left_out["param_norm.png"] = reasons.monitored("param_norm.png", count(Kind.HEALTH, "param_norm"),
                                                       "parameter norm")

    samples = [r for r in records.of(Kind.HEALTH) if r.get("activation_mean")]
    if enough(len(samples)):
        fig, (ax_mean, ax_var) = plt.subplots(1, 2, figsize=(10, 3.5))
        blocks = len(samples[0]["activation_mean"])
        for b in range(blocks):
            steps_b = [r["step"] for r in samples]
            ax_mean.plot(steps_b, [number(r["activation_mean"][b]) for r in samples], label=f"block {b}")
            ax_var.plot(steps_b, [number(r["activation_var"][b]) for r in samples], label=f"block {b}")
        if blocks <= 12:
            ax_var.legend(fontsize=7)
        ax_mean.set(xlabel="step", ylabel="mean", title="Block output mean")
        ax_var.set(xlabel="step", ylabel="variance", title="Block output variance")
        save(fig, "activations.png")
    else:
        left_out["activations.png"] = reasons.activations("activations.png", [int(r["step"]) for r in samples])

    memory_curves = [(Kind.HEALTH, "rss_mb", "process RSS"), (Kind.HEALTH, "cuda_allocated_mb", "GPU allocated"),
                     (Kind.HEALTH, "cuda_peak_mb", "GPU peak")]
    if not lines("memory.png", "Memory", "MB", memory_curves):
        left_out["memory.png"] = reasons.monitored(
            "memory.png", max(count(kind, key) for kind, key, _ in memory_curves), "memory")
    if not lines("throughput.png", "Throughput", "tokens/s", [(Kind.TRAIN, "tokens_per_s", "")]):
        left_out["throughput.png"] = reasons.logged("throughput.png", count(Kind.TRAIN, "tokens_per_s"),
                                                    "throughput figure")

    timings = records.of(Kind.TIMING)
    if timings:  # one bar of medians: a single timed step is something to show
        fig, ax = plt.subplots(figsize=(8, 2.6))
        left = 0.0
        for phase in PHASE_NAMES:
            value = statistics.median(number(t[f"{phase}_s"]) for t in timings) * 1000
            ax.barh([0], [value], left=left, label=f"{phase} {value:,.1f} ms")
            left += value
        ax.set_yticks([])
        ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
        ax.set(xlabel="ms per step (median of the timed steps)", title="Time per step")
        save(fig, "step_time.png")
    else:
        left_out["step_time.png"] = reasons.timed("step_time.png")
    _remove_stale(folder, left_out)
    return written, left_out


def _remove_stale(folder: Path, left_out: dict[str, str]) -> None:
    """An earlier report's PNG of a plot left out now (a report of the run while it was longer, or
    of a run dir reused): it would be read as this run's."""
    for name in left_out:
        (folder / name).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# evaluation tasks
# ---------------------------------------------------------------------------------------------

TaskPoints = dict[str, list[Record]]  # task entry -> its eval_task records, one per step, in step order


def eval_task_points(records: Records) -> TaskPoints:
    """The eval_task records per task, the last take of each step (a resume redoes the steps after
    its checkpoint), in step order; tasks in the order first evaluated."""
    by_task: dict[str, dict[int, Record]] = {}
    for record in records.of(Kind.EVAL_TASK):
        if record.get("task") is not None and record.get("step") is not None:
            by_task.setdefault(str(record["task"]), {})[int(record["step"])] = record
    return {task: [steps[s] for s in sorted(steps)] for task, steps in by_task.items()}


def main_metrics(record: Record) -> list[str]:
    """What a task's panel plots: acc and acc_norm (multiple choice), bits per byte, else the loss
    (perplexity), else a harness task's first own metric."""
    if "acc" in record:
        return [key for key in ("acc", "acc_norm") if key in record]
    for key in ("bits_per_byte", "loss"):
        if key in record:
            return [key]
    skip = {"kind", "step", "task", "seconds", *TASK_COUNTS}
    other = next((k for k, v in record.items() if k not in skip and "stderr" not in k and is_number(v)), None)
    return [other] if other else []


def _eval_tasks_plot(points: TaskPoints, folder: Path, reasons: Reasons) -> tuple[dict[str, Path], dict[str, str]]:
    """eval_tasks.png: one panel per task, its main metrics against the step; left out (with the
    reason) when no task was evaluated often enough for a curve."""
    evaluations = max(len(records) for records in points.values())
    if not enough(evaluations):
        left_out = {"eval_tasks.png": reasons.evaluated("eval_tasks.png", evaluations)}
        _remove_stale(folder, left_out)
        return {}, left_out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(points), 1, figsize=(8, 2.6 * len(points)), squeeze=False)
    for ax, (task, records) in zip(axes[:, 0], points.items()):
        keys = main_metrics(records[-1])
        for key in keys:
            steps = [int(r["step"]) for r in records if key in r]
            ax.plot(steps, [number(r[key]) for r in records if key in r], "o-", ms=3, label=key.replace("_", " "))
        ax.set(xlabel="step", ylabel=" / ".join(k.replace("_", " ") for k in keys), title=task)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "eval_tasks.png", dpi=90)
    plt.close(fig)
    return {"eval_tasks.png": folder / "eval_tasks.png"}, {}


def evaluation(run_dir: Path, points: TaskPoints, plots: list[str]) -> Evaluation | None:
    """The Evaluation section: eval.json's results (`llmtrain eval`) when the run dir has one, and
    the tasks evaluated during training; None when there is neither."""
    saved = _eval_results(run_dir / EVAL_RESULTS)
    if saved is None and not points:
        return None
    section, summary = Evaluation(""), []
    if isinstance(saved, str):  # unreadable
        section.saved = saved
        summary.append(saved)
    elif saved is not None:
        # only this run's entries: `llmtrain eval OTHER --out RUN_DIR` may have added another model's
        own = str(run_dir.resolve())
        saved["tasks"] = {t: m for t, m in saved["tasks"].items() if m.get("model") in (None, own)}
        section.rows = [(task, str(m.get("kind", "?")), _metrics_cell(m), scored_text(m)) for task, m in saved["tasks"].items()]
        when = saved.get("updated") or saved.get("created")
        section.saved = (f"{EVAL_RESULTS} (`llmtrain eval`): {len(section.rows)} task(s)"
                         + (f" of {saved['model']}" if saved.get("model") else "")
                         + (f", written {when}" if when else "") + ".")
        summary.append(f"{EVAL_RESULTS}: " + "; ".join(f"{task} {task_metrics_text(m, ', ')}".rstrip()
                                                        for task, m in saved["tasks"].items()))
    if points:
        # each task at its own last step (a resume may have dropped a task that ran before)
        latest = "; ".join(f"{task} at step {records[-1]['step']}: {task_metrics_text(records[-1], ', ')}".rstrip()
                           for task, records in points.items())
        section.training = f"During training (eval.tasks, at every evaluation): {len(points)} task(s); {latest}."
        section.plots = plots
        summary.append(f"during training: {latest}")
    section.summary = " | ".join(summary)
    return section


def _eval_results(path: Path) -> dict | str | None:
    """eval.json as a dict with a "tasks" dict; a sentence when it cannot be read; None without one."""
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"{path.name} could not be read ({type(err).__name__}: {str(err)[:200]})."
    if not isinstance(document, dict) or not isinstance(document.get("tasks"), dict):
        return f"{path.name} has no \"tasks\" object: not a file `llmtrain eval` wrote."
    document["tasks"] = {str(k): v for k, v in document["tasks"].items() if isinstance(v, dict)}
    return document


def _metrics_cell(metrics: dict[str, Any]) -> str:
    """The headline metrics, each with its standard error when the task gave one; a harness task's
    own metrics when it has none of them."""
    parts = [f"{label} {fmt.format(number(metrics[key]))}"
             + (f" ± {number(metrics[key + '_stderr']):.4f}" if is_number(metrics.get(key + "_stderr")) else "")
             for key, label, fmt in TASK_HEADLINE if is_number(metrics.get(key))]
    return ", ".join(parts) if parts else task_metrics_text(metrics, ", ")


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


def build_report(run_dir: Path, inference_check: bool = True) -> Report:
    """Answer the seven questions and draw the plots (into RUN_DIR/report/); `write_report` also
    writes the two pages. Raises UserError for a folder that is not a run dir."""
    run_dir = Path(run_dir)
    if not (run_dir / METRICS).is_file():
        raise UserError(f"'{run_dir}' has no metrics.jsonl: give a run dir that `llmtrain train` wrote "
                        "(its banner prints it, e.g. outputs/<date>/<time>).")
    records = read_records(run_dir)
    cfg = _load_config(run_dir)
    spike_z = cfg.monitor.spike_z if cfg is not None else 6.0
    baseline = unigram_baseline(records, cfg)
    summary = summarize(run_dir, records)
    smooth = smoothness(records, spike_z)
    verdicts = [learning(records, baseline), smooth, overfitting(records)]
    verdicts.append(inference(run_dir, cfg) if inference_check
                    else Verdict("inference", "Does inference behave like training?", NA, "skipped (--no-inference)."))
    verdicts += [memory(records), step_time(records), alarms(records)]
    start = records.last(Kind.START) or {}
    reasons = Reasons(cfg, summary.steps, summary.planned_steps)
    plots, left_out = _plots(records, run_dir / "report", smooth.marks, baseline, reasons)
    facts = [
        ("run dir", str(run_dir)),
        ("status", summary.status),
        *run_description(cfg, start, recorded_overrides(run_dir)),
        ("steps", f"{summary.steps:,}" + (f" of {summary.planned_steps:,}" if summary.planned_steps else "")),
        ("tokens", tokens_text(records, run_dir, summary.steps)),
        ("final train loss", f"{summary.final_train_loss:.4f}" if summary.final_train_loss is not None else "-"),
        ("final val loss", f"{summary.final_val_loss:.4f}" if summary.final_val_loss is not None else "-"),
        ("best val loss", f"{summary.best_val_loss:.4f} (step {summary.best_step})" if summary.best_val_loss is not None else "-"),
        ("unigram baseline", f"{baseline:.4f} nats/token (the loss of a model that ignores context)"
         if baseline is not None else "- (not recorded, and the run's data is not in the cache)"),
        ("device", f"{start.get('device', '?')}, {start.get('precision', '?')}, world size {start.get('world_size', 1)}"),
    ]
    # A plot left out keeps its place in its section, which says why it is not there.
    for verdict in verdicts:
        verdict.plots = [p for p in verdict.plots if p in plots or p in left_out]
    verdicts.append(health_quantities(records, ["lr.png", "grad_norm.png", "param_norm.png", "activations.png"]))
    task_points = eval_task_points(records)
    if task_points:
        drawn, missing = _eval_tasks_plot(task_points, run_dir / "report", reasons)
        plots.update(drawn)
        left_out.update(missing)
    return Report(run_dir, f"Run report: {run_dir.name}", facts, verdicts, plots,
                  evaluation=evaluation(run_dir, task_points, ["eval_tasks.png"] if task_points else []),
                  left_out=left_out, seconds=run_seconds(records))


def run_description(cfg: Any, start: Record, overrides: list[str] | None) -> list[tuple[str, str]]:
    """The header's model (name, shape, parameter counts as the banner shows them), data (source,
    tokenizer, the model's vocabulary) and the command-line overrides that made the run."""
    counts = ParameterCounts.from_record(start.get("parameters"))
    parameters = (f"parameters {counts.text()}" if counts is not None
                  else "parameter counts not recorded (a run from before the start record kept them)")
    if cfg is None:
        model = data = "- (config.yaml is missing or unreadable)"
    else:
        m, d = cfg.model, cfg.data
        model = (f"{m.name}: {m.n_layer} layer{'s' if m.n_layer != 1 else ''} x {m.n_embd} wide, {m.n_head} "
                 f"head{'s' if m.n_head != 1 else ''}, context {m.block_size}")
        where = {DataSource.python_stdlib: "this Python's standard library sources",
                 DataSource.hf: " ".join(str(part) for part in (d.hf_name, d.hf_config) if part)}.get(d.source, d.path)
        vocab = start.get("vocab_size")
        data = (f"{d.source.value}{f' ({where})' if where else ''}, {d.tokenizer.value} tokens"
                + (f", model vocabulary {int(vocab):,}" if is_number(vocab) else ""))
    if overrides is None:
        given = "not recorded (a run started from Python, not from the command line)"
    else:
        given = " ".join(overrides) if overrides else "none (the defaults)"
    return [("model", f"{model}; {parameters}"), ("data", data), ("overrides", given)]


def write_report(run_dir: Path, inference: bool = True) -> Report:
    """Build the report and write report.md and report.html into the run dir."""
    try:
        report = build_report(run_dir, inference)
        report.markdown = report.run_dir / REPORT_MD
        report.html = report.run_dir / REPORT_HTML
        _atomic_write(report.markdown, to_markdown(report))
        _atomic_write(report.html, to_html(report))
    except OSError as err:  # a read-only run dir, a full disk
        raise UserError(f"the report for '{run_dir}' could not be written: {err}. Give a run dir you can write to, "
                        "or copy it somewhere writable first.") from None
    return report


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def to_markdown(report: Report) -> str:
    lines = [f"# {report.title}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in report.facts]  # a | would end the cell
    lines += ["", "## Verdicts", "", "| question | verdict | finding |", "|---|---|---|"]
    lines += [f"| {v.question} | **{v.status}** | {v.finding} |" for v in report.verdicts if v.key != "curves"]
    for verdict in report.verdicts:
        lines += ["", f"## {verdict.question}", "", f"**{verdict.status}**: {verdict.finding}", ""]
        lines += [f"- {d}" for d in verdict.details]
        lines += ["", *_plots_markdown(report, verdict.plots)]
    if report.evaluation is not None:
        lines += _evaluation_markdown(report, report.evaluation)
    return "\n".join(lines) + "\n"


def _plots_markdown(report: Report, names: list[str]) -> list[str]:
    """An image per plot drawn; the one line of a plot left out, in italics (its own paragraph)."""
    out = []
    for name in names:
        if name in report.plots:
            out.append(f"![{name}](report/{name})")
        elif name in report.left_out:
            out += [f"*{report.left_out[name]}*", ""]
    return out


def _evaluation_markdown(report: Report, section: Evaluation) -> list[str]:
    lines = ["", "## Evaluation"]
    if section.saved:
        lines += ["", section.saved]
    if section.rows:
        lines += ["", "| task | kind | metrics | scored |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in section.rows]
    if section.training:
        lines += ["", section.training]
    return lines + ["", *_plots_markdown(report, section.plots)]


def to_html(report: Report) -> str:
    colours = {OK: "#1a7f37", WARN: "#b35900", FAIL: "#c62828", NA: "#666"}
    esc = html.escape

    def badge(status: str) -> str:
        return f'<span class="badge" style="background:{colours.get(status, "#666")}">{esc(status)}</span>'

    def image(name: str) -> str:
        if name not in report.plots:  # left out: the line that says why
            return f"<p class='left-out'>{esc(report.left_out.get(name, name + ': left out'))}</p>"
        data = base64.b64encode(report.plots[name].read_bytes()).decode()
        return f'<img alt="{esc(name)}" src="data:image/png;base64,{data}">'

    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{esc(report.title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;"
        "vertical-align:top}.badge{color:#fff;border-radius:4px;padding:1px 6px;font-size:90%}"
        "img{max-width:100%;display:block;margin:0.5em 0}li{margin:0.2em 0}.left-out{color:#666;font-style:italic}"
        "</style></head><body>",
        f"<h1>{esc(report.title)}</h1><table>",
        *[f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in report.facts],
        "</table><h2>Verdicts</h2><table><tr><th>question</th><th>verdict</th><th>finding</th></tr>",
        *[f"<tr><td><a href='#{v.key}'>{esc(v.question)}</a></td><td>{badge(v.status)}</td><td>{esc(v.finding)}</td></tr>"
          for v in report.verdicts if v.key != "curves"],
        "</table>",
    ]
    for verdict in report.verdicts:
        parts.append(f"<h2 id='{verdict.key}'>{esc(verdict.question)} {badge(verdict.status)}</h2>")
        parts.append(f"<p>{esc(verdict.finding)}</p>")
        if verdict.details:
            parts.append("<ul>" + "".join(f"<li>{esc(d)}</li>" for d in verdict.details) + "</ul>")
        parts += [image(p) for p in verdict.plots]
    section = report.evaluation
    if section is not None:
        parts.append("<h2 id='evaluation'>Evaluation</h2>")
        if section.saved:
            parts.append(f"<p>{esc(section.saved)}</p>")
        if section.rows:
            parts.append("<table><tr><th>task</th><th>kind</th><th>metrics</th><th>scored</th></tr>"
                         + "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>"
                                   for row in section.rows) + "</table>")
        if section.training:
            parts.append(f"<p>{esc(section.training)}</p>")
        parts += [image(p) for p in section.plots]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def tokens_text(records: Records, run_dir: Path, steps: int) -> str:
    """The tokens trained on up to the run's last step, the figure a resume from that step prints.
    The last train record is not it when log_interval left the last steps unlogged (a stop at step 49
    logged at 40): the end record (it carries tokens) or that step's checkpoint says it; failing both,
    the last logged figure, said to be that."""
    for record in reversed(records.of(Kind.END)):
        if record.get("tokens") is not None and int(record.get("step", -1)) == steps:
            return f"{int(record['tokens']):,}"
    from llmtrain.checkpoint.layout import checkpoint_root, step_dir_name

    try:
        trainer = json.loads((checkpoint_root(run_dir) / step_dir_name(steps) / TRAINER_STATE).read_text())
        return f"{int(trainer['state']['tokens']):,}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no readable checkpoint of that step
    last = records.last(Kind.TRAIN) or {}
    tokens = int(last.get("tokens", 0))
    if last and int(last["step"]) < steps:
        return f"{tokens:,} by step {last['step']}, the last logged one"
    return f"{tokens:,}"


def run_seconds(records: Records) -> float | None:
    """The run's wall time in seconds: the last train record's elapsed_s (from the loop's start in
    the process that took the last steps, so a resume counts from its own start); None without one."""
    last = records.last(Kind.TRAIN) or {}
    seconds = last.get("elapsed_s")
    return float(seconds) if is_number(seconds) else None


def console_mode(report: Report, setting: str) -> str:
    """report.console as it applies to this run: short or full; auto is short for a run of under
    REPORT_FULL_AFTER_S (a run without a train record took no time worth a table)."""
    if setting != "auto":
        return setting
    return "full" if report.seconds is not None and report.seconds >= REPORT_FULL_AFTER_S else "short"


def render_console(report: Report, console: Any, setting: str = "full") -> None:
    """The review in the terminal as report.console says: the table (full), or the verdicts that
    are not ok, a line each (short)."""
    if console_mode(report, setting) == "full":
        render_summary(report, console)
    else:
        render_short(report, console)


def render_short(report: Report, console: Any) -> None:
    """One line per verdict that is not ok (warn, fail), then where the report is; a single line when
    every question is ok. An n/a is not a finding (a question this run cannot answer yet: too short
    to judge, no step timed) and is only counted, by name, in the first line."""
    style = {WARN: "bold yellow", FAIL: "bold red"}
    questions = [v for v in report.verdicts if v.key != "curves"]
    bad = [v for v in questions if v.status in (WARN, FAIL)]
    unjudged = [v.key.replace("_", " ") for v in questions if v.status == NA]
    where = f"report: {escape(str(report.html))}" if report.html is not None else ""
    if not bad and not unjudged:
        console.print(f"post-run review: all {len(questions)} questions ok" + (f"; {where}" if where else ""),
                      highlight=False, soft_wrap=True)  # soft: a path broken by the console is no path to copy
    else:
        counts = [f"{sum(v.status == s for v in questions)} {s}" for s in (FAIL, WARN, OK) if any(v.status == s for v in questions)]
        if unjudged:
            counts.append(f"{len(unjudged)} n/a ({', '.join(unjudged)})")
        console.print(f"post-run review: {', '.join(counts)}" + (f"; {where}" if where else ""), highlight=False,
                      soft_wrap=True)
    for verdict in bad:
        console.print(f"  [{style[verdict.status]}]{verdict.status}[/] {escape(verdict.question)} "
                      f"{escape(verdict.finding)}", highlight=False, soft_wrap=True)
    if report.evaluation is not None:
        console.print(f"evaluation: {escape(report.evaluation.summary)}", highlight=False, soft_wrap=True)


def render_summary(report: Report, console: Any) -> None:
    """The verdicts as a short table in the terminal."""
    style = {OK: "bold green", WARN: "bold yellow", FAIL: "bold red", NA: "dim"}
    table = Table(title=f"post-run review: {report.run_dir}", title_justify="left", show_lines=False)
    table.add_column("question")
    table.add_column("verdict")
    table.add_column("finding", overflow="fold")
    for verdict in report.verdicts:
        if verdict.key != "curves":
            table.add_row(verdict.question, f"[{style[verdict.status]}]{verdict.status}[/]", escape(verdict.finding))
    console.print(table)
    if report.evaluation is not None:
        console.print(f"evaluation: {escape(report.evaluation.summary)}", highlight=False)
    if report.html is not None:
        console.print(f"report: {report.html} (plots inside), {report.markdown}")
