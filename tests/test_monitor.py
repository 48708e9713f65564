"""Each detector on synthetic metric streams: fires on its pattern, stays silent on noise."""

from __future__ import annotations

import random

import pytest

from llmtrain.config.schema import ALARM_NAMES, MonitorAction, MonitorConfig
from llmtrain.health.catalog import CATALOG, explain
from llmtrain.health.detectors import HealthMonitor, Sample, robust_z, theil_sen_slope


def sample(step: int, **kw: object) -> Sample:
    base = dict(loss=3.0, grad_norm=1.0, block_grad_norms=[0.5, 0.6, 0.7], param_norm=100.0,
                lr_applied=1e-3, lr_schedule=1e-3, rss_mb=500.0, steps_total=10_000)
    base.update(kw)
    return Sample(step=step, **base)  # type: ignore[arg-type]


def run(stream: list[Sample], cfg: MonitorConfig | None = None) -> dict[str, int]:
    """Feed a stream; return {alarm name: step it was first raised}."""
    monitor = HealthMonitor(cfg or MonitorConfig())
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
            block_grad_norms=[abs(rng.gauss(0.5, 0.1)) + 0.05 for _ in range(3)], param_norm=100 + 0.01 * i + rng.gauss(0, 0.05),
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
    monitor = HealthMonitor(MonitorConfig())
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
    end = noisy(20, steps_total=20)
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
    monitor = HealthMonitor(cfg)
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
    monitor = HealthMonitor(MonitorConfig(cooldown_checks=10))
    first = monitor.action_for("grad_norm_high")
    second = monitor.action_for("grad_norm_high")
    assert (first, second) == (MonitorAction.reduce_lr, MonitorAction.warn)


def test_state_round_trip_keeps_windows_and_active_alarms() -> None:
    stream = noisy(30)
    for s in stream[10:]:
        s.grad_norm = 500.0
    a = HealthMonitor(MonitorConfig())
    for s in stream[:20]:
        a.check(s)
    b = HealthMonitor(MonitorConfig())
    b.load_state_dict(a.state_dict())
    assert b.active == a.active == {"grad_norm_high"} and b.checks == 20
    assert [x.name for s in stream[20:] for x in b.check(s)] == [], "an active alarm is not raised again after resume"


def test_helpers() -> None:
    assert theil_sen_slope([1, 2, 3, 100, 5, 6]) == pytest.approx(1.0)
    assert robust_z(10.0, [1.0, 1.1, 0.9, 1.0, 1.05]) > 50
