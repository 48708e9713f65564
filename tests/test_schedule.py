"""LR schedules at known steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.config.schema import ScheduleConfig, ScheduleName
from llmtrain.engine.schedule import lr_at


def sched(name: ScheduleName, **kw: float) -> ScheduleConfig:
    return ScheduleConfig(name=name, warmup_steps=10, min_lr_ratio=0.1, **kw)


@pytest.mark.parametrize("name", list(ScheduleName))
def test_warmup_is_linear_from_the_first_step(name: ScheduleName) -> None:
    cfg = sched(name)
    assert lr_at(0, 1.0, 111, cfg) == pytest.approx(0.1)
    assert lr_at(4, 1.0, 111, cfg) == pytest.approx(0.5)
    assert lr_at(9, 1.0, 111, cfg) == pytest.approx(1.0)
    assert lr_at(10, 1.0, 111, cfg) == pytest.approx(1.0)


def test_cosine_midpoint_and_floor() -> None:
    cfg = sched(ScheduleName.cosine)
    # 111 steps, warmup 10: decay runs over steps 10..110, midpoint at 60.
    assert lr_at(60, 2.0, 111, cfg) == pytest.approx(2.0 * 0.55)
    assert lr_at(35, 1.0, 111, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + 2**-0.5))
    assert lr_at(110, 1.0, 111, cfg) == pytest.approx(0.1)


def test_linear_and_constant() -> None:
    assert lr_at(60, 1.0, 111, sched(ScheduleName.linear)) == pytest.approx(0.55)
    assert lr_at(110, 1.0, 111, sched(ScheduleName.linear)) == pytest.approx(0.1)
    assert lr_at(110, 1.0, 111, sched(ScheduleName.constant)) == pytest.approx(1.0)


def test_wsd_stable_then_decays_over_the_last_fraction() -> None:
    cfg = ScheduleConfig(name=ScheduleName.wsd, warmup_steps=5, min_lr_ratio=0.1, decay_fraction=0.2)
    assert lr_at(50, 1.0, 100, cfg) == pytest.approx(1.0)
    assert lr_at(80, 1.0, 100, cfg) == pytest.approx(1.0)
    assert lr_at(99, 1.0, 100, cfg) == pytest.approx(0.1)
    assert lr_at(89, 1.0, 100, cfg) == pytest.approx(1.0 - 0.9 * 9 / 19)


def test_warmup_fraction_when_steps_unset() -> None:
    cfg = ScheduleConfig(name=ScheduleName.cosine, warmup_steps=None, warmup_fraction=0.1)
    assert lr_at(0, 1.0, 100, cfg) == pytest.approx(0.1)  # 10 warmup steps
    assert lr_at(9, 1.0, 100, cfg) == pytest.approx(1.0)


@pytest.mark.parametrize("name", [ScheduleName.cosine, ScheduleName.linear, ScheduleName.wsd])
@pytest.mark.parametrize(("total", "warmup", "decay_fraction"), [(10, 2, 0.1), (5, 1, 0.2), (3, 2, 0.2), (2, 0, 0.5)])
def test_short_runs_still_end_on_the_floor(name: ScheduleName, total: int, warmup: int, decay_fraction: float) -> None:
    cfg = ScheduleConfig(name=name, warmup_steps=warmup, min_lr_ratio=0.1, decay_fraction=decay_fraction)
    lrs = [lr_at(step, 1.0, total, cfg) for step in range(total)]
    assert lrs[-1] == pytest.approx(0.1)
    assert all(0.1 - 1e-12 <= lr <= 1.0 + 1e-12 for lr in lrs)
    assert lrs[0] > 0


@pytest.mark.parametrize(("scaling", "expected"), [("none", 1e-3), ("linear", 4e-3), ("sqrt", 2e-3)])
def test_batch_size_lr_scaling(scaling: str, expected: float) -> None:
    from llmtrain.config.derived import effective_lr
    from llmtrain.config.schema import Config, LRScaling
    from llmtrain.config.validate import validate

    cfg = Config(global_batch_size=64)
    cfg.optim.lr = 1e-3
    cfg.schedule.lr_scaling = LRScaling(scaling)
    cfg.schedule.reference_batch_size = 16
    validate(cfg)
    assert effective_lr(cfg) == pytest.approx(expected)


def test_lr_scaling_needs_a_reference_batch() -> None:
    from llmtrain.config.schema import Config, LRScaling
    from llmtrain.config.validate import validate
    from llmtrain.core.errors import ConfigError

    cfg = Config()
    cfg.schedule.lr_scaling = LRScaling.linear
    with pytest.raises(ConfigError, match="schedule.reference_batch_size"):
        validate(cfg)


def test_train_uses_the_scaled_lr(tmp_path: Path) -> None:
    import json

    from llmtrain.config.schema import LRScaling
    from llmtrain.training.loop import train

    from .conftest import tiny_config

    cfg = tiny_config(tmp_path / "run", max_steps=6,
                      **{"schedule.warmup_steps": 1, "schedule.name": ScheduleName.constant})
    cfg.schedule.lr_scaling, cfg.schedule.reference_batch_size = LRScaling.linear, 4  # global batch 8: lr x2
    train(cfg)
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
           if json.loads(line)["kind"] == "train"]
    assert lrs[-1] == pytest.approx(2 * cfg.optim.lr)


# ---------------------------------------------------------------------------------------------
# schedule.total_steps: a schedule shorter or longer than the run
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ScheduleName))
@pytest.mark.parametrize("min_lr_ratio", [0.1, 0.0])
def test_past_its_end_every_schedule_holds_its_final_lr(name: ScheduleName, min_lr_ratio: float) -> None:
    from llmtrain.engine.schedule import final_lr

    cfg = ScheduleConfig(name=name, warmup_steps=5, min_lr_ratio=min_lr_ratio)
    expected = 2.0 if name is ScheduleName.constant else 2.0 * min_lr_ratio
    assert lr_at(49, 2.0, 50, cfg) == pytest.approx(expected)  # the schedule's last step reaches it
    assert [lr_at(step, 2.0, 50, cfg) for step in (50, 51, 80, 10_000)] == pytest.approx([expected] * 4)
    assert final_lr(2.0, 50, cfg) == pytest.approx(expected)


def test_held_lr_text_names_zero_the_floor_and_the_peak() -> None:
    from llmtrain.engine.schedule import held_lr_text

    assert held_lr_text(0.0, 3e-3) == "LR 0"
    assert held_lr_text(3e-3 * 0.1, 3e-3) == "the floor LR 0.0003"
    assert held_lr_text(3e-3, 3e-3) == "the peak LR 0.003"


def _run_config(**schedule: object):
    from llmtrain.config.schema import Config
    from llmtrain.config.validate import validate

    cfg = Config(max_steps=300)
    for key, value in schedule.items():
        setattr(cfg.schedule, key, value)
    validate(cfg)
    return cfg


def test_schedule_steps_is_the_set_length_else_the_runs() -> None:
    from llmtrain.config.derived import schedule_steps, total_steps

    assert schedule_steps(_run_config()) == total_steps(_run_config()) == 300
    assert schedule_steps(_run_config(total_steps=200)) == 200
    assert schedule_steps(_run_config(total_steps=500)) == 500  # longer than the run: allowed
    assert total_steps(_run_config(total_steps=200)) == 300  # the run keeps its length


def test_warmup_and_decay_fractions_are_fractions_of_the_schedule() -> None:
    from llmtrain.config.derived import resolved_warmup_steps, schedule_steps

    cfg = _run_config(total_steps=200, warmup_fraction=0.05)
    assert resolved_warmup_steps(cfg.schedule, schedule_steps(cfg)) == 10  # 5% of 200, not of the run's 300
    assert lr_at(9, 1.0, 200, cfg.schedule) == pytest.approx(1.0)
    wsd = ScheduleConfig(name=ScheduleName.wsd, warmup_steps=5, decay_fraction=0.2, min_lr_ratio=0.1)
    # 20% of a 200-step schedule: the decay runs over steps 160..199, whatever the run's length
    assert lr_at(159, 1.0, 200, wsd) == pytest.approx(1.0)
    assert lr_at(160, 1.0, 200, wsd) == pytest.approx(1.0)  # the decay's first step, progress 0
    assert lr_at(161, 1.0, 200, wsd) < 1.0
    assert lr_at(199, 1.0, 200, wsd) == pytest.approx(0.1)


def test_a_changed_schedule_length_on_resume_is_shown_not_refused() -> None:
    from types import SimpleNamespace

    from llmtrain.checkpoint.resume import check_resumable, config_changes
    from llmtrain.config.schema import Config, config_to_dict

    saved, current = config_to_dict(Config()), config_to_dict(Config())
    current["schedule"]["total_steps"] = 200
    # like max_steps: listed among the changes the resume prints, and not refused
    assert config_changes(saved, current) == [("schedule.total_steps", None, 200)]
    check_resumable(SimpleNamespace(path=Path("step_4"), trainer={"config": saved}), current)
    # a checkpoint written before the key existed reads as null: no change
    del saved["schedule"]["total_steps"]
    assert config_changes(saved, config_to_dict(Config())) == []


def test_a_run_past_its_schedule_trains_at_the_floor(tmp_path: Path) -> None:
    import io
    import json

    from rich.console import Console

    from llmtrain.metrics.dashboard import Dashboard
    from llmtrain.training.loop import train

    from .conftest import tiny_config

    cfg = tiny_config(tmp_path / "run", max_steps=12, micro_batch_size=2, global_batch_size=2,
                      **{"schedule.total_steps": 6})
    output = io.StringIO()
    train(cfg, console=Dashboard(12, Console(file=output, width=300)))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    floor = cfg.optim.lr * cfg.schedule.min_lr_ratio
    assert sorted(lrs) == list(range(1, 13))
    assert lrs[3] > floor * 1.5  # still decaying inside the schedule
    assert [lrs[step] for step in range(6, 13)] == pytest.approx([floor] * 7)  # its last step, then held
    assert "cosine over 6 of 12 steps: the last 6 at the floor LR 0.0003" in output.getvalue()


def test_the_banner_says_where_the_schedule_and_the_run_part() -> None:
    from llmtrain.config.schema import Config
    from llmtrain.training.banner import describe_schedule

    cfg = Config()  # cosine to 0.1 x peak
    assert describe_schedule(cfg, 300, 300, 3e-3) == "cosine"
    assert describe_schedule(cfg, 300, 200, 3e-3) == "cosine over 200 of 300 steps: the last 100 at the floor LR 0.0003"
    cut = describe_schedule(cfg, 300, 600, 3e-3)
    assert cut == f"cosine over 600 steps: the run ends at step 300, at LR {lr_at(299, 3e-3, 600, cfg.schedule):.3g}"
    assert 3e-4 < lr_at(299, 3e-3, 600, cfg.schedule) < 3e-3  # mid-decay
