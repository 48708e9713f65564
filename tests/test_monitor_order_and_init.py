"""Two detectors that read a configuration's risk against the run's own numbers: consecutive steps'
losses moving together where the data is read in file order, and a loss resting at the unigram
baseline where the init is far below its healthy band."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import deque

import pytest
import torch

from llmtrain.config.schema import MonitorConfig
from llmtrain.monitor.detectors import CORRELATION_MAX, Detectors, Sample
from llmtrain.monitor.diagnosis import RunFacts
from llmtrain.monitor.robust import independent_ratio
from llmtrain.monitor.watch import interval_stats

FACTS = RunFacts(lr=3e-3, lr_low=1e-4, lr_high=9e-3, n_embd=128, n_layer=3, warmup_steps=50, total_steps=10_000,
                 schedule_steps=10_000, init_gain=0.05, init_std=0.02, baseline=3.25, chance=5.55)
UNSHUFFLED = dataclasses.replace(FACTS, shuffled=False)


def residual_sums(losses: list[float]) -> tuple[float, float]:
    """What interval_stats reports for these steps: the residuals' and their differences' squares."""
    stats = interval_stats(deque(torch.tensor([v]) for v in losses), torch.tensor(0.0)).tolist()
    return stats[3], stats[4]


def steps(rho: float, n: int, seed: int) -> list[float]:
    """n step losses: a falling trend plus AR(1) noise of lag-1 correlation `rho`."""
    rng = random.Random(seed)
    out, e = [], rng.gauss(0, 0.2)
    for i in range(n):
        e = rho * e + (1 - rho * rho) ** 0.5 * rng.gauss(0, 0.2)
        out.append(3.0 - 0.002 * i + e)
    return out


def stream(rho: float, checks: int = 30, seed: int = 0, interval: int = 10) -> list[Sample]:
    """Checks every `interval` steps over AR(1) step losses, as the watch would report them."""
    losses = steps(rho, checks * interval, seed)
    out = []
    for c in range(checks):
        chunk = losses[c * interval:(c + 1) * interval]
        ss, ssd = residual_sums(chunk)
        mean = sum(chunk) / len(chunk)
        out.append(Sample(step=(c + 1) * interval, loss=chunk[-1], grad_norm=1.0, block_grad_norms=[0.5, 0.6],
                          param_norm=100.0, lr_applied=3e-3, lr_schedule=3e-3, rss_mb=500.0, total_steps=10_000,
                          interval_loss=mean, interval_loss_var=0.04, interval_steps=interval,
                          interval_resid_ss=ss, interval_resid_ssd=ssd))
    return out


def raised(samples: list[Sample], facts: RunFacts) -> dict[str, int]:
    monitor = Detectors(MonitorConfig(), facts)
    first: dict[str, int] = {}
    for s in samples:
        for alarm in monitor.check(s):
            first.setdefault(alarm.name, s.step)
    return first


def test_interval_stats_take_the_trend_out_before_comparing_neighbours() -> None:
    ss, ssd = residual_sums([3.0 - 0.1 * i for i in range(10)])  # a straight line: no residual at all
    assert ss < 1e-10 and ssd < 1e-10
    values = [3.0, 3.4, 2.9, 3.3, 2.8, 3.1]
    t = [i - 2.5 for i in range(6)]
    mean = sum(values) / 6
    slope = sum(a * (v - mean) for a, v in zip(t, values)) / sum(a * a for a in t)
    r = [v - mean - slope * a for v, a in zip(values, t)]
    ss, ssd = residual_sums(values)
    assert abs(ss - sum(x * x for x in r)) < 1e-5
    assert abs(ssd - sum((b - a) ** 2 for a, b in zip(r, r[1:]))) < 1e-5
    assert residual_sums([3.0, 3.1, 2.9]) == (0.0, 0.0)  # too few steps to judge
    assert residual_sums([3.0, float("nan"), 2.9, 3.2, 3.0]) == (0.0, 0.0)  # a skipped step breaks the chain


def test_independent_ratio_is_what_independent_steps_give() -> None:
    for n in (5, 10, 20):
        rng = random.Random(n)
        ss = ssd = 0.0
        for _ in range(3000):
            a, b = residual_sums([rng.gauss(0, 1) for _ in range(n)])
            ss, ssd = ss + a, ssd + b
        assert abs(ssd / ss / independent_ratio(n) - 1) < 0.03, n


def test_steps_in_file_order_that_move_together_raise_an_alarm_that_blames_the_order() -> None:
    monitor = Detectors(MonitorConfig(), UNSHUFFLED)
    alarms = [a for s in stream(0.6) for a in monitor.check(s) if a.name == "loss_autocorrelated"]
    # judged from step 100 (monitor.progress_after) once 10 intervals are in, for `patience` checks
    assert alarms[0].step == 120 and alarms[0].values[0] < CORRELATION_MAX
    assert alarms[0].causes[0].cause == "data_unshuffled"
    assert "data.shuffle=true" in (alarms[0].causes[0].fix or "") or alarms[0].causes[0].fix is None


def test_independent_steps_in_file_order_and_any_shuffled_run_are_left_alone() -> None:
    # Homogeneous text read in order does no harm: its steps are independent draws, and the pooled
    # ratio falls below the bound for 3 checks in a row in few of 40 such runs of 300 steps.
    wrong = sum("loss_autocorrelated" in raised(stream(0.0, seed=seed), UNSHUFFLED) for seed in range(40))
    assert wrong <= 4, wrong
    # A shuffled run's steps are independent by construction; what correlation the optimizer's
    # momentum gives them is not a data-order fault.
    assert "loss_autocorrelated" not in raised(stream(0.6), FACTS)


def test_the_correlation_window_survives_a_checkpoint() -> None:
    a = Detectors(MonitorConfig(), UNSHUFFLED)
    samples = stream(0.6)
    for s in samples[:11]:
        a.check(s)
    b = Detectors(MonitorConfig(), UNSHUFFLED)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert list(b.residuals) == list(a.residuals)
    later = [x.name for s in samples[11:] for x in b.check(s)]
    assert later == [x.name for s in samples[11:] for x in a.check(s)] and "loss_autocorrelated" in later
    older = a.state_dict()
    del older["residuals"]
    b.load_state_dict(older)  # a checkpoint from before the window existed starts it empty
    assert not b.residuals


def plateau(level: float, checks: int = 20) -> list[Sample]:
    """A fall from chance to `level`, then a long rest there that creeps down 0.01 a check."""
    out = []
    for c in range(checks):
        loss = 5.5 if c == 0 else level - 0.01 * c + random.Random(c).gauss(0, 0.02)
        out.append(Sample(step=(c + 1) * 10, loss=loss, grad_norm=1.0, block_grad_norms=[0.01, 0.02],
                          param_norm=100.0, lr_applied=3e-3, lr_schedule=3e-3, rss_mb=500.0, total_steps=10_000,
                          interval_loss=loss))
    return out


def test_a_tiny_init_resting_at_the_unigram_baseline_is_not_learning() -> None:
    tiny = dataclasses.replace(FACTS, init_std=1e-6, init_gain=128e-12)
    monitor = Detectors(MonitorConfig(), tiny)
    alarms = [a for s in plateau(3.3) for a in monitor.check(s)]
    assert [a.name for a in alarms] == ["loss_not_decreasing"] and alarms[0].step == 100
    assert alarms[0].causes[0].cause == "init_too_small" and "an init this small" in alarms[0].band
    # The same rest with a healthy init is judged by its trend: still creeping down, it is learning.
    assert "loss_not_decreasing" not in raised(plateau(3.3), FACTS)
    # And a tiny init whose loss left the baseline behind learned its way out.
    assert "loss_not_decreasing" not in raised(plateau(2.8), tiny)


def adam_checks(steady: float, update: float, checks: int = 12, warmup: int = 20) -> dict[str, object]:
    """Checks every 10 steps with this moment ratio and update ratio; {alarm: the first one}."""
    monitor = Detectors(MonitorConfig(), dataclasses.replace(FACTS, warmup_steps=warmup, eps=0.1, n_params=800_000))
    first: dict[str, object] = {}
    for c in range(checks):
        s = Sample(step=(c + 1) * 10, loss=2.9, grad_norm=0.8, block_grad_norms=[0.3, 0.4], param_norm=100.0,
                   lr_applied=3e-3, lr_schedule=3e-3, rss_mb=500.0, total_steps=10_000, interval_loss=2.9,
                   update_ratio=update, moment_ratio=steady)
        for alarm in monitor.check(s):
            first.setdefault(alarm.name, alarm)
    return first


def test_the_same_gradient_step_after_step_with_tiny_steps_is_learning_slowly() -> None:
    alarm = adam_checks(steady=0.9, update=7e-5)["steps_too_small"]
    assert alarm.step == 70  # judged from step 50, after the warmup, for `patience` checks
    assert alarm.causes[0].cause == "eps_too_large"  # epsilon 0.1 against gradient elements of ~1e-3
    # A noisy gradient (the usual ~0.05), or ordinary steps along a steady one (a large batch), is not it.
    assert "steps_too_small" not in adam_checks(steady=0.05, update=7e-5)
    assert "steps_too_small" not in adam_checks(steady=0.9, update=3e-3)
    # Nor a warmup still under way: its first steps are small by design.
    assert "steps_too_small" not in adam_checks(steady=0.9, update=7e-5, warmup=200)


def test_moment_sums_read_adams_state_and_nothing_else() -> None:
    from llmtrain.monitor.probes import moment_sums

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    params = list(layer.parameters())
    adam = torch.optim.AdamW(params, lr=1e-3)
    assert moment_sums(adam, params).tolist() == [0.0, 0.0]  # no state before the first step
    for _ in range(3):
        layer(torch.randn(4, 8)).pow(2).mean().backward()
        adam.step()
        adam.zero_grad()
    first, second = moment_sums(adam, params).tolist()
    want_first = sum(float(adam.state[p]["exp_avg"].pow(2).sum()) for p in params)
    want_second = sum(float(adam.state[p]["exp_avg_sq"].sum()) for p in params)
    assert first == pytest.approx(want_first, rel=1e-5) and second == pytest.approx(want_second, rel=1e-5)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    layer(torch.randn(4, 8)).pow(2).mean().backward()
    sgd.step()
    assert moment_sums(sgd, params).tolist() == [0.0, 0.0]  # momentum only: no second moment


def test_after_a_repair_the_pattern_must_persist_again_before_it_is_raised(tmp_path) -> None:
    import io

    from rich.console import Console

    from llmtrain.config.schema import ModelConfig
    from llmtrain.metrics.dashboard import Dashboard
    from llmtrain.metrics.writer import NullMetricsWriter
    from llmtrain.model import GPT
    from llmtrain.monitor.watch import Monitor

    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32), 16)
    facts = dataclasses.replace(FACTS, warmup_steps=20, eps=0.1, n_params=800_000)
    watch = Monitor(MonitorConfig(), model, tmp_path, Dashboard(0, Console(file=io.StringIO())), NullMetricsWriter(),
                    total_steps=10_000, write_events=False, facts=facts)

    def judged(step: int) -> list[str]:
        s = Sample(step=step, loss=2.9, grad_norm=0.8, block_grad_norms=[0.3, 0.4], param_norm=100.0,
                   lr_applied=3e-3, lr_schedule=3e-3, rss_mb=500.0, total_steps=10_000, interval_loss=2.9,
                   update_ratio=7e-5, moment_ratio=0.9)
        return [a.name for a in watch.monitor.check(s)]

    raised = [step for step in range(10, 80, 10) if "steps_too_small" in judged(step)]
    assert raised == [70]
    watch.judge_afresh("steps_too_small")  # a repair at step 70; the moments still say so at 80 and 90
    assert [step for step in range(80, 110, 10) if "steps_too_small" in judged(step)] == [100]
