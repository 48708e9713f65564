"""The health monitor's diagnosis on real tiny runs: each sick run's alarm names the true cause
first, with the pre-flight check's own fix; non-finite steps are events; a healthy run stays silent.

Each run is a few seconds of the tiny config (2 blocks x 32 wide, char tokens, one thread)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.core.errors import NonFiniteStop
from llmtrain.preflight.check import run_check
from llmtrain.training.loop import train

from .conftest import tiny_config
from .test_health_integration import alarms, events, health


def alarm_records(run_dir: Path) -> list[dict]:
    return [e for e in events(run_dir) if e["kind"] == "alarm"]


def cause_ids(record: dict) -> list[str]:
    return [c["cause"] for c in record["causes"]]


def test_init_far_too_large_is_diagnosed_at_the_first_check_with_the_checks_fix(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_config(run, max_steps=20, **{"model.init_std": 1.0})
    expected_fix = run_check(cfg, measure_compute=False).row("init variance").fix
    train(cfg)
    first = alarm_records(run)[0]
    assert (first["alarm"], first["step"], first["severity"]) == ("loss_above_chance", cfg.monitor.interval,
                                                                   "critical")
    top = first["causes"][0]
    assert top["cause"] == "init_too_large"
    assert expected_fix.startswith("model.init_std=") and top["fix"] == expected_fix
    assert "init std 1" in top["evidence"]


def test_non_finite_steps_are_events_with_their_action(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRAIN_TEST_NAN_AT_STEPS", "3,5")
    run = tmp_path / "run"
    result = train(tiny_config(run, max_steps=8))
    assert result.steps == 8
    nonfinite = [e for e in events(run) if e["kind"] == "nonfinite"]
    assert [(e["step"], e["action"], e["consecutive"]) for e in nonfinite] == [(3, "skip", 1), (5, "skip", 1)]
    assert [e["skipped_total"] for e in nonfinite] == [1, 2]


def test_three_non_finite_steps_in_a_row_stop_the_run_and_the_stop_is_an_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on_nonfinite=skip escalates to a rollback after max_consecutive_skips (3); with no checkpoint
    # to roll back to yet (checkpoint.every_steps is far off) that becomes a stop.
    monkeypatch.setenv("LLMTRAIN_TEST_NAN_AT_STEPS", "4,5,6")
    run = tmp_path / "run"
    with pytest.raises(NonFiniteStop, match="step 6") as stopped:
        train(tiny_config(run, max_steps=10))
    assert stopped.value.exit_code == 3
    nonfinite = [e for e in events(run) if e["kind"] == "nonfinite"]
    assert [(e["step"], e["action"]) for e in nonfinite] == [(4, "skip"), (5, "skip"), (6, "stop")]
    assert nonfinite[-1]["consecutive"] == 3 and "no checkpoint" in nonfinite[-1]["why"]


def test_lr_far_too_low_is_diagnosed_and_nothing_advises_lowering_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, max_steps=60, **{"optim.lr": 1e-7, "monitor.interval": 5}))
    records = alarm_records(run)
    low = next(r for r in records if r["alarm"] == "update_ratio_low")
    assert cause_ids(low)[0] == "lr_too_low"
    assert "1e-07" in low["causes"][0]["evidence"]
    # The diagnosis never argues against its own evidence: an LR 1000x below the sane range is never "too high".
    assert not [r["alarm"] for r in records if "lr_too_high" in cause_ids(r)]


def test_lr_far_too_high_never_lists_lr_too_low(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, max_steps=40, allow_check_failures=True, **{"optim.lr": 0.5, "monitor.interval": 5}))
    records = alarm_records(run)
    assert records, "an LR of 0.5 on this model must raise an alarm"
    assert cause_ids(records[0])[0] == "lr_too_high"
    assert not [r["alarm"] for r in records if "lr_too_low" in cause_ids(r)]


def test_a_schedule_that_ends_early_is_diagnosed_after_its_end(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, max_steps=40, **{"schedule.total_steps": 20, "schedule.min_lr_ratio": 0.0,
                                            "monitor.interval": 5}))
    ended = next(r for r in alarm_records(run) if r["alarm"] == "schedule_ended")
    assert ended["step"] == 25, "the first check after the schedule's last step (20)"
    assert ended["causes"][0]["cause"] == "schedule_ended"
    assert ended["causes"][0]["fix"] == "schedule.total_steps=null"


def test_a_healthy_run_raises_no_alarm_and_records_the_update_ratio(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = train(tiny_config(run, max_steps=50))
    assert result.steps == 50
    assert alarms(run) == {}
    assert [e for e in events(run) if e["kind"] != "alarm"] == []
    checks = health(run)
    assert [c["step"] for c in checks] == [10, 20, 30, 40, 50]
    # A healthy Adam update moves the weights by well under 10% and well over 1e-5 of their norm per step.
    assert all(1e-5 < c["update_ratio"] < 0.1 for c in checks)


def test_a_resumed_run_judges_as_the_uninterrupted_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interval's losses and the update ratio still to judge are saved with the monitor: after a
    stop in the middle of a check interval, the resumed run's health records (interval mean loss,
    update ratio) and its monitor state equal the uninterrupted run's."""
    from llmtrain.checkpoint.read import load_checkpoint
    from llmtrain.core.errors import Interrupted

    overrides = {"max_steps": 30, "monitor.interval": 10, "checkpoint.every_steps": 5}
    whole = tmp_path / "whole"
    train(tiny_config(whole, **overrides))
    cut = tmp_path / "cut"
    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "15")  # mid-interval: steps 11-15 of the 11-20 interval
    with pytest.raises(Interrupted) as stopped:
        train(tiny_config(cut, **overrides))
    saved = load_checkpoint(Path(stopped.value.checkpoint)).trainer["monitor"]
    assert len(saved["interval_losses"]) == 5 and saved["pending_update"] is not None
    monkeypatch.delenv("LLMTRAIN_TEST_STOP_AT_STEP")
    train(tiny_config(cut, **overrides))

    def judged(run: Path) -> list[tuple]:
        return [(r["step"], r["interval_loss"], r["update_ratio"]) for r in health(run)]
    assert judged(cut)[-2:] == judged(whole)[-2:]
    def state(run: Path) -> dict:
        monitor = load_checkpoint(run / "checkpoints" / "step_00000030").trainer["monitor"]
        del monitor["history"]["rss_mb"]  # the process's memory, not the run's
        return monitor
    assert state(cut) == state(whole)
