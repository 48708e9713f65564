"""How far the healthy runs of the pathology benchmark stay from each alarm threshold: the
distribution every threshold is set against, with its margin.

    python benchmarks/pathologies.py --keep runs/ ...        # first: the runs (their health records)
    python benchmarks/calibrate.py runs/ --markdown calibration.md

For each healthy case's run dir it reads metrics.jsonl (the `health` records, every monitor.interval
steps, and the `eval` records) and computes the statistic each detector thresholds, at its most
extreme over the run: the largest gradient norm, the largest jump of the gradient norm over the
median of the checks before it, the largest relative change of the parameter norm between checks,
the update/weight ratio's extremes, the weight-decay share of the update, the block outputs' largest
|mean| and variance and their variance's trends, Adam's moment ratio, the largest robust z-score of
a check's loss, the largest rise of the smoothed loss above its best, the step-loss correlation, and
the overfitting rule's train-loss fall and gap growth. Per statistic: the median and the largest
over the runs (and which run), the threshold (the default config's), and the margin (how many times
the worst healthy run would have to grow, or shrink, to reach it). A statistic whose name says
"held" is held as its alarm's persistence holds it (the surge, the variance trends, the update
ratio, the moment ratio, the step-loss correlation); the others are the raw extreme, so their
margins are conservative.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pathology_cases import HEALTHY  # noqa: E402

from llmtrain.config.schema import MonitorConfig  # noqa: E402
from llmtrain.monitor.detectors import (  # noqa: E402
    CORRELATION_MAX,
    OVERFIT_MIN_FALL,
    STEADY_GRADIENT,
    STEPS_JUDGED_FROM,
    SURGE_CHECKS,
)
from llmtrain.monitor.robust import robust_z, trend_factors  # noqa: E402


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == kind:
            found.append(record)
    return found


def _num(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def surge(grads: list[float], window: int, checks: int) -> float:
    """The gradient norm over the median of the checks before it, held over `checks` checks running."""
    ratios = [g / statistics.median(grads[max(0, i - window):i]) for i, g in enumerate(grads) if i >= 5]
    return held(_finite(ratios), checks, True)


def held(values: list[float], checks: int, high: bool) -> float:
    """The most extreme value a persistent alarm sees: over every run of `checks` consecutive checks,
    the least extreme one (an alarm held for `patience` checks needs all of them past its line)."""
    runs = [values[i:i + checks] for i in range(len(values) - checks + 1)]
    if high:
        return max((min(r) for r in runs), default=math.nan)
    return min((max(r) for r in runs), default=math.nan)


def variance_trend(health: list[dict], window: int, floor: float, shrink: bool, checks: int) -> float:
    """The largest growth (above `floor`) or shrink of any block's output variance over `window`
    activation samples, as the detector counts it (`trend_factors`), held over `checks` windows running."""
    samples = [h["activation_var"] for h in health if isinstance(h.get("activation_var"), list)]
    per_window = []
    for end in range(window - 1, len(samples)):
        first, mid, last = samples[end - window + 1], samples[end - window + 1 + window // 2], samples[end]
        factors = [(trend_factors(_num(a), _num(b), _num(c)), _num(c)) for a, b, c in zip(first, mid, last)]
        per_window.append(max((shrunk if shrink else grown for (grown, shrunk), level in factors
                               if shrink or level > floor), default=0.0))
    return held(per_window, checks, True)


def steady_moments(health: list[dict], checks: int) -> float:
    """Adam's first moment^2 / second moment held for `checks` checks where `steps_too_small` judges
    it: from STEPS_JUDGED_FROM, and from the check with the highest scheduled LR (the warmup's end, to
    within a check: a check early, so the figure errs high)."""
    peak = max(health, key=lambda h: _num(h.get("lr_schedule")), default={"step": 0})["step"]
    values = [_num(h.get("moment_ratio")) for h in health if h["step"] >= max(STEPS_JUDGED_FROM, peak)]
    return held(_finite(values), checks, True)


def jump(params: list[float]) -> float:
    return max((abs(b - a) / a for a, b in zip(params, params[1:]) if a > 0), default=math.nan)


def spike_z(losses: list[float], window: int) -> float:
    zs = [robust_z(v, losses[max(0, i - window):i]) for i, v in enumerate(losses) if i >= 10]
    return max(_finite(zs), default=math.nan)


def rise_above_best(losses: list[float]) -> float:
    """The largest rise of the median of 3 interval losses above the lowest such median before it."""
    best, worst = math.inf, 0.0
    for i in range(2, len(losses)):
        smoothed = statistics.median(losses[i - 2:i + 1])
        worst = max(worst, smoothed - best) if math.isfinite(best) else worst
        best = min(best, smoothed)
    return worst


def overfit_moves(train: list[tuple[int, float]], val: list[tuple[int, float]]) -> float:
    """The largest gap growth over the second half of the evaluations seen so far, when the train
    loss fell over it: the overfitting alarm's statistic (its threshold is a growth of 0.1)."""
    gaps = []
    worst = -math.inf
    for step, v in val:
        near = [loss for s, loss in train if s <= step][-3:]
        if not near:
            continue
        gaps.append((step, v - statistics.median(near)))
        if len(gaps) >= 4:
            mid = len(gaps) // 2
            worst = max(worst, gaps[-1][1] - gaps[mid - 1][1])
    return worst


@dataclass(frozen=True)
class Statistic:
    name: str
    alarm: str
    threshold: float
    higher_is_worse: bool
    of: Callable[[list[dict], list[dict], float], float]  # (health, eval, weight decay) -> the run's extreme


def statistics_for(cfg: MonitorConfig) -> list[Statistic]:
    def series(health: list[dict], key: str) -> list[float]:
        return _finite([_num(h.get(key)) for h in health])

    def blocks(health: list[dict], key: str, f: Callable[[float], float]) -> float:
        return max((f(v) for h in health for v in h.get(key) or [] if isinstance(v, (int, float))), default=math.nan)

    return [
        Statistic("largest gradient norm", "grad_norm_high", cfg.grad_norm_high, True,
                  lambda h, e, wd: max(series(h, "grad_norm"), default=math.nan)),
        Statistic("smallest gradient norm", "grad_norm_low", cfg.grad_norm_low, False,
                  lambda h, e, wd: min(series(h, "grad_norm"), default=math.nan)),
        Statistic(f"gradient norm / median of the checks before, held {SURGE_CHECKS} checks", "grad_norm_surge",
                  cfg.grad_surge_factor, True, lambda h, e, wd: surge(series(h, "grad_norm"), cfg.spike_window,
                                                                      SURGE_CHECKS)),
        Statistic("parameter norm change between checks", "param_norm_jump", cfg.param_jump, True,
                  lambda h, e, wd: jump(series(h, "param_norm"))),
        Statistic(f"update/weight ratio held {cfg.patience} checks, largest", "update_ratio_high",
                  cfg.update_ratio_high, True, lambda h, e, wd: held(series(h, "update_ratio"), cfg.patience, True)),
        Statistic(f"update/weight ratio held {cfg.patience} checks, smallest", "update_ratio_low",
                  cfg.update_ratio_low, False, lambda h, e, wd: held(series(h, "update_ratio"), cfg.patience, False)),
        Statistic("weight-decay share of the update", "weight_decay_dominant", cfg.decay_share_max, True,
                  lambda h, e, wd: max((_num(r.get("lr_applied")) * wd / _num(r.get("update_ratio"))
                                        for r in h if _num(r.get("update_ratio")) > 0), default=math.nan)),
        Statistic("largest block-output |mean|", "activation_mean_drift", cfg.activation_mean_max, True,
                  lambda h, e, wd: blocks(h, "activation_mean", abs)),
        Statistic("largest block-output variance", "activation_variance_high", cfg.activation_var_max, True,
                  lambda h, e, wd: blocks(h, "activation_var", float)),
        Statistic(f"block-output variance growth over {cfg.activation_window} samples (above "
                  f"{cfg.activation_var_floor:g}), held {cfg.activation_patience} windows",
                  "activation_variance_growing", cfg.activation_var_factor, True,
                  lambda h, e, wd: variance_trend(h, cfg.activation_window, cfg.activation_var_floor, False,
                                                  cfg.activation_patience)),
        Statistic(f"block-output variance shrink over {cfg.activation_window} samples, held "
                  f"{cfg.activation_patience} windows", "activation_variance_shrinking", cfg.activation_var_factor,
                  True, lambda h, e, wd: variance_trend(h, cfg.activation_window, cfg.activation_var_floor, True,
                                                        cfg.activation_patience)),
        Statistic(f"Adam's first moment^2 / second moment held {cfg.patience} checks after warmup",
                  "steps_too_small", STEADY_GRADIENT, True,
                  lambda h, e, wd: steady_moments(h, cfg.patience)),
        Statistic("loss robust z-score", "loss_spike", cfg.spike_z, True,
                  lambda h, e, wd: spike_z(series(h, "loss"), cfg.spike_window)),
        Statistic("smoothed loss above its best (nats)", "loss_rising", cfg.loss_rise_min, True,
                  lambda h, e, wd: rise_above_best(series(h, "interval_loss"))),
        # Judged only where the data is read in file order: how near shuffled healthy runs come to it.
        Statistic(f"step-loss successive differences / independent steps' held {cfg.patience} checks, smallest",
                  "loss_autocorrelated", CORRELATION_MAX, False,
                  lambda h, e, wd: held(series(h, "step_correlation"), cfg.patience, False)),
        Statistic("validation-train gap growth (nats)", "overfitting", OVERFIT_MIN_FALL, True,
                  lambda h, e, wd: overfit_moves([(r["step"], _num(r.get("interval_loss"))) for r in h],
                                                 [(r["step"], _num(r.get("val_loss"))) for r in e])),
    ]


def weight_decay(run_dir: Path) -> float:
    import yaml

    try:
        return float(yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["weight_decay"])
    except (OSError, KeyError, TypeError, ValueError):
        return 0.1


def calibrate(*roots: Path) -> tuple[list[dict], int]:
    """The rows over the healthy runs found in `roots` (a case found in several: the first one's)."""
    stats = statistics_for(MonitorConfig())
    found = {case.name: root / case.name for root in reversed(roots) for case in HEALTHY
             if (root / case.name / "metrics.jsonl").exists()}
    runs = list(found.values())
    rows = []
    for stat in stats:
        named = [(v, r.name) for r in runs
                 if math.isfinite(v := stat.of(records(r, "health"), records(r, "eval"), weight_decay(r)))]
        if not named:
            continue
        worst, worst_run = max(named) if stat.higher_is_worse else min(named)
        margin = (stat.threshold / worst if stat.higher_is_worse else worst / stat.threshold) if worst > 0 else math.inf
        rows.append({"statistic": stat.name, "alarm": stat.alarm, "runs": len(named),
                     "median": statistics.median(v for v, _ in named), "worst": worst, "worst_run": worst_run,
                     "threshold": stat.threshold, "margin": margin})
    return rows, len(runs)


def markdown(rows: list[dict], n_runs: int) -> str:
    lines = [f"Healthy runs read: {n_runs}. Margin: how many times the worst healthy run is from the threshold.", "",
             "| statistic | alarm | median run | worst run | threshold | margin |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['statistic']} | `{r['alarm']}` | {r['median']:.3g} | {r['worst']:.3g} ({r['worst_run']}) | "
              f"{r['threshold']:g} | {r['margin']:.2g}x |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="the pathology benchmark's --keep folder(s)")
    parser.add_argument("--markdown", type=Path, help="write the table as Markdown")
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    rows, n_runs = calibrate(*args.runs)
    if not n_runs:
        parser.error(f"{' '.join(map(str, args.runs))}: no healthy run dir of the benchmark there (run "
                     "pathologies.py --keep first)")
    table = markdown(rows, n_runs)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
