"""LR schedules at known steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.config.schema import ScheduleConfig, ScheduleName
from llmtrain.training.schedule import lr_at


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
    from llmtrain.errors import ConfigError

    cfg = Config()
    cfg.schedule.lr_scaling = LRScaling.linear
    with pytest.raises(ConfigError, match="schedule.reference_batch_size"):
        validate(cfg)


def test_train_uses_the_scaled_lr(tmp_path: Path) -> None:
    import json

    from llmtrain.config.schema import LRScaling
    from llmtrain.training.loop import train

    from .conftest import tiny_config

    cfg = tiny_config(tmp_path / "run", max_steps=6, **{"schedule.warmup_steps": 1, "schedule.name": ScheduleName.constant})
    cfg.schedule.lr_scaling, cfg.schedule.reference_batch_size = LRScaling.linear, 4  # global batch 8: lr x2
    train(cfg)
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
           if json.loads(line)["kind"] == "train"]
    assert lrs[-1] == pytest.approx(2 * cfg.optim.lr)
