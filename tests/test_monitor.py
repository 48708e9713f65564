"""Each detector on synthetic metric streams: fires on its pattern, stays silent on noise."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from llmtrain.config.schema import ALARM_NAMES, MonitorAction, MonitorConfig
from llmtrain.monitor.catalog import CATALOG, explain
from llmtrain.monitor.detectors import Alarm, Detectors, Sample
from llmtrain.monitor.diagnosis import RunFacts
from llmtrain.monitor.robust import robust_z, theil_sen_slope


def sample(step: int, **kw: object) -> Sample:
    base = dict(loss=3.0, grad_norm=1.0, block_grad_norms=[0.5, 0.6, 0.7], param_norm=100.0,
                lr_applied=1e-3, lr_schedule=1e-3, rss_mb=500.0, total_steps=10_000)
    base.update(kw)
    return Sample(step=step, **base)  # type: ignore[arg-type]


def run(stream: list[Sample], cfg: MonitorConfig | None = None) -> dict[str, int]:
    """Feed a stream; return {alarm name: step it was first raised}."""
    monitor = Detectors(cfg or MonitorConfig())
    first: dict[str, int] = {}
    for s in stream:
        for alarm in monitor.check(s):
            first.setdefault(alarm.name, s.step)
    return first


def noisy(n: int, seed: int = 0, **kw: object) -> list[Sample]:
    """A healthy run: everything in band, with realistic noise and a slowly falling loss."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        act = i % 10 == 0
        out.append(sample(
            i + 1, loss=3.0 - 0.001 * i + rng.gauss(0, 0.05), grad_norm=abs(rng.gauss(1.0, 0.3)) + 0.1,
            block_grad_norms=[abs(rng.gauss(0.5, 0.1)) + 0.05 for _ in range(3)],
            param_norm=100 + 0.01 * i + rng.gauss(0, 0.05),
            rss_mb=500 + rng.gauss(0, 3), activation_mean=[rng.gauss(0, 0.05) for _ in range(3)] if act else None,
            activation_var=[1 + rng.gauss(0, 0.1) for _ in range(3)] if act else None, **kw,
        ))
    return out


def test_healthy_noise_raises_nothing() -> None:
    for seed in range(5):
        assert run(noisy(400, seed)) == {}, f"seed {seed}"


def test_every_alarm_has_a_catalog_entry_with_causes_and_checks() -> None:
    assert set(ALARM_NAMES) <= set(CATALOG)
    for name in ALARM_NAMES:
        text = explain(name)
        assert CATALOG[name].causes and CATALOG[name].checks and name in text or CATALOG[name].title in text


@pytest.mark.parametrize(("value", "name"), [(500.0, "grad_norm_high"), (1e-5, "grad_norm_low")])
def test_grad_norm_band_needs_persistence(value: float, name: str) -> None:
    stream = noisy(20)
    stream[10].grad_norm = value  # a single point: no alarm
    assert name not in run(stream)
    stream = noisy(20)
    for s in stream[10:13]:
        s.grad_norm = value
    assert run(stream).get(name) == 13  # the third consecutive check


def test_starved_blocks_raise_grad_norm_low_with_the_blocks_named() -> None:
    stream = noisy(10)
    for s in stream:
        s.block_grad_norms = [1e-9, 1e-9, 1e-9]
    monitor = Detectors(MonitorConfig())
    alarms = [a for s in stream for a in monitor.check(s)]
    assert [a.name for a in alarms] == ["grad_norm_low"] and alarms[0].blocks == [0, 1, 2]


def test_tiny_early_layer_gradients() -> None:
    stream = noisy(10)
    for s in stream:
        s.block_grad_norms = [1e-6, 0.3, 0.5]
    assert run(stream).get("grad_norm_low_early_layers") == 3


def test_param_norm_jump_and_steady_decrease() -> None:
    stream = noisy(30)
    for s in stream[15:]:
        s.param_norm *= 2.0
    assert run(stream).get("param_norm_jump") == 16
    decreasing = noisy(60)
    for i, s in enumerate(decreasing):
        s.param_norm = 100 - 0.5 * i + random.Random(i).gauss(0, 0.05)
    assert "param_norm_decrease" in run(decreasing)
    assert "param_norm_decrease" not in run(noisy(60))


def test_lr_zero_and_exploding() -> None:
    stream = noisy(20)
    for s in stream[5:]:
        s.lr_applied = s.lr_schedule = 0.0  # a schedule at zero with 9,980 steps to go
    assert run(stream).get("lr_zero") == 8
    end = noisy(20, total_steps=20)
    end[-1].lr_applied = end[-1].lr_schedule = 0.0  # zero on the last step is a schedule ending
    assert "lr_zero" not in run(end)
    exploding = noisy(20)
    for s in exploding[5:]:
        s.lr_applied = 1.0
    assert run(exploding).get("lr_exploding") == 8


def test_activation_mean_drift_and_variance_trends() -> None:
    cfg = MonitorConfig(activation_window=5)
    drift = noisy(100)
    for s in drift:
        if s.activation_mean is not None:
            s.activation_mean = [0.0, 3.0, 0.0]
    monitor = Detectors(cfg)
    raised = [a for s in drift for a in monitor.check(s)]
    assert [a.name for a in raised] == ["activation_mean_drift"], "raised once, not at every sample"
    assert raised[0].blocks == [1]

    growing, shrinking = noisy(100), noisy(100)
    k = 0
    for g, s in zip(growing, shrinking):
        if g.activation_var is not None:
            g.activation_var = [1.0, 2.0 ** (2 * k), 1.0]
            s.activation_var = [1.0, 1.0, 0.5 ** (2 * k)]
            k += 1
    assert "activation_variance_growing" in run(growing, cfg)
    assert "activation_variance_shrinking" in run(shrinking, cfg)


def test_memory_leak_is_a_robust_trend_after_warmup() -> None:
    leak = noisy(60)
    for i, s in enumerate(leak):
        s.rss_mb = 500 + 20 * i
    assert "memory_leak" in run(leak)
    one_jump = noisy(60)
    for s in one_jump[30:]:
        s.rss_mb += 1000  # a one-off allocation (a bigger batch, a cache) is not a leak
    assert "memory_leak" not in run(one_jump)


def test_loss_spike_by_robust_z_score() -> None:
    stream = noisy(80)
    stream[60].loss = 9.0
    assert run(stream).get("loss_spike") == 61
    assert "loss_spike" not in run(noisy(80))


def test_fp16_without_scaler_fires_at_once() -> None:
    assert run(noisy(3, fp16_without_scaler=True)).get("fp16_no_scaler") == 1


def test_reduce_lr_has_a_cooldown() -> None:
    monitor = Detectors(MonitorConfig(cooldown_checks=10))
    first = monitor.action_for("grad_norm_high")
    second = monitor.action_for("grad_norm_high")
    assert (first, second) == (MonitorAction.reduce_lr, MonitorAction.warn)


def test_state_round_trip_keeps_windows_and_active_alarms() -> None:
    stream = noisy(30)
    for s in stream[10:]:
        s.grad_norm = 500.0
    a = Detectors(MonitorConfig())
    for s in stream[:20]:
        a.check(s)
    b = Detectors(MonitorConfig())
    b.load_state_dict(a.state_dict())
    assert b.active == a.active == {"grad_norm_high", "grad_norm_surge"} and b.checks == 20
    assert [x.name for s in stream[20:] for x in b.check(s)] == [], "an active alarm is not raised again after resume"


def test_helpers() -> None:
    assert theil_sen_slope([1, 2, 3, 100, 5, 6]) == pytest.approx(1.0)
    assert robust_z(10.0, [1.0, 1.1, 0.9, 1.0, 1.05]) > 50


# ---- learning progress and the new bands (with the run's facts: baseline and chance) ---------------
FACTS = RunFacts(lr=3e-3, lr_low=1e-4, lr_high=9e-3, n_embd=128, n_layer=3, warmup_steps=50, total_steps=10_000,
                 schedule_steps=10_000, init_gain=0.05, init_std=0.02, baseline=3.25, chance=5.55)


def run_with(stream: list[Sample], facts: RunFacts = FACTS, cfg: MonitorConfig | None = None) -> dict[str, Alarm]:
    """Feed a stream to a monitor that knows the run's facts; {alarm name: the first alarm}."""
    monitor = Detectors(cfg or MonitorConfig(), facts)
    first: dict[str, Alarm] = {}
    for s in stream:
        for alarm in monitor.check(s):
            first.setdefault(alarm.name, alarm)
    return first


def checks_every(n: int, interval: int = 10, seed: int = 0, **kw: object) -> list[Sample]:
    """A healthy run sampled every `interval` steps: steps 10, 20, ...; the loss falls below the baseline."""
    stream = noisy(n, seed, **kw)
    for i, s in enumerate(stream):
        s.step = (i + 1) * interval
        s.loss = s.interval_loss = 2.9 - 0.002 * i + random.Random(seed + i).gauss(0, 0.05)
    return stream


def test_healthy_runs_raise_nothing_with_the_facts() -> None:
    for seed in range(5):
        assert run_with(checks_every(200, seed=seed)) == {}, f"seed {seed}"


def test_a_loss_far_above_chance_is_critical_at_the_first_check() -> None:
    stream = checks_every(5)
    stream[0].loss = stream[0].interval_loss = 18.7
    alarm = run_with(stream)["loss_above_chance"]
    assert (alarm.step, alarm.severity) == (10, "critical")


def test_a_loss_that_never_leaves_chance_is_not_learning() -> None:
    flat = checks_every(30)
    for s in flat:
        s.loss = s.interval_loss = 5.39 + random.Random(s.step).gauss(0, 1e-4)
    raised = run_with(flat)
    assert raised["loss_not_decreasing"].step == 100  # judged from monitor.progress_after
    assert "loss_spike" not in raised, "a flat curve is not a spike"


def test_a_loss_stuck_at_the_unigram_baseline_is_not_learning_but_one_still_falling_is() -> None:
    stuck = checks_every(30)
    for s in stuck:
        s.loss = s.interval_loss = 3.25 + random.Random(s.step).gauss(0, 0.03)
    assert "loss_not_decreasing" in run_with(stuck)
    falling = checks_every(30)
    for i, s in enumerate(falling):  # a harder corpus: above the baseline for a while, but clearly learning
        s.loss = s.interval_loss = 4.2 - 0.03 * i
    assert "loss_not_decreasing" not in run_with(falling)


def test_a_rising_loss_is_divergence_not_a_spike() -> None:
    stream = checks_every(20)
    for i, s in enumerate(stream[8:]):
        s.loss = s.interval_loss = 2.9 + 0.08 * (i + 1)
    raised = run_with(stream)
    assert raised["loss_rising"].step <= 140
    one = checks_every(20)
    one[10].loss = one[10].interval_loss = 3.6  # one bad interval: no trend
    assert "loss_rising" not in run_with(one)


def test_update_ratio_bands_need_persistence() -> None:
    low = checks_every(10, update_ratio=2e-6)
    assert run_with(low)["update_ratio_low"].step == 30
    high = checks_every(10)
    high[4].update_ratio = 0.5
    assert "update_ratio_high" not in run_with(high)


def test_a_sudden_rise_of_the_gradient_norm_and_a_persistently_high_one() -> None:
    surge = checks_every(12)
    surge[8].grad_norm = 40.0
    assert "grad_norm_surge" not in run_with(surge), "one hard batch: clipping's job"
    surge[9].grad_norm = 40.0
    assert run_with(surge)["grad_norm_surge"].step == 100
    sick = checks_every(6)
    for s, g in zip(sick[:3], (190.0, 44.0, 35.0)):  # init std 1.0: all above 10, one above 100
        s.grad_norm = g
    assert run_with(sick)["grad_norm_high"].step == 30


def test_frozen_blocks_are_named_and_critical() -> None:
    stream = checks_every(5)
    for s in stream:
        s.block_grad_norms = [0.0, 1e-7, 0.4]
    alarm = run_with(stream)["grad_norm_low_early_layers"]
    assert alarm.blocks == [0, 1] and alarm.severity == "critical"


def test_the_schedule_ending_before_the_run() -> None:
    facts = dataclasses.replace(FACTS, schedule_steps=100, total_steps=300, schedule_floor=0.0)
    alarm = run_with(checks_every(20), facts)["schedule_ended"]
    assert alarm.step == 110 and alarm.causes[0].cause == "schedule_ended"


def test_a_fresh_models_signals_growing_to_unit_scale_is_not_an_alarm() -> None:
    """nanoGPT's shakespeare-char recipe: the first block's output variance grows 0.0024 -> 0.029 over
    its first 100 steps, as a fresh model's small signals do while it learns; the same growth above
    unit scale (a stream heading for a blow-up) still alarms."""
    fresh = [0.0024, 0.0034, 0.0062, 0.0128, 0.0286, 0.0488, 0.075]

    def stream(scale: float) -> list[Sample]:
        samples = [s for s in checks_every(100, interval=1) if s.activation_var is not None][:len(fresh)]
        for s, var in zip(samples, fresh):
            s.activation_var = [var * scale, 1.0, 1.0]
        return samples

    assert "activation_variance_growing" not in run_with(stream(1.0))
    assert "activation_variance_growing" in run_with(stream(100.0))


def test_activation_variance_far_above_its_level() -> None:
    stream = checks_every(100, interval=1)
    for s in stream:
        if s.activation_var is not None:
            s.activation_var = [1.0, 1.0, 2e5]
    alarm = run_with(stream)["activation_variance_high"]
    assert alarm.blocks == [2]


def test_param_norm_decrease_not_once_the_norm_turned_back_up() -> None:
    turned = noisy(20)
    for i, s in enumerate(turned):  # fell for 14 checks, rising again over the last 6 (LR 0.1: 207.6 ... 227)
        s.param_norm = 300 - 5 * i if i < 14 else 235 + 4 * (i - 13)
    assert "param_norm_decrease" not in run(turned)
    for i, s in enumerate(turned):
        s.param_norm = 300 - 5 * i  # still falling at the end
    assert "param_norm_decrease" in run(turned)


def test_alarms_carry_their_ranked_causes_in_the_record() -> None:
    stream = checks_every(5)
    stream[0].loss = stream[0].interval_loss = 18.7
    facts = dataclasses.replace(FACTS, init_std=1.0, init_gain=128.0, fixes={"init variance": "model.init_std=0.09"})
    record = run_with(stream, facts)["loss_above_chance"].to_record()
    assert record["causes"][0]["cause"] == "init_too_large" and record["causes"][0]["fix"] == "model.init_std=0.09"
    text = run_with(stream, facts)["loss_above_chance"].explain()
    assert "1. Initialization too large (init std 1" in text and "-> model.init_std=0.09" in text


def test_state_round_trip_keeps_the_best_loss() -> None:
    a = Detectors(MonitorConfig(), FACTS)
    for s in checks_every(20):
        a.check(s)
    b = Detectors(MonitorConfig(), FACTS)
    b.load_state_dict(a.state_dict())
    assert (b.best_loss, b.best_check, b.update_ratio) == (a.best_loss, a.best_check, a.update_ratio)
    older = a.state_dict()
    for key in ("best_loss", "best_check", "update_ratio"):
        del older[key]
    b.load_state_dict(older)  # a checkpoint from before these windows existed
    assert b.best_loss == float("inf")


def test_every_alarm_but_the_configuration_one_has_a_dashboard_row() -> None:
    from llmtrain.metrics.dashboard import ALARMS_BY_METRIC

    shown = [name for names in ALARMS_BY_METRIC.values() for name in names]
    assert sorted(shown) == sorted(set(ALARM_NAMES) - {"fp16_no_scaler"})


def test_loss_swinging_beyond_its_steps_noise_means_correlated_batches() -> None:
    def stream(swing: float) -> list[Sample]:
        out = checks_every(30)
        for i, s in enumerate(out):  # steps' noise 0.15 -> the mean of 10 steps varies by 0.05
            s.interval_loss_var, s.interval_steps = 0.15**2, 10
            s.loss = s.interval_loss = 2.9 + (swing if i % 2 else -swing) + random.Random(i).gauss(0, 0.05)
        return out
    assert run_with(stream(0.4))["loss_oscillating"].step == 120  # judged from step 100, for `patience` checks
    assert "loss_oscillating" not in run_with(stream(0.0)), "shuffled batches vary by their noise"
    for seed in range(10):  # fast early learning with little step noise (a large batch) is a curve, not swings
        rng = random.Random(seed)
        smooth = checks_every(30)
        for s in smooth:
            s.interval_loss_var, s.interval_steps = 0.0025, 10
            s.loss = s.interval_loss = 2 + 3 * math.exp(-s.step / 40) + rng.gauss(0, (0.0025 / 10) ** 0.5)
        assert "loss_oscillating" not in run_with(smooth), seed


def test_weight_decay_that_makes_the_update() -> None:
    strong = dataclasses.replace(FACTS, weight_decay=10.0)
    stream = checks_every(6, lr_applied=3e-3, update_ratio=0.02)  # lr x wd = 0.03 against an update of 0.02
    alarm = run_with(stream, strong)["weight_decay_dominant"]
    assert alarm.step == 30 and alarm.causes[0].cause == "weight_decay_too_high"
    usual = dataclasses.replace(FACTS, weight_decay=0.1)  # 3e-4 against 0.015: a 2% share
    assert "weight_decay_dominant" not in run_with(checks_every(6, lr_applied=3e-3, update_ratio=0.015), usual)


def _train_then_evaluate(monitor: Detectors, train: list[float], val: list[float], every: int = 5) -> list[Alarm]:
    """Checks every 10 steps with these interval losses; an evaluation after every `every` checks."""
    raised = []
    for i, loss in enumerate(train):
        monitor.check(sample((i + 1) * 10, loss=loss, interval_loss=loss))
        if (i + 1) % every == 0:
            raised += monitor.validation((i + 1) * 10, val[(i + 1) // every - 1])
    return raised


def test_overfitting_at_run_time_a_widening_gap_with_validation_flat() -> None:
    """A 12 kB corpus: the train loss falls 2.0 -> 1.7 while validation stays at 2.5."""
    train = [2.0 - 0.3 * i / 39 for i in range(40)]
    val = [2.6, 2.52, 2.51, 2.53, 2.52, 2.54, 2.53, 2.54]
    raised = _train_then_evaluate(Detectors(MonitorConfig(), FACTS), train, val)
    assert [a.name for a in raised] == ["overfitting"]
    cause = raised[0].causes[0]
    assert cause.cause == "overfitting" and "gap grew" in cause.evidence
    assert cause.fix == "max_steps=150"  # the best validation loss was at step 150 (after 3 evaluations)


def test_no_overfitting_alarm_while_validation_follows_training() -> None:
    train = [2.0 - 0.3 * i / 39 for i in range(40)]
    val = [2.1 - 0.3 * i / 7 + 0.02 * (-1) ** i for i in range(8)]  # a constant gap of ~0.1, noisy
    assert _train_then_evaluate(Detectors(MonitorConfig(), FACTS), train, val) == []
    # Survives a checkpoint: the evaluations so far are part of the monitor's state.
    a = Detectors(MonitorConfig(), FACTS)
    _train_then_evaluate(a, train[:20], val[:4])
    b = Detectors(MonitorConfig(), FACTS)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.val, b.gaps) == (a.val, a.gaps)


def test_a_fresh_models_first_rise_or_its_fall_from_that_peak_is_not_an_alarm() -> None:
    """Block-output variances of two healthy runs, one sample every 20 steps from step 20 (measured):
    modern_tiny with BPE 1024, whose first block rises 1,100x by step 100 and then holds; llama_tiny
    with SGD, whose second block peaks at step 40 and settles 10x lower. Each fills one trend window
    and is gone from the next; the same shapes kept up sample after sample still alarm."""
    rise = [0.059, 4.04, 14.8, 31.1, 65.6, 66.1, 58.5]
    fall = [0.0594, 0.1354, 0.0317, 0.0498, 0.02, 0.0127, 0.0106]

    def stream(values: list[float]) -> list[Sample]:
        samples = [s for s in checks_every(100, interval=1) if s.activation_var is not None][:len(values)]
        for s, var in zip(samples, values):
            s.activation_var = [var, 1.0]
        return samples

    assert "activation_variance_growing" not in run_with(stream(rise))
    assert "activation_variance_shrinking" not in run_with(stream(fall))
    assert "activation_variance_growing" in run_with(stream([10.0 * 3.0 ** k for k in range(7)]))
    assert "activation_variance_shrinking" in run_with(stream([1e3 / 3.0 ** k for k in range(7)]))
