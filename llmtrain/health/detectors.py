"""The health monitor: the seed's 8.2 bands watched with persistence, alarms that explain.

The monitor is a small stateful object fed one `Sample` of host-side numbers per check interval
(the loop gathers them in one sync at that step). Each detector looks for a pattern that persists
or trends, never a single point:

    grad_norm_high / grad_norm_low      outside the band for `patience` consecutive checks
    grad_norm_low_early_layers          first block's grad norm a tiny fraction of the largest
    param_norm_jump                     relative change between two checks above a threshold
    param_norm_decrease                 robust (Theil-Sen) negative trend over a window
    lr_zero / lr_exploding              applied LR zero, or far above, what the schedule says
    activation_mean_drift               |block-output mean| above a bound, persistently
    activation_variance_growing/...     block-output variance trending up / down over a window
    memory_leak                         RSS rising steadily after warm-up (robust slope)
    loss_spike                          robust z-score (median/MAD) over a rolling window

An alarm is raised once when its pattern appears and re-armed when the pattern clears; each one
carries the recent values, the band it left, the blocks concerned, and the causes and checks of
`health/catalog.py`. What to do about it (warn, reduce_lr, skip_step, rollback, stop) is the
configured action of that alarm; the loop carries it out.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmtrain.config.schema import MonitorAction, MonitorConfig
from llmtrain.runs.files import Kind


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
    steps_total: int = 0  # the run's length: a schedule at zero before the end is an alarm
    fp16_without_scaler: bool = False
    activation_mean: list[float] | None = None  # only on activation-sampled steps
    activation_var: list[float] | None = None


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

    def to_record(self) -> dict[str, Any]:
        return {"kind": Kind.ALARM, "alarm": self.name, "step": self.step, "severity": self.severity, "metric": self.metric,
                "values": self.values, "band": self.band, "blocks": self.blocks, "action": self.action}

    def explain(self) -> str:
        from llmtrain.health.catalog import explain

        recent = ", ".join(f"{v:.4g}" for v in self.values[-6:])
        where = f" (blocks {', '.join(map(str, self.blocks))})" if self.blocks else ""
        return (f"[{self.severity}] {self.name} at step {self.step}: {self.metric} = {recent}{where}; "
                f"left the band {self.band}. Action: {self.action}.\n{explain(self.name)}")


def theil_sen_slope(values: list[float]) -> float:
    """Median of pairwise slopes: a trend that one outlier cannot fake."""
    n = len(values)
    slopes = [(values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n)]
    return statistics.median(slopes) if slopes else 0.0


def _steady_rise(values: list[float], threshold: float, segments: int = 5) -> bool:
    """A rise of more than `threshold` over the window that keeps going: the median of each of
    `segments` consecutive stretches above the previous one's. One step up (a bigger batch, a cache
    filling once) is not a leak; a ramp or a staircase is."""
    if theil_sen_slope(values) * (len(values) - 1) <= threshold:
        return False
    size = len(values) // segments
    medians = [statistics.median(values[i * size:(i + 1) * size]) for i in range(segments)]
    step = threshold / (2 * (segments - 1))
    return all(b - a > step for a, b in zip(medians, medians[1:]))


def robust_z(value: float, window: list[float]) -> float:
    """How many robust standard deviations (1.4826 x MAD) `value` lies above the window's median."""
    median = statistics.median(window)
    mad = statistics.median(abs(v - median) for v in window)
    scale = 1.4826 * mad if mad > 0 else max(abs(median) * 1e-3, 1e-12)
    return (value - median) / scale


class HealthMonitor:
    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        window = max(cfg.trend_window, cfg.spike_window)
        self.history: dict[str, deque] = {
            key: deque(maxlen=window) for key in ("loss", "grad_norm", "param_norm", "rss_mb")
        }
        self.act_mean: deque = deque(maxlen=cfg.activation_window)
        self.act_var: deque = deque(maxlen=cfg.activation_window)
        self.counts: dict[str, int] = {}  # consecutive checks outside a band, per detector
        self.active: set[str] = set()  # alarms raised and not yet cleared (raised once per episode)
        self.checks = 0
        self.cooldown_until = -1  # check index before which reduce_lr does not act again

    # ---- state for checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "act_mean": list(self.act_mean), "act_var": list(self.act_var),
            "counts": self.counts, "active": sorted(self.active), "checks": self.checks,
            "cooldown_until": self.cooldown_until,
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

    # ---- detection -----------------------------------------------------------------------------
    def check(self, s: Sample) -> list[Alarm]:
        """Feed one sample; return the alarms raised now (each pattern once until it clears)."""
        cfg = self.cfg
        self.checks += 1
        found: dict[str, Alarm] = {}

        def persistent(name: str, outside: bool, **alarm: Any) -> None:
            self.counts[name] = self.counts.get(name, 0) + 1 if outside else 0
            if self.counts[name] >= cfg.patience:
                found[name] = Alarm(name=name, step=s.step, **alarm)

        evaluated = {"grad_norm_high", "grad_norm_low", "grad_norm_low_early_layers", "param_norm_jump",
                     "param_norm_decrease", "lr_zero", "lr_exploding", "memory_leak", "loss_spike", "fp16_no_scaler"}
        grads = list(self.history["grad_norm"])[-cfg.patience + 1:] + [s.grad_norm] if cfg.patience > 1 else [s.grad_norm]
        persistent("grad_norm_high", s.grad_norm > cfg.grad_norm_high, severity="critical", metric="grad_norm",
                   values=grads, band=f"<= {cfg.grad_norm_high:g}")
        # Starved: the whole gradient, or everything the transformer blocks receive, below the band.
        body = max(s.block_grad_norms, default=s.grad_norm)
        starved = s.grad_norm < cfg.grad_norm_low or body < cfg.grad_norm_low
        persistent("grad_norm_low", starved, severity="warning", metric="grad_norm (largest block)",
                   values=[s.grad_norm, body], band=f">= {cfg.grad_norm_low:g}",
                   blocks=list(range(len(s.block_grad_norms))) if body < cfg.grad_norm_low else [])
        if s.fp16_without_scaler:
            found["fp16_no_scaler"] = Alarm("fp16_no_scaler", s.step, "critical", "loss scale", [], "a dynamic loss scaler")
        if len(s.block_grad_norms) >= 2 and max(s.block_grad_norms) > 0:
            early = s.block_grad_norms[0] / max(s.block_grad_norms)
            persistent("grad_norm_low_early_layers", early < cfg.early_layer_ratio, severity="warning",
                       metric="first-block / largest-block grad norm", values=[early],
                       band=f">= {cfg.early_layer_ratio:g}", blocks=[0])
        else:
            early = 1.0

        params = list(self.history["param_norm"])
        if params and params[-1] > 0:
            change = abs(s.param_norm - params[-1]) / params[-1]
            if change > cfg.param_jump:
                found["param_norm_jump"] = Alarm("param_norm_jump", s.step, "critical", "param_norm",
                                                 params[-3:] + [s.param_norm], f"relative change <= {cfg.param_jump:g}")
        window = params[-cfg.trend_window + 1:] + [s.param_norm]
        if len(window) >= cfg.trend_window and window[0] > 0:
            slope = theil_sen_slope(window)
            drop = (window[0] - window[-1]) / window[0]
            if slope < 0 and drop > cfg.param_decrease:
                found["param_norm_decrease"] = Alarm("param_norm_decrease", s.step, "warning", "param_norm",
                                                     window[-6:], f"steady decrease <= {cfg.param_decrease:.0%} over "
                                                     f"{cfg.trend_window} checks")

        lr_zero = (s.lr_applied == 0.0 and s.lr_schedule > 0.0) or (s.lr_schedule == 0.0 and s.step < s.steps_total)
        persistent("lr_zero", lr_zero, severity="critical", metric="lr", values=[s.lr_applied, s.lr_schedule],
                   band="> 0 until the run ends")
        exploding = s.lr_schedule > 0 and s.lr_applied > cfg.lr_explode_factor * s.lr_schedule
        persistent("lr_exploding", exploding, severity="critical", metric="lr", values=[s.lr_applied, s.lr_schedule],
                   band=f"<= {cfg.lr_explode_factor:g} x the schedule's")

        if s.activation_mean is not None and s.activation_var is not None:
            evaluated |= {"activation_mean_drift", "activation_variance_growing", "activation_variance_shrinking"}
            self.act_mean.append(s.activation_mean)
            self.act_var.append(s.activation_var)
            drifting = [i for i, m in enumerate(s.activation_mean) if abs(m) > cfg.activation_mean_max]
            self.counts["activation_mean_drift"] = self.counts.get("activation_mean_drift", 0) + 1 if drifting else 0
            if self.counts["activation_mean_drift"] >= cfg.activation_patience:
                found["activation_mean_drift"] = Alarm(
                    "activation_mean_drift", s.step, "warning", "activation mean",
                    [s.activation_mean[i] for i in drifting], f"|mean| <= {cfg.activation_mean_max:g}", drifting)
            if len(self.act_var) >= cfg.activation_window:
                # A trend that keeps going: the factor over the window, and still the root of it over
                # its second half (growth from a small init that levels off is learning, not a fault).
                first, mid, last = self.act_var[0], self.act_var[len(self.act_var) // 2], self.act_var[-1]
                keep = cfg.activation_var_factor ** 0.5
                growing = [i for i in range(len(last)) if first[i] > 0 and mid[i] > 0
                           and last[i] / first[i] > cfg.activation_var_factor and last[i] / mid[i] > keep]
                shrinking = [i for i in range(len(last)) if last[i] > 0
                             and first[i] / last[i] > cfg.activation_var_factor and mid[i] / last[i] > keep]
                band = f"within x/÷{cfg.activation_var_factor:g} over {cfg.activation_window} samples"
                if growing:
                    found["activation_variance_growing"] = Alarm(
                        "activation_variance_growing", s.step, "warning", "activation variance",
                        [v[growing[0]] for v in self.act_var], band, growing)
                if shrinking:
                    found["activation_variance_shrinking"] = Alarm(
                        "activation_variance_shrinking", s.step, "warning", "activation variance",
                        [v[shrinking[0]] for v in self.act_var], band, shrinking)

        if self.checks > cfg.warmup_checks:
            rss = list(self.history["rss_mb"])[-cfg.trend_window + 1:] + [s.rss_mb]
            if len(rss) >= cfg.trend_window and _steady_rise(rss, cfg.memory_leak_mb):
                found["memory_leak"] = Alarm("memory_leak", s.step, "warning", "rss_mb", rss[-6:],
                                             f"rise <= {cfg.memory_leak_mb:g} MB over {cfg.trend_window} checks")

        losses = list(self.history["loss"])[-cfg.spike_window:]
        if len(losses) >= min(10, cfg.spike_window) and robust_z(s.loss, losses) > cfg.spike_z:
            found["loss_spike"] = Alarm("loss_spike", s.step, "warning", "loss", losses[-5:] + [s.loss],
                                        f"robust z-score <= {cfg.spike_z:g} over the last {len(losses)} checks")

        for key, value in (("loss", s.loss), ("grad_norm", s.grad_norm), ("param_norm", s.param_norm),
                           ("rss_mb", s.rss_mb)):
            self.history[key].append(value)
        new = [a for name, a in found.items() if name not in self.active]
        # An alarm stays active (silent) until a check that evaluated its detector no longer finds it.
        self.active = set(found) | {name for name in self.active if name not in evaluated}
        for alarm in new:
            alarm.action = self.action_for(alarm.name).value
        return new

    def action_for(self, name: str) -> MonitorAction:
        action = self.cfg.actions.get(name, MonitorAction.warn)
        if action is MonitorAction.reduce_lr:
            if self.checks < self.cooldown_until:
                return MonitorAction.warn  # still cooling down from the last reduction
            self.cooldown_until = self.checks + self.cfg.cooldown_checks
        return action
