"""Time from the first line: the banner's estimate (the check's figure, from the rate measured at
start-up), the ETA of the bar and of the log lines after one step and as it refines, and every
step logged when steps are slow. The clock is a fake one: nothing sleeps."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from llmtrain.engine.precision import NumericPrecision
from llmtrain.engine.state import TrainResult, TrainState
from llmtrain.engine.timing import StepTimer
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.preflight.check import run_check
from llmtrain.preflight.compute import ComputeEstimate, format_seconds
from llmtrain.training.eta import StepClock, clock_text
from llmtrain.training.loop import train
from llmtrain.training.progress import Progress
from llmtrain.training.throughput import NullSlowdownWatch

from .conftest import tiny_config

RATE = 50e9  # the matmul rate "measured" at start-up


def test_the_banner_states_the_checks_estimate_measured_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llmtrain.training.setup.matmul_peak_flops", lambda device, dtype=None, repeats=8: RATE)
    monkeypatch.setattr("llmtrain.monitor.watch.matmul_peak_flops",
                        lambda device: pytest.fail("the monitor re-measured the rate measured at start-up"))
    cfg = tiny_config(tmp_path / "run", max_steps=4, **{"monitor.interval": 2})
    output = io.StringIO()
    train(cfg, console=Dashboard(4, Console(file=output, width=300, soft_wrap=True)))  # the banner as lines
    row = next(line for line in output.getvalue().splitlines() if line.lstrip().startswith("time "))

    compute = run_check(cfg, matmul_flops=RATE).facts.compute  # `llmtrain check`'s figure at the same rate
    assert compute is not None
    expected = (f"~{format_seconds(compute.step_seconds)}/step, ~{format_seconds(compute.run_seconds)} for 4 steps "
                f"(estimate: 50 GFLOP/s measured x {compute.assumed_mfu:.0%} assumed MFU)")
    assert row.split(None, 1)[1] == expected
    assert compute.step_seconds == pytest.approx(compute.flops_per_token * 8 * 32 / (RATE * compute.assumed_mfu))
    health = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["peak_flops_per_s"] for r in health if r["kind"] == "health"} == {RATE}, "the monitor's MFU reference"


def test_a_resumed_runs_banner_counts_the_steps_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llmtrain.training.setup.matmul_peak_flops", lambda device, dtype=None, repeats=8: RATE)
    overrides = {"checkpoint.every_steps": 2, "schedule.warmup_steps": 1}
    train(tiny_config(tmp_path / "run", max_steps=2, **overrides),
          console=Dashboard(2, Console(file=io.StringIO(), width=300)))
    output = io.StringIO()
    train(tiny_config(tmp_path / "run", max_steps=6, **overrides),
          console=Dashboard(6, Console(file=output, width=300, soft_wrap=True)))
    row = next(line for line in output.getvalue().splitlines() if line.lstrip().startswith("time "))
    assert "for the 4 steps left of 6 (estimate: " in row


def test_the_time_row_of_one_step_and_of_no_step_left() -> None:
    from llmtrain.training.banner import time_text

    estimate = ComputeEstimate(flops_per_token=1e6, tokens_per_step=1000, steps=5, matmul_flops=1e10,
                               assumed_mfu=0.5)
    assert time_text(estimate, 1, 1).startswith("~200 ms/step, ~200 ms for 1 step (estimate: 10 GFLOP/s")
    assert time_text(estimate, 1, 5).startswith("~200 ms/step, ~200 ms for the 1 step left of 5 (")
    assert time_text(estimate, 0, 5).startswith("~200 ms/step; no step left of 5 (estimate: ")


# ---------------------------------------------------------------------------------------------
# Progress with a fake clock
# ---------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def progress_with(clock: Clock, total: int, log_interval: int, estimate_s: float | None,
                  terminal: bool = False) -> tuple[Progress, Dashboard, list[dict]]:
    console = Console(file=io.StringIO(), width=250, force_terminal=terminal)
    sink = Dashboard(total, console)
    records: list[dict] = []
    metrics = SimpleNamespace(write=records.append)
    progress = Progress(log_interval=log_interval, timer=StepTimer(0, torch.device("cpu")), dashboard=sink,
                        metrics=metrics, result=TrainResult(Path("."), 0, 0), flops_per_token=1.0,
                        precision=NumericPrecision(), sampler=None, stages=SimpleNamespace(staged=False),
                        eta=StepClock(total, estimate_s, clock=clock), slowdown=NullSlowdownWatch(), clock=clock)
    return progress, sink, records


def take_steps(progress: Progress, clock: Clock, state: TrainState, seconds: list[float]) -> None:
    one = torch.tensor(1.0)
    for duration in seconds:
        clock.now += duration
        state.step += 1
        state.tokens += 4096
        progress.step_done(state, one, one, 1e-3, applied=True, last_step=state.step == progress.eta.total_steps)


def lines(sink: Dashboard) -> list[str]:
    return [line for line in sink.console.file.getvalue().splitlines() if line.startswith("step ")]


def test_the_bar_shows_the_estimate_then_the_first_step_then_the_measured_rate() -> None:
    clock = Clock()
    progress, sink, _ = progress_with(clock, 100, 10, estimate_s=2.0, terminal=True)
    state = TrainState()
    try:
        progress.begin(state)
        eta = lambda: sink.progress.tasks[0].fields["eta"]  # noqa: E731
        assert eta() == "ETA ~3:20", "before any step: the estimate, 100 x 2 s"
        take_steps(progress, clock, state, [3.0])  # the first step: warm-up included
        assert eta() == "ETA ~4:57"
        take_steps(progress, clock, state, [2.0])
        assert eta() == "ETA 3:16", "from step 2 on: measured, 98 x 2 s"
    finally:
        sink.stop()


def test_piped_lines_carry_elapsed_and_eta_and_a_slow_first_interval_starts_at_step_1() -> None:
    clock = Clock()
    progress, sink, records = progress_with(clock, 100, 10, estimate_s=None)
    state = TrainState()
    progress.begin(state)
    take_steps(progress, clock, state, [5.0] + [4.0] * 9)  # the first interval would take 41 s
    shown = lines(sink)
    assert len(shown) == 2, shown
    assert shown[0].startswith("step      1/100  loss 1.0000") and shown[0].endswith("0:05 elapsed, ETA ~8:15")
    assert shown[1].startswith("step     10/100") and shown[1].endswith("0:41 elapsed, ETA 6:00")
    assert [r["step"] for r in records if r["kind"] == "train"] == [10], "metrics.jsonl keeps log_interval"


def test_fast_steps_start_at_the_first_log_interval() -> None:
    clock = Clock()
    progress, sink, _ = progress_with(clock, 100, 10, estimate_s=0.2)
    state = TrainState()
    progress.begin(state)
    take_steps(progress, clock, state, [0.3] + [0.2] * 9)
    assert [line.split()[1] for line in lines(sink)] == ["10/100"]


@pytest.mark.parametrize("terminal", [False, True], ids=["piped", "terminal"])
def test_slow_steps_are_each_logged_with_their_time(terminal: bool) -> None:
    clock = Clock()
    progress, sink, records = progress_with(clock, 20, 10, estimate_s=15.0, terminal=terminal)
    state = TrainState()
    try:
        progress.begin(state)
        take_steps(progress, clock, state, [12.0] * 12)
    finally:
        sink.stop()
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", sink.console.file.getvalue())  # the terminal's codes
    assert "steps are estimated at ~15 s each: every step is logged with its time" in out
    shown = out.splitlines()
    stepped = [line for line in shown if re.match(r"step +\d+/20 ", line)]
    assert [int(line.split()[1].split("/")[0]) for line in stepped] == list(range(1, 13)), out
    assert stepped[2].endswith("12.0 s/step  0:36 elapsed, ETA 3:24"), stepped[2]
    assert [r["step"] for r in records if r["kind"] == "train"] == [10]


def test_steps_under_ten_seconds_are_not_each_logged() -> None:
    clock = Clock()
    progress, sink, _ = progress_with(clock, 40, 10, estimate_s=None)
    state = TrainState()
    progress.begin(state)
    take_steps(progress, clock, state, [9.0] * 20)
    assert [line.split()[1] for line in lines(sink)] == ["1/40", "10/40", "20/40"]  # step 1: 81 s to the first line


# ---------------------------------------------------------------------------------------------
# the ETA itself
# ---------------------------------------------------------------------------------------------


def test_the_eta_follows_a_change_of_pace() -> None:
    clock = Clock()
    eta = StepClock(1000, estimate_s=1.0, clock=clock, recent=50)
    eta.begin(0)
    for step in range(1, 11):
        clock.now += 2.0
        eta.step_done(step)
    assert eta.per_step() == (2.0, True)
    for step in range(11, 71):  # the machine got busy: twice as slow; the last 50 steps all slow
        clock.now += 4.0
        eta.step_done(step)
    assert eta.per_step() == (4.0, True)
    assert eta.eta_text() == f"ETA {clock_text(4.0 * 930)}"


def test_an_evaluation_is_kept_out_of_the_step_time_and_spread_over_the_time_left() -> None:
    clock = Clock()
    eta = StepClock(100, clock=clock)
    eta.begin(0)
    for step in range(1, 11):
        clock.now += 1.0
        eta.step_done(step)
    clock.now += 9.0  # an evaluation after step 10
    eta.paused()
    clock.now += 1.0
    assert eta.step_done(11) == 1.0, "the next step is not charged the evaluation"
    assert eta.per_step() == (1.0, True)
    # 10 s of steps after the first, 9 s paused: the remaining 89 s of steps cost 1.9x
    assert eta.remaining_s() == pytest.approx(89 * 1.9)


def test_without_an_estimate_the_eta_waits_for_the_first_step() -> None:
    clock = Clock()
    eta = StepClock(10, clock=clock)
    eta.begin(0)
    assert eta.eta_text() == "ETA -:--"
    clock.now += 61.0
    eta.step_done(1)
    assert eta.status_text() == "1:01 elapsed, ETA ~9:09"


def test_clock_text() -> None:
    assert [clock_text(s) for s in (0, 7.4, 151, 3723, 90000)] == ["0:00", "0:07", "2:31", "1:02:03", "25:00:00"]
