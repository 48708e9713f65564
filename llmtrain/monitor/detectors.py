"""The health monitor: the seed's 8.2 bands watched with persistence, learning progress, alarms that explain.

The monitor is a small stateful object fed one `Sample` of host-side numbers per check interval
(the loop gathers them in one sync at that step). Each detector looks for a pattern that persists
or trends, never a single point:

    grad_norm_high / grad_norm_low      outside the band for `patience` consecutive checks
    grad_norm_surge                     the gradient norm suddenly far above its recent median, two checks running
    grad_norm_low_early_layers          some blocks' grad norm a tiny fraction of the largest (frozen)
    param_norm_jump                     relative change between two checks above a threshold
    param_norm_decrease                 robust (Theil-Sen) negative trend over a window
    lr_zero / lr_exploding              applied LR zero, or far above, what the schedule says
    activation_mean_drift               |block-output mean| above a bound, persistently
    activation_variance_high            block-output variance far above its healthy level, persistently
    activation_variance_growing/...     block-output variance trending up / down over a window
    memory_leak                         RSS rising steadily after warm-up (robust slope)
    loss_spike                          robust z-score (median/MAD) over a rolling window, and large
    loss_above_chance                   the loss far above a uniform guess over the vocabulary
    loss_rising                         the loss climbing well above its best, check after check
    loss_not_decreasing                 the loss has not left chance, or is stuck at the unigram baseline
    loss_oscillating                    interval means swinging far beyond their steps' noise (correlated batches)
    loss_autocorrelated                 (data read in file order) consecutive steps' losses moving together
    weight_decay_dominant               the decay, not the gradient, makes most of each update
    overfitting                         (at each evaluation) validation stalls while the train loss falls
    update_ratio_high / _low            ||dW|| / ||W|| per step far above / below its healthy range
    steps_too_small                     (Adam) the gradient the same step after step, and small steps: learning slowly
    schedule_ended                      the LR schedule ended while the run goes on

An alarm is raised once when its pattern appears and re-armed when the pattern clears; each one
carries the recent values, the band it left, the blocks concerned, and its causes ranked by the
run's evidence (`monitor/diagnosis.py`; the catalog's fixed list of `monitor/catalog.py` without it).
What to do about it (warn, reduce_lr, skip_step, rollback, stop) is the configured action of that
alarm; the loop carries it out.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmtrain.config.derived import INIT_GAIN_LOW
from llmtrain.config.schema import MonitorAction, MonitorConfig
from llmtrain.core.files import Kind
from llmtrain.monitor.diagnosis import Cause, RunFacts, Signals, diagnose
from llmtrain.monitor.overfit import widening_gap
from llmtrain.monitor.robust import independent_ratio, is_spike, robust_z, steady_rise, theil_sen_slope, trend_factors

# The run-time overfitting alarm acts on the run, so it asks for more than the report's review: the
# train loss falling >= 0.1 nats over the second half of >= 4 evaluations while the gap grows >= 0.1
# (healthy runs of the calibration corpus: a gap that moves by a few hundredths either way).
OVERFIT_MIN_FALL = 0.1
OVERFIT_MIN_EVALS = 4

# A gradient-norm surge is alarmed when it holds on this many consecutive checks.
SURGE_CHECKS = 2

# Consecutive steps' losses, judged where the data is read in file order: the residuals of each
# interval's steps around their straight line (the learning trend), pooled over the last
# CORRELATION_WINDOW checks; their successive differences against what independent steps give
# (`independent_ratio`). Data in file order: 0.66-0.80 (bytes, chars and BPE, three model families);
# shuffled healthy runs 0.78-1.16 (the optimizer's own momentum correlates BPE runs' steps a little:
# that is why a shuffled run is not judged); independent draws fall below 0.86 one time in 20.
CORRELATION_MAX = 0.85
CORRELATION_WINDOW = 10
# Steps too small to move the model (learning slowly, not stuck): Adam's moments say the gradient is
# the same from step to step (first moment^2 / second moment at or above STEADY_GRADIENT: gradients
# that are mostly noise give (1 - beta1) / (1 + beta1) = 0.053, one that never changes 1, and 0.25 is
# about their geometric middle; healthy runs after their warmup hold at most 0.14 for 3 checks) while
# each step moves the weights by less than SMALL_STEP of their norm (healthy: 1e-3 to 1e-2 early on).
# Judged after the warmup and from step STEPS_JUDGED_FROM.
STEADY_GRADIENT = 0.25
SMALL_STEP = 1e-3
STEPS_JUDGED_FROM = 50
# An init far below the healthy band makes a plateau at the unigram baseline its symptom: the loss
# within this fraction of the baseline, falling or not.
INIT_PLATEAU_MARGIN = 0.05


@dataclass
class Sample:
    """Host-side metrics of one check (floats; per-block lists indexed by block)."""

    step: int
    loss: float
    grad_norm: float
    block_grad_norms: list[float]
    param_norm: float
    lr_applied: float
    lr_schedule: float
    rss_mb: float
    total_steps: int = 0  # the run's length: a schedule at zero before the end is an alarm
    fp16_without_scaler: bool = False
    activation_mean: list[float] | None = None  # only on activation-sampled steps
    activation_var: list[float] | None = None
    interval_loss: float | None = None  # mean loss of the steps since the previous check (None: `loss`)
    interval_loss_var: float | None = None  # the variance of those steps' losses
    interval_steps: int = 0  # how many steps they were
    interval_resid_ss: float = 0.0  # the sum of squares of those losses around their straight line
    interval_resid_ssd: float = 0.0  # ... and of those residuals' successive differences (0, 0: fewer than 4)
    moment_ratio: float | None = None  # Adam's sum of first moment^2 / sum of second moment (None: no Adam state)
    update_ratio: float | None = None  # ||dW|| / ||W|| of the latest applied check-step update
    update_lr: float | None = None  # the LR of that update


@dataclass
class Alarm:
    name: str
    step: int
    severity: str  # "warning" or "critical"
    metric: str
    values: list[float]  # recent values of the metric, oldest first
    band: str  # the band it left, in words
    blocks: list[int] = field(default_factory=list)
    action: str = "warn"
    causes: list[Cause] = field(default_factory=list)  # most likely first; [] without the run's facts

    def to_record(self) -> dict[str, Any]:
        return {"kind": Kind.ALARM, "alarm": self.name, "step": self.step, "severity": self.severity,
                "metric": self.metric, "values": self.values, "band": self.band, "blocks": self.blocks,
                "action": self.action,
                "causes": [cause.to_record() for cause in self.causes]}

    def explain(self) -> str:
        from llmtrain.monitor.catalog import explain, explain_ranked

        recent = ", ".join(f"{v:.4g}" for v in self.values[-6:])
        where = f" (blocks {', '.join(map(str, self.blocks))})" if self.blocks else ""
        text = explain_ranked(self.name, self.causes, self.action, self.severity) if self.causes else explain(self.name)
        return (f"[{self.severity}] {self.name} at step {self.step}: {self.metric} = {recent}{where}; "
                f"left the band {self.band}. Action: {self.action}.\n{text}")


def _mean_noise(s: Sample) -> float | None:
    """The variance the interval's mean loss would have from its steps' noise alone."""
    if s.interval_loss_var is None or s.interval_steps < 2:
        return None
    return s.interval_loss_var / s.interval_steps


def _median_tail(values: list[float], n: int) -> float:
    tail = values[-n:]
    return statistics.median(tail) if tail else math.nan


class Detectors:
    """Judges one `Sample` per check. `facts` (the run's configuration and data, see
    monitor/diagnosis.py) enables the learning-progress detectors that need the unigram baseline and
    the chance loss, and the ranked causes; without it (synthetic streams) alarms carry no causes."""

    def __init__(self, cfg: MonitorConfig, facts: RunFacts | None = None) -> None:
        self.cfg = cfg
        self.facts = facts
        window = max(cfg.trend_window, cfg.spike_window)
        self.history: dict[str, deque] = {
            key: deque(maxlen=window)
            for key in ("loss", "grad_norm", "param_norm", "rss_mb", "interval_loss", "interval_noise")
        }
        self.act_mean: deque = deque(maxlen=cfg.activation_window)
        self.act_var: deque = deque(maxlen=cfg.activation_window)
        self.residuals: deque = deque(maxlen=CORRELATION_WINDOW)  # (ss, ssd, steps) of recent intervals
        self.step_correlation: float | None = None  # their pooled ratio to independent steps' (None: too few)
        self.counts: dict[str, int] = {}  # consecutive checks outside a band, per detector
        self.active: set[str] = set()  # alarms raised and not yet cleared (raised once per episode)
        self.checks = 0
        self.cooldown_until = -1  # check index before which reduce_lr does not act again
        self.best_loss = math.inf  # the lowest smoothed loss so far (median of 3 interval losses)
        self.best_check = 0  # the check at which it was reached
        self.update_ratio: float | None = None  # the latest one seen
        self.skipped: set[str] = set()  # this check's detectors whose guard kept them from judging
        self.val: list[tuple[int, float]] = []  # (step, validation loss) of every evaluation
        self.gaps: list[tuple[int, float]] = []  # (step, validation - the train loss the checks saw then)

    # ---- state for checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "act_mean": list(self.act_mean), "act_var": list(self.act_var),
            "counts": self.counts, "active": sorted(self.active), "checks": self.checks,
            "cooldown_until": self.cooldown_until, "best_check": self.best_check,
            "best_loss": self.best_loss if math.isfinite(self.best_loss) else None,  # strict JSON: no Infinity
            "update_ratio": self.update_ratio, "val": self.val, "gaps": self.gaps,
            "residuals": [list(r) for r in self.residuals],
        }

    def load_state_dict(self, state: dict) -> None:
        for key, values in state["history"].items():
            if key not in self.history:  # a window this version no longer keeps
                continue
            self.history[key].clear()
            self.history[key].extend(values)
        self.act_mean.clear()
        self.act_mean.extend(state["act_mean"])
        self.act_var.clear()
        self.act_var.extend(state["act_var"])
        self.counts, self.active = dict(state["counts"]), set(state["active"])
        self.checks, self.cooldown_until = state["checks"], state["cooldown_until"]
        # Windows an older checkpoint did not keep start empty.
        best = state.get("best_loss")
        self.best_loss = float(best) if best is not None else math.inf
        self.best_check = int(state.get("best_check", 0))
        self.update_ratio = state.get("update_ratio")
        self.val = [(int(a), float(b)) for a, b in state.get("val", [])]
        self.gaps = [(int(a), float(b)) for a, b in state.get("gaps", [])]
        self.residuals.clear()
        self.residuals.extend((float(a), float(b), int(n)) for a, b, n in state.get("residuals", []))

    # ---- detection -----------------------------------------------------------------------------
    def check(self, s: Sample) -> list[Alarm]:
        """Feed one sample; return the alarms raised now (each pattern once until it clears)."""
        self.checks += 1
        if s.update_ratio is not None:
            self.update_ratio = s.update_ratio
        found: dict[str, Alarm] = {}
        self.skipped = set()
        evaluated = set(_EVERY_CHECK)
        self._gradients(s, found)
        self._parameters(s, found)
        self._learning_rate(s, found)
        if s.activation_mean is not None and s.activation_var is not None:
            evaluated |= _ACTIVATION_ALARMS
            self._activations(s, found)
        self._memory(s, found)
        self._loss(s, found)
        if s.fp16_without_scaler:
            found["fp16_no_scaler"] = Alarm("fp16_no_scaler", s.step, "critical", "loss scale", [],
                                            "a dynamic loss scaler")
        for key, value in (("loss", s.loss), ("grad_norm", s.grad_norm), ("param_norm", s.param_norm),
                           ("rss_mb", s.rss_mb), ("interval_loss", self._interval_loss(s)),
                           ("interval_noise", _mean_noise(s))):
            self.history[key].append(value)
        self._track_best()
        evaluated -= self.skipped
        new = [a for name, a in found.items() if name not in self.active]
        # An alarm stays active (silent) until a check that evaluated its detector no longer finds it.
        self.active = set(found) | {name for name in self.active if name not in evaluated}
        for alarm in new:
            alarm.action = self.action_for(alarm.name).value
            alarm.causes = diagnose(alarm.name, self.facts, self._signals(s, alarm))
        # The most telling first: critical before warning, then the more certain diagnosis.
        new.sort(key=lambda a: (a.severity != "critical", -(a.causes[0].score if a.causes else 0.0)))
        return new

    def validation(self, step: int, val_loss: float) -> list[Alarm]:
        """Feed one evaluation: the overfitting alarm, raised once while the gap keeps widening. The
        train loss it is set against is the median of the last 3 checks' interval means."""
        train = _median_tail(list(self.history["interval_loss"]), 3)
        if not (math.isfinite(val_loss) and math.isfinite(train)):
            return []
        self.val.append((step, val_loss))
        self.gaps.append((step, val_loss - train))
        seen = widening_gap(self.val, self.gaps, min_fall=OVERFIT_MIN_FALL, min_points=OVERFIT_MIN_EVALS,
                            min_growth=OVERFIT_MIN_FALL)
        if seen is None:
            self.active.discard("overfitting")
            return []
        if "overfitting" in self.active:
            return []
        self.active.add("overfitting")
        alarm = Alarm("overfitting", step, "warning", "validation - train loss", [g for _, g in self.gaps[-6:]],
                      "a gap that does not grow while validation stalls")
        alarm.action = self.action_for(alarm.name).value
        best_step = min(self.val, key=lambda point: point[1])[0]
        signals = Signals(step=step, overfit=seen.text(), best_val_step=best_step, rising="loss_rising" in self.active)
        alarm.causes = diagnose(alarm.name, self.facts, signals)
        return [alarm]

    def _persistent(self, found: dict[str, Alarm], name: str, outside: bool, alarm: Alarm,
                    patience: int | None = None, also: bool = True) -> None:
        """Raise `alarm` once `outside` held for `patience` consecutive checks (and `also` holds now)."""
        self.counts[name] = self.counts.get(name, 0) + 1 if outside else 0
        if self.counts[name] >= (patience if patience is not None else self.cfg.patience) and also:
            found[name] = alarm

    def _gradients(self, s: Sample, found: dict[str, Alarm]) -> None:
        cfg = self.cfg
        earlier = list(self.history["grad_norm"])
        grads = earlier[-cfg.patience + 1:] + [s.grad_norm] if cfg.patience > 1 else [s.grad_norm]
        # Persistently outside the healthy band (above 10), and past the alarm line at least once
        # among those checks: norms of 190, 44, 35 are as sick as three above 100.
        self._persistent(found, "grad_norm_high", s.grad_norm > min(10.0, cfg.grad_norm_high), Alarm(
            "grad_norm_high", s.step, "critical", "grad_norm", grads, f"<= {cfg.grad_norm_high:g}"),
            also=max(grads) > cfg.grad_norm_high)
        if len(earlier) >= 5:
            # On SURGE_CHECKS consecutive checks: one hard batch (healthy BPE runs reach 9x their median
            # at one check, and fall back) is what clipping is for; a surge that lasts is not.
            median = statistics.median(earlier[-cfg.spike_window:])
            self._persistent(found, "grad_norm_surge", s.grad_norm > max(1.0, cfg.grad_surge_factor * median), Alarm(
                "grad_norm_surge", s.step, "critical", "grad_norm", earlier[-5:] + [s.grad_norm],
                f"<= {cfg.grad_surge_factor:g} x its recent median {median:.3g}"), patience=SURGE_CHECKS)
        else:
            self.skipped.add("grad_norm_surge")
        # Starved: the whole gradient, or everything the transformer blocks receive, below the band.
        body = max(s.block_grad_norms, default=s.grad_norm)
        starved = s.grad_norm < cfg.grad_norm_low or body < cfg.grad_norm_low
        self._persistent(found, "grad_norm_low", starved, Alarm(
            "grad_norm_low", s.step, "warning", "grad_norm (largest block)", [s.grad_norm, body],
            f">= {cfg.grad_norm_low:g}", list(range(len(s.block_grad_norms))) if body < cfg.grad_norm_low else []))
        if not (len(s.block_grad_norms) >= 2 and body > 0 and not starved):
            self.skipped.add("grad_norm_low_early_layers")  # starved as a whole: that is grad_norm_low
        else:
            # Frozen blocks: a few blocks get next to nothing while the others learn.
            ratios = [g / body for g in s.block_grad_norms]
            frozen = [i for i, r in enumerate(ratios) if r < cfg.early_layer_ratio]
            self._persistent(found, "grad_norm_low_early_layers", bool(frozen), Alarm(
                "grad_norm_low_early_layers", s.step, "critical", "block / largest-block grad norm",
                [ratios[i] for i in frozen] or [min(ratios)], f">= {cfg.early_layer_ratio:g}", frozen))

    def _parameters(self, s: Sample, found: dict[str, Alarm]) -> None:
        cfg = self.cfg
        params = list(self.history["param_norm"])
        if params and params[-1] > 0:
            change = abs(s.param_norm - params[-1]) / params[-1]
            if change > cfg.param_jump:
                found["param_norm_jump"] = Alarm("param_norm_jump", s.step, "critical", "param_norm",
                                                 params[-3:] + [s.param_norm], f"relative change <= {cfg.param_jump:g}")
        window = params[-cfg.trend_window + 1:] + [s.param_norm]
        if len(window) >= cfg.trend_window and window[0] > 0:
            drop = (window[0] - window[-1]) / window[0]
            recent = window[-max(3, len(window) // 3):]  # still falling at the end: not a norm that turned up
            if theil_sen_slope(window) < 0 and theil_sen_slope(recent) < 0 and drop > cfg.param_decrease:
                found["param_norm_decrease"] = Alarm("param_norm_decrease", s.step, "warning", "param_norm",
                                                     window[-6:], f"steady decrease <= {cfg.param_decrease:.0%} over "
                                                     f"{cfg.trend_window} checks")
        ratio = s.update_ratio
        if ratio is None:  # no applied update since the last check (a resume, a skip): nothing to judge
            self.skipped |= {"update_ratio_high", "update_ratio_low", "weight_decay_dominant", "steps_too_small"}
        else:
            self._persistent(found, "update_ratio_high", ratio > cfg.update_ratio_high, Alarm(
                "update_ratio_high", s.step, "warning", "update / weight ratio", [ratio],
                f"<= {cfg.update_ratio_high:g} per step"))
            self._persistent(found, "update_ratio_low", 0 < ratio < cfg.update_ratio_low, Alarm(
                "update_ratio_low", s.step, "warning", "update / weight ratio", [ratio],
                f">= {cfg.update_ratio_low:g} per step"))
            # Decoupled decay shrinks the weights by lr x wd per step: when that is most of the whole
            # update, the weights follow the decay, not the gradient (an upper bound: not every
            # parameter is decayed). Healthy: ~0.02. The LR is that of the step the ratio was measured on.
            lr = s.update_lr if s.update_lr is not None else s.lr_applied
            decay = lr * self.facts.weight_decay if self.facts is not None else 0.0
            share = decay / ratio if ratio > 0 else 0.0
            self._steps_small(s, ratio, found)
            self._persistent(found, "weight_decay_dominant", share > cfg.decay_share_max, Alarm(
                "weight_decay_dominant", s.step, "warning", "weight-decay share of the update", [share],
                f"<= {cfg.decay_share_max:g} (lr x weight decay = {decay:.2g} per step against an update of "
                f"{ratio:.2g})"))

    def _steps_small(self, s: Sample, update: float, found: dict[str, Alarm]) -> None:
        """The same gradient step after step, and small steps along it: the optimizer could go faster."""
        f, steady = self.facts, s.moment_ratio
        if steady is None or f is None or s.step < STEPS_JUDGED_FROM or s.step <= f.warmup_steps:
            self.skipped.add("steps_too_small")
            return
        self._persistent(found, "steps_too_small", steady >= STEADY_GRADIENT and update < SMALL_STEP, Alarm(
            "steps_too_small", s.step, "warning", "Adam's first moment^2 / second moment, update / weight ratio",
            [steady, update], f"< {STEADY_GRADIENT:g} (a gradient that changes from step to step), or steps of "
            f">= {SMALL_STEP:g} of the weights"))

    def _learning_rate(self, s: Sample, found: dict[str, Alarm]) -> None:
        cfg = self.cfg
        lr_zero = (s.lr_applied == 0.0 and s.lr_schedule > 0.0) or (s.lr_schedule == 0.0 and s.step < s.total_steps)
        self._persistent(found, "lr_zero", lr_zero, Alarm("lr_zero", s.step, "critical", "lr",
                                                          [s.lr_applied, s.lr_schedule], "> 0 until the run ends"))
        exploding = s.lr_schedule > 0 and s.lr_applied > cfg.lr_explode_factor * s.lr_schedule
        self._persistent(found, "lr_exploding", exploding, Alarm(
            "lr_exploding", s.step, "critical", "lr", [s.lr_applied, s.lr_schedule],
            f"<= {cfg.lr_explode_factor:g} x the schedule's"))
        f = self.facts
        ends_low = f is not None and f.schedule_floor < f.lr  # a constant schedule holds its LR: nothing lost
        if ends_low and 0 < f.schedule_steps < f.total_steps and f.schedule_steps < s.step < s.total_steps:
            found["schedule_ended"] = Alarm("schedule_ended", s.step, "warning", "lr", [s.lr_schedule],
                                            f"a schedule that lasts the run ({f.total_steps} steps)")

    def _activations(self, s: Sample, found: dict[str, Alarm]) -> None:
        cfg = self.cfg
        assert s.activation_mean is not None and s.activation_var is not None
        self.act_mean.append(s.activation_mean)
        self.act_var.append(s.activation_var)
        # Away from 0 in absolute terms AND against the block's own spread: a residual stream with a
        # standard deviation of 12 (modern_tiny, healthy) may sit at a mean of -1.6.
        drifting = [i for i, (m, v) in enumerate(zip(s.activation_mean, s.activation_var))
                    if abs(m) > cfg.activation_mean_max and abs(m) > cfg.activation_mean_share * math.sqrt(max(v, 0.0))]
        self._persistent(found, "activation_mean_drift", bool(drifting), Alarm(
            "activation_mean_drift", s.step, "warning", "activation mean", [s.activation_mean[i] for i in drifting],
            f"|mean| <= {cfg.activation_mean_max:g}", drifting), patience=cfg.activation_patience)
        # A level far above a normalized signal's ~1 (pre-LN residual streams run ~10-100 when healthy).
        high = [i for i, v in enumerate(s.activation_var) if v > cfg.activation_var_max]
        self._persistent(found, "activation_variance_high", bool(high), Alarm(
            "activation_variance_high", s.step, "warning", "activation variance", [s.activation_var[i] for i in high],
            f"<= {cfg.activation_var_max:g}", high), patience=cfg.activation_patience)
        if len(self.act_var) < cfg.activation_window:
            return
        # A trend that keeps going: the factor over the window, and still the root of it over
        # its second half (growth from a small init that levels off is learning, not a fault). Growth
        # counts only above unit scale: a fresh model's tiny signals (variance 1e-3 from an init std of
        # 0.02) grow tenfold while they learn, in every healthy run.
        first, mid, last = self.act_var[0], self.act_var[len(self.act_var) // 2], self.act_var[-1]
        factors = [trend_factors(a, b, c) for a, b, c in zip(first, mid, last)]
        growing = [i for i, (grown, _) in enumerate(factors)
                   if last[i] > cfg.activation_var_floor and grown > cfg.activation_var_factor]
        shrinking = [i for i, (_, shrunk) in enumerate(factors) if shrunk > cfg.activation_var_factor]
        # Persistently, as for the mean and the level: a fresh model's first rise (or its fall from
        # the peak of that rise) fills one window and is gone from the next; a fault keeps going.
        band = f"within x/÷{cfg.activation_var_factor:g} over {cfg.activation_window} samples"
        for name, blocks in (("activation_variance_growing", growing), ("activation_variance_shrinking", shrinking)):
            self._persistent(found, name, bool(blocks), Alarm(
                name, s.step, "warning", "activation variance", [v[blocks[0]] for v in self.act_var] if blocks else [],
                band, blocks), patience=cfg.activation_patience)

    def _memory(self, s: Sample, found: dict[str, Alarm]) -> None:
        cfg = self.cfg
        if self.checks <= cfg.warmup_checks:
            return
        rss = list(self.history["rss_mb"])[-cfg.trend_window + 1:] + [s.rss_mb]
        if len(rss) >= cfg.trend_window and steady_rise(rss, cfg.memory_leak_mb):
            found["memory_leak"] = Alarm("memory_leak", s.step, "warning", "rss_mb", rss[-6:],
                                         f"rise <= {cfg.memory_leak_mb:g} MB over {cfg.trend_window} checks")

    def _loss(self, s: Sample, found: dict[str, Alarm]) -> None:
        cfg, f = self.cfg, self.facts
        losses = list(self.history["loss"])[-cfg.spike_window:]
        if len(losses) >= min(10, cfg.spike_window):
            median = statistics.median(losses)
            # Far out in robust terms AND large: on a flat curve (MAD ~ 0) any wobble has a huge z.
            if is_spike(robust_z(s.loss, losses), s.loss - median, median, cfg.spike_z):
                found["loss_spike"] = Alarm("loss_spike", s.step, "warning", "loss", losses[-5:] + [s.loss],
                                            f"robust z-score <= {cfg.spike_z:g} over the last {len(losses)} checks")
        current = self._interval_loss(s)
        if f is not None and math.isfinite(f.chance) and current > cfg.loss_chance_factor * f.chance:
            found["loss_above_chance"] = Alarm(
                "loss_above_chance", s.step, "critical", "loss", [current],
                f"<= {cfg.loss_chance_factor:g} x ln(vocabulary) = {cfg.loss_chance_factor * f.chance:.3g}")
        series = list(self.history["interval_loss"]) + [current]
        smoothed = _median_tail(series, 3)
        rise = smoothed - self.best_loss
        # The best is the lowest of many noisy medians: with tiny batches (64 tokens a step) the
        # interval means scatter by ~0.15 nats, so a rise must also clear 3 of their standard deviations.
        noise = [v for v in list(self.history["interval_noise"])[-10:] + [_mean_noise(s)] if v is not None]
        scatter = 3 * math.sqrt(statistics.median(noise)) if noise else 0.0
        rising = (len(series) >= 4 and self.checks - self.best_check >= 2
                  and rise > max(cfg.loss_rise_min, cfg.loss_rise * self.best_loss, scatter))
        self._persistent(found, "loss_rising", rising, Alarm(
            "loss_rising", s.step, "warning", "loss (median of 3 checks)", series[-6:],
            f"<= its best {self.best_loss:.4g} + max({cfg.loss_rise_min:g}, {cfg.loss_rise:.0%}, 3 x the interval "
            f"means' noise {scatter / 3:.2g})"))
        self._swings(s, series, found)
        if f is not None:
            self._progress(s, series, found)
            self._correlated(s, found)

    def _swings(self, s: Sample, series: list[float], found: dict[str, Alarm]) -> None:
        """Correlated batches: the interval means swing from check to check far more than the noise
        of their own steps explains (with shuffled data the steps are independent draws, so a mean
        of n steps varies by their variance / n; data read in order moves the loss with the text)."""
        cfg = self.cfg
        noise = [v for v in list(self.history["interval_noise"])[-9:] + [_mean_noise(s)] if v is not None]
        window = series[-10:]
        if s.step < cfg.progress_after or len(window) < 10 or len(noise) < 10:
            self.skipped.add("loss_oscillating")
            return
        # Second differences take out the trend of learning and its curvature; for independent
        # interval means of variance v each has variance 6 v. The median of their squares (robust to
        # one bad interval) / 0.455 (the median of a chi-square with 1 degree of freedom) / 6 -> v.
        second = [a - 2 * b + c for a, b, c in zip(window, window[1:], window[2:])]
        between = statistics.median(d * d for d in second) / (0.455 * 6)
        expected = statistics.median(noise)
        swinging = expected > 0 and between > cfg.loss_swing_factor * expected
        self._persistent(found, "loss_oscillating", swinging, Alarm(
            "loss_oscillating", s.step, "warning", "loss (interval means)", window[-6:],
            f"swings of the interval means <= {cfg.loss_swing_factor:g} x their step noise "
            f"(now {between / expected if expected > 0 else math.inf:.3g}x)"))

    def _progress(self, s: Sample, series: list[float], found: dict[str, Alarm]) -> None:
        """Learning progress against chance (ln vocabulary) and the unigram baseline."""
        cfg, f = self.cfg, self.facts
        assert f is not None
        if (s.step < cfg.progress_after or len(series) < 10
                or not (math.isfinite(f.chance) and math.isfinite(f.baseline))):
            self.skipped.add("loss_not_decreasing")
            return
        recent = _median_tail(series, 5)
        span = f.chance - f.baseline
        unmoved = span > 0 and f.chance - recent < 0.1 * span
        # Still falling: judged by the robust trend over the last 10 checks, not by two medians of 5
        # (a healthy BPE run of 4,096 tokens sits 2% under its baseline at step 120 and falls ~0.03
        # nats a check, which two noisy medians 5 checks apart took for a stall).
        trend_fall = -theil_sen_slope(series[-10:]) * (len(series[-10:]) - 1)
        stalled = (recent > (1 - cfg.baseline_margin) * f.baseline
                   and self.best_loss > (1 - cfg.baseline_margin) * f.baseline
                   and trend_fall < cfg.baseline_margin * f.baseline)
        # With an init far below the healthy band the blocks pass next to nothing until their weights
        # grow: the loss sitting at the baseline is that, whether or not it still creeps down (a
        # healthy run may rest there for a while, c_bpe_accum for 70 steps: it is judged by the trend).
        idle = f.init_gain < INIT_GAIN_LOW and abs(recent - f.baseline) < INIT_PLATEAU_MARGIN * f.baseline
        if unmoved or stalled or idle:
            band = (f"below a uniform guess {f.chance:.4g} by 10% of the way to the unigram baseline {f.baseline:.4g}"
                    if unmoved else f"below the unigram baseline {f.baseline:.4g} by {cfg.baseline_margin:.0%}, "
                    "or still falling" if stalled else
                    f"away from the unigram baseline {f.baseline:.4g} (an init this small rests there)")
            found["loss_not_decreasing"] = Alarm("loss_not_decreasing", s.step, "warning", "loss (median of 5 checks)",
                                                 series[-6:], band)

    def _correlated(self, s: Sample, found: dict[str, Alarm]) -> None:
        """Data in file order: consecutive steps read neighbouring text, so their losses move together
        and the residuals' successive differences shrink against independent steps'."""
        if s.interval_steps >= 4 and s.interval_resid_ss > 0:
            self.residuals.append((s.interval_resid_ss, s.interval_resid_ssd, s.interval_steps))
        self.step_correlation = None
        if len(self.residuals) == CORRELATION_WINDOW:  # measured on every run (metrics.jsonl), judged on some
            expected = sum(ss * independent_ratio(n) for ss, _, n in self.residuals)
            self.step_correlation = sum(ssd for _, ssd, _ in self.residuals) / expected
        f, ratio = self.facts, self.step_correlation
        if f is None or f.shuffled or s.step < self.cfg.progress_after or ratio is None:
            self.skipped.add("loss_autocorrelated")
            return
        self._persistent(found, "loss_autocorrelated", ratio < CORRELATION_MAX, Alarm(
            "loss_autocorrelated", s.step, "warning", "successive differences of step losses / independent steps'",
            [ratio], f">= {CORRELATION_MAX:g} (independent steps: 1)"))

    def _interval_loss(self, s: Sample) -> float:
        value = s.interval_loss if s.interval_loss is not None else s.loss
        return value if math.isfinite(value) else s.loss

    def _track_best(self) -> None:
        smoothed = _median_tail(list(self.history["interval_loss"]), 3)
        if math.isfinite(smoothed) and smoothed < self.best_loss:
            self.best_loss, self.best_check = smoothed, self.checks

    def _signals(self, s: Sample, alarm: Alarm) -> Signals:
        grads = list(self.history["grad_norm"])
        recent = grads[-self.cfg.spike_window:] + [s.grad_norm]
        return Signals(step=s.step, grad_norm_peak=max(recent), grad_norm_floor=min(recent),
                       update_ratio=self.update_ratio, blocks=alarm.blocks, n_blocks=len(s.block_grad_norms),
                       rising="loss_rising" in self.active, lr_applied=s.lr_applied, lr_schedule=s.lr_schedule)

    def action_for(self, name: str) -> MonitorAction:
        action = self.cfg.actions.get(name, MonitorAction.warn)
        if action is MonitorAction.reduce_lr:
            if self.checks < self.cooldown_until:
                return MonitorAction.warn  # still cooling down from the last reduction
            self.cooldown_until = self.checks + self.cfg.cooldown_checks
        return action


# Detectors evaluated at every check (their alarms clear when a check no longer finds them); the
# activation ones only on sampled steps.
_EVERY_CHECK = frozenset({
    "grad_norm_high", "grad_norm_surge", "grad_norm_low", "grad_norm_low_early_layers", "param_norm_jump",
    "param_norm_decrease", "update_ratio_high", "update_ratio_low", "lr_zero", "lr_exploding", "schedule_ended",
    "memory_leak", "loss_spike", "fp16_no_scaler", "loss_above_chance", "loss_rising", "loss_not_decreasing",
    "loss_oscillating", "weight_decay_dominant", "loss_autocorrelated", "steps_too_small",
})
_ACTIVATION_ALARMS = frozenset({"activation_mean_drift", "activation_variance_high", "activation_variance_growing",
                                "activation_variance_shrinking"})
