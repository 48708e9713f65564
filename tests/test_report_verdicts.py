"""The report agrees with the run: the health verdict follows the alarms that fired (with their
top-ranked cause when the record has one), a run that ends at or above the unigram baseline is not
learning, a short run is too short to judge, a flat curve is not a spike, and the loss plot draws
the baseline and the alarm steps. Fabricated records: each verdict on logs that show the case."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402

from llmtrain.runs.records import Records  # noqa: E402
from llmtrain.runs.report import build_report, write_report  # noqa: E402
from llmtrain.runs.report.alarms import alarms  # noqa: E402
from llmtrain.runs.report.health import health_quantities  # noqa: E402
from llmtrain.runs.report.learning import learning  # noqa: E402
from llmtrain.runs.report.plots import alarm_marks, draw_loss  # noqa: E402
from llmtrain.runs.report.render import render_summary  # noqa: E402
from llmtrain.runs.report.smoothness import smoothness  # noqa: E402
from llmtrain.runs.report.verdict import FAIL, NA, OK, WARN  # noqa: E402

BASELINE = 3.2492  # the default data's unigram entropy, nats/token
CAUSE = {"cause": "lr_too_high", "title": "Learning rate too high",
         "evidence": "LR 0.1 is 33x the sane maximum 3e-3 for width 128", "fix": "optim.lr=0.003", "score": 0.92}
JUMP = {"kind": "alarm", "alarm": "param_norm_jump", "step": 20, "severity": "critical", "metric": "param_norm",
        "band": "relative change <= 0.5", "action": "warn", "causes": [CAUSE, {"cause": "bad_batch", "score": 0.1}]}
DRIFT = {"kind": "alarm", "alarm": "activation_mean_drift", "step": 200, "severity": "warning",
         "metric": "activation_mean", "band": "|mean| <= 1", "action": "warn"}  # an older record: no causes


def records(events: tuple[dict, ...] = (), **by_kind: list[dict]) -> Records:
    """Records as a run's logs hold them: `by_kind` in metrics.jsonl, `events` in events.jsonl."""
    return Records([{"kind": kind, **r} for kind, written in by_kind.items() for r in written], events)


def run(losses: list[float], every: int = 10, val: float | None = None, baseline: float | None = BASELINE,
        **more: list[dict]) -> Records:
    """A run's records: a train loss every `every` steps, a final validation loss, the start record
    with the baseline."""
    train = [{"step": every * (i + 1), "loss": v} for i, v in enumerate(losses)]
    evals = [{"step": train[-1]["step"], "val_loss": val}] if val is not None else []
    start = [{"steps": train[-1]["step"], **({"unigram_entropy": baseline} if baseline else {})}]
    return records(start=start, train=train, eval=evals, **more)


def decay(first: float, last: float, n: int, rate: float = 0.1) -> list[float]:
    """n losses falling from `first` toward `last`, exponentially (a healthy curve's shape)."""
    return [last + (first - last) * math.exp(-rate * i) for i in range(n)]


# ---- the health verdict follows the alarms -------------------------------------------------------------

def test_alarms_turn_the_health_verdict_and_list_each_with_its_step_and_top_cause() -> None:
    later = {**DRIFT, "step": 300}
    logs = records(events=(JUMP, DRIFT, later), alarm=[JUMP, DRIFT, later], health=[{"step": 10, "loss": 3.0}],
                   nonfinite=[{"step": 44, "action": "skip"}])
    verdict = health_quantities(logs, ["lr.png"])
    assert verdict.status == WARN
    assert verdict.finding.startswith(
        "3 alarm(s) fired: param_norm_jump at step 20 (most likely: Learning rate too high); activation_mean_drift "
        "at steps 200, 300; 1 non-finite step(s) at step 44 (evidence and actions under the alarms question)."), \
        verdict.finding
    assert "8.2" not in verdict.finding + verdict.question
    listed = alarms(logs).details
    assert ("step 20: param_norm_jump (critical): param_norm left the band relative change <= 0.5 -> warn; most "
            "likely: Learning rate too high (LR 0.1 is 33x the sane maximum 3e-3 for width 128; fix: optim.lr=0.003)"
            ) in listed
    assert "step 200: activation_mean_drift (warning): activation_mean left the band |mean| <= 1 -> warn" \
        in listed, "a record without causes is listed as it is"
    quiet = health_quantities(records(health=[{"step": 10, "loss": 3.0}]), ["lr.png"])
    assert quiet.status == OK and quiet.finding.startswith("every health check stayed in its band")
    assert health_quantities(records(train=[{"step": 10, "loss": 3.0}]), []).status == NA  # monitor off
    skipped = health_quantities(records(health=[{"step": 10, "loss": 3.0}], nonfinite=[{"step": 7, "action": "skip"}]),
                                [])
    assert skipped.status == WARN and skipped.finding.startswith("1 non-finite step(s) at step 7 (evidence")


def test_the_alarms_verdict_names_the_most_likely_cause_and_takes_any_alarm_name() -> None:
    new = {"kind": "alarm", "alarm": "loss_not_decreasing", "step": 150, "severity": "warning", "action": "warn",
           "causes": [{"cause": "lr_too_low", "title": "Learning rate too low"}]}  # no metric, band, evidence
    verdict = alarms(records(events=(JUMP, new), alarm=[JUMP, new]))
    assert verdict.status == WARN
    assert verdict.finding == ("param_norm_jump; loss_not_decreasing; most likely cause of param_norm_jump (step 20): "
                               "Learning rate too high (details below and in events.jsonl).")
    assert "step 150: loss_not_decreasing (warning) -> warn; most likely: Learning rate too low" in verdict.details
    assert len(verdict.details) == 2, "events.jsonl's copy counts, not metrics.jsonl's as well"


# ---- did the model learn ----------------------------------------------------------------------------------

def test_a_run_that_ends_above_the_baseline_and_barely_moved_is_not_learning() -> None:
    # LR 1e-7: 5.39 -> 5.36 in 300 steps.
    verdict = learning(run([5.39 - 0.0001 * i for i in range(30)], val=5.36), BASELINE)
    assert verdict.status == FAIL
    assert verdict.finding.startswith("not learning: final val loss 5.3600 is 65% above the unigram baseline 3.2492")
    assert "barely moved from 5.3900 at step 10 (1% of the way to the baseline)" in verdict.finding
    assert verdict.finding.endswith("the model learned nothing beyond token frequencies.")


def test_a_run_stuck_on_the_baseline_plateau_is_not_learning_and_one_just_below_barely_learning() -> None:
    plateau = decay(5.5, 3.31, 3, rate=2.0) + [3.31 + 0.01 * (-1) ** i for i in range(27)]
    stuck = learning(run(plateau, val=3.31), BASELINE)
    assert stuck.status == FAIL
    assert stuck.finding.startswith("not learning: final val loss 3.3100 is 1.9% above the unigram baseline 3.2492: "
                                    "the model learned nothing beyond token frequencies"), stuck.finding
    # Deep post-LN: 2% below the baseline after 300 steps, flat.
    low = learning(run([p - 0.12 for p in plateau], val=3.19), BASELINE)
    assert low.status == WARN and low.finding.startswith(
        "barely learning: final val loss 3.1900 is 1.8% below the unigram baseline 3.2492 and no longer falling")


def test_a_healthy_run_learns_and_a_short_one_is_too_short_to_judge() -> None:
    healthy = learning(run(decay(3.29, 2.6, 10, rate=0.25), val=2.86), BASELINE)  # 100 steps, 12% below
    assert healthy.status == OK and healthy.finding.startswith(
        "learning: final val loss 2.8600 is 12% below the unigram baseline 3.2492"), healthy.finding
    # 20 steps logged every step: from 5.5 onto the token-frequency plateau, val above the baseline.
    short = learning(run(decay(5.5, 3.33, 20, rate=0.5), every=1, val=3.34), BASELINE)
    assert short.status == NA and short.finding.startswith("too short to judge: final val loss 3.3400 is 2.8% above")
    assert "only 20 steps" in short.finding
    # 90 steps, still falling steeply: above the baseline, but no verdict yet.
    early = learning(run([5.5 - 0.1 * i for i in range(9)], val=4.7), BASELINE)
    assert early.status == NA and "still falling (-0.4000 over steps 50-90)" in early.finding, early.finding
    # 200 steps at an LR far too low: still falling, but far from the baseline: slow, not short.
    slow = learning(run([5.5 - 0.05 * i for i in range(20)], val=4.55), BASELINE)
    assert slow.status == WARN and slow.finding.startswith(
        "learning slowly: final val loss 4.5500 is 40% above the unigram baseline 3.2492 after 200 steps"), slow.finding
    assert learning(run([5.5, 3.4]), BASELINE).status == NA  # two logged losses


def test_a_loss_that_trends_up_is_rising_not_a_spike() -> None:
    rising = [3.0 - 0.02 * i for i in range(10)] + [2.8 + 0.08 * i for i in range(10)]
    verdict = learning(run(rising, val=3.6), BASELINE)
    assert verdict.status == FAIL
    assert verdict.finding.startswith("the loss is rising: the train loss trends up, +0.7200 over steps 110-200")
    assert learning(run(rising, val=float("nan")), BASELINE).status == FAIL


def test_without_a_baseline_the_trend_alone_is_judged() -> None:
    assert learning(run([5.39] * 30, baseline=None, val=5.39), None).status == WARN
    moved = learning(run(decay(5.5, 2.5, 30), baseline=None, val=2.6), None)
    assert moved.status == OK and "no unigram baseline recorded" in moved.finding


# ---- a flat curve is flat -------------------------------------------------------------------------------

def test_a_flat_curve_is_not_a_spike() -> None:
    # LR 1e-8: 5.3907 +- 1e-4, one wobble 0.05 up: a huge robust z (MAD ~ 0) but a tiny rise.
    flat = [5.3907 + 0.0001 * (-1) ** i for i in range(60)]
    flat[40] = 5.4416
    verdict = smoothness(records(train=[{"step": 10 * i, "loss": v} for i, v in enumerate(flat)]), spike_z=6.0)
    assert verdict.status == OK and verdict.marks == []
    assert "no spike among 60 logged losses (the largest rise above the recent median: +0.0509 nats (0.9%, robust " \
        "z " in verdict.finding
    flat[40] = 5.6  # the same curve with a real jump: large in nats and in share
    spiky = smoothness(records(train=[{"step": 10 * i, "loss": v} for i, v in enumerate(flat)]), spike_z=6.0)
    assert spiky.status == WARN and spiky.marks == [400]


def test_the_smooth_finding_says_which_losses_were_judged() -> None:
    """The first 3 logged losses have too few before them to judge: a rise among them (step 10 above
    step 5) is no rise the sentence may deny."""
    early_rise = [3.0, 3.2, 2.9, 2.8, 2.7, 2.6]  # steps 5-30, each judged one below the median before it
    verdict = smoothness(records(train=[{"step": 5 * (i + 1), "loss": v} for i, v in enumerate(early_rise)]),
                         spike_z=6.0)
    assert verdict.status == OK
    assert "no logged loss from step 20 on rose above the median of the (up to 20) before it" in verdict.finding
    assert "no logged loss rose" not in verdict.finding
    assert "the first 3 have too few before them to judge" in verdict.details[0]


# ---- the loss plot ---------------------------------------------------------------------------------------

def test_the_loss_plot_draws_the_baseline_and_marks_the_alarm_steps() -> None:
    logs = run(decay(5.5, 2.8, 30), val=2.9, alarm=[JUMP, DRIFT], nonfinite=[{"step": 44, "action": "skip"}])
    logs.events = [JUMP, DRIFT, {**DRIFT, "step": 300}]
    marks = alarm_marks(logs)
    assert marks == {"param_norm_jump": [20], "activation_mean_drift": [200, 300], "non-finite step": [44]}
    fig, ax = plt.subplots()
    draw_loss(ax, logs, [], BASELINE, marks)
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["train", "validation", "unigram baseline 3.2492", "param_norm_jump (step 20)",
                      "activation_mean_drift (steps 200, 300)", "non-finite step (step 44)"]
    horizontal = [line for line in ax.lines if list(line.get_ydata()) == [BASELINE, BASELINE]]
    vertical = sorted(line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":")
    assert len(horizontal) == 1 and horizontal[0].get_linestyle() == "--"
    assert vertical == [20, 44, 200, 300]
    plt.close(fig)


def test_the_written_report_of_a_sick_run_says_so(tmp_path: Path) -> None:
    lines = [{"kind": "start", "steps": 300, "unigram_entropy": BASELINE}]
    lines += [{"kind": "train", "step": 10 * (i + 1), "loss": 5.39 - 0.0001 * i} for i in range(30)]
    lines += [{"kind": "health", "step": 10 * (i + 1), "loss": 5.39 - 0.0001 * i} for i in range(30)]
    lines += [{"kind": "eval", "step": 300, "val_loss": 5.36}, JUMP]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "events.jsonl").write_text(json.dumps(JUMP) + "\n")
    report = write_report(tmp_path, inference=False)
    assert (tmp_path / "report" / "loss.png").is_file()
    markdown = (tmp_path / "report.md").read_text()
    assert "| Did the model learn? | **fail** | not learning: final val loss 5.3600 is 65% above" in markdown
    assert "**warn**: 1 alarm(s) fired: param_norm_jump at step 20 (most likely: Learning rate too high)" in markdown
    assert "| unigram baseline | 3.2492 nats/token" in markdown
    assert "8.2" not in markdown and ": ok" not in markdown.split("## The health quantities over the run")[1]
    console = Console(file=io.StringIO(), width=200)
    render_summary(report, console)
    assert "Did the model learn?" in console.file.getvalue() and "fail" in console.file.getvalue()
    assert {v.key: v.status for v in build_report(tmp_path, inference_check=False).verdicts}["smoothness"] == OK
