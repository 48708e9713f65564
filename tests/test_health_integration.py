"""Pathologies induced for real on tiny models: the matching alarm fires within a bounded number
of steps, names its cause, and its action acts; a healthy run raises nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import llmtrain.training.loop as train_module
from llmtrain.config.schema import MonitorAction, OptimizerName, Precision
from llmtrain.core.errors import HealthStop
from llmtrain.training.loop import train

from .conftest import tiny_config

WATCH = {"monitor.interval": 2, "monitor.activation_interval": 4, "checkpoint.every_steps": None, "max_steps": 40}


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def alarms(run_dir: Path) -> dict[str, int]:
    first: dict[str, int] = {}
    for e in events(run_dir):
        if e["kind"] == "alarm":
            first.setdefault(e["alarm"], e["step"])
    return first


def health(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "health"]


def test_a_healthy_300_step_run_raises_no_alarm(tmp_path: Path) -> None:
    result = train(tiny_config(tmp_path / "run", max_steps=300, eval_interval=100, eval_batches=2))
    assert result.steps == 300
    assert alarms(tmp_path / "run") == {}
    checks = health(tmp_path / "run")
    assert len(checks) == 30 and sum("activation_mean" in c for c in checks) == 15  # every 20 steps
    assert all(c["update_ratio"] > 0 and 0 <= c["data_wait_share"] < 1 for c in checks)
    # AdamW's moments from the first check; the step-loss correlation once 10 intervals are in.
    assert all(0 < c["moment_ratio"] for c in checks) and checks[-1]["moment_ratio"] < 0.5
    assert ["step_correlation" in c for c in checks] == [False] * 9 + [True] * 21
    assert 0.5 < checks[-1]["step_correlation"] < 1.5  # shuffled windows: about independent steps


def test_lr_far_too_high_raises_grad_norm_high_and_reduce_lr_acts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, **WATCH, **{"optim.lr": 3.0, "optim.clip_grad_norm": None, "monitor.grad_norm_high": 10.0},
                      allow_check_failures=True))  # the check refuses this LR; the monitor must catch it too
    assert alarms(run).get("grad_norm_high", 99) <= 10
    acted = [e for e in events(run) if e["kind"] == "action" and e["alarm"] == "grad_norm_high"]
    assert acted and acted[0]["action"] == "reduce_lr"
    after = [c for c in health(run) if c["step"] > acted[0]["step"]]
    assert after and all(c["lr_applied"] == pytest.approx(0.5 * c["lr_schedule"]) for c in after[:3])


def test_no_warmup_at_a_high_lr_is_caught_early(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, **WATCH, allow_check_failures=True,
                      **{"optim.lr": 1.0, "schedule.warmup_steps": 0, "optim.clip_grad_norm": None,
                         "monitor.grad_norm_high": 10.0}))
    raised = alarms(run)
    assert min(raised.get("param_norm_jump", 99), raised.get("grad_norm_high", 99)) <= 6, raised


def test_near_zero_init_starves_the_gradients(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, **WATCH, **{"model.init_std": 1e-10, "model.bias": False, "optim.name": OptimizerName.sgd,
                                       "optim.lr": 0.1}))
    assert alarms(run).get("grad_norm_low", 99) <= 8
    alarm = next(e for e in events(run) if e.get("alarm") == "grad_norm_low")
    assert alarm["blocks"] == [0, 1]


def test_a_schedule_hitting_zero_mid_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = train_module.lr_at
    monkeypatch.setattr(train_module, "lr_at", lambda step, *a: 0.0 if step >= 10 else real(step, *a))
    run = tmp_path / "run"
    train(tiny_config(run, **WATCH))
    assert 12 <= alarms(run).get("lr_zero", 99) <= 16


@pytest.mark.slow  # a fresh process; the detector itself: test_monitor.py
def test_a_memory_leak(tmp_path: Path) -> None:
    """In a fresh process: inside pytest, memory freed by earlier tests can absorb the leak without
    the resident size growing (glibc reuses it), which is not what a real run sees."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    code = (
        "from pathlib import Path; from tests.conftest import tiny_config; "
        "from tests.test_health_integration import WATCH; from llmtrain.training.loop import train; "
        f"train(tiny_config(Path({str(run)!r}), **{{**WATCH, 'monitor.interval': 1, 'monitor.trend_window': 10, "
        "'monitor.warmup_checks': 2, 'monitor.memory_leak_mb': 40.0, 'max_steps': 30}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "LLMTRAIN_TEST_LEAK_MB_PER_STEP": "8"})
    assert proc.returncode == 0, proc.stderr
    assert alarms(run).get("memory_leak", 99) <= 15


@pytest.mark.slow  # fp16 on a CPU: ~13 s (the diagnosis's rule: test_diagnosis.py, fast)
def test_fp16_without_a_scaler(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, **{**WATCH, "max_steps": 6}, allow_check_failures=True, **{"precision.name": Precision.fp16,
                                                             "precision.loss_scaling": False}))
    assert alarms(run).get("fp16_no_scaler") == 2


def test_stop_action_saves_and_exits_with_the_alarm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = train_module.lr_at
    monkeypatch.setattr(train_module, "lr_at", lambda step, *a: 0.0 if step >= 10 else real(step, *a))
    run = tmp_path / "run"
    cfg = tiny_config(run, **WATCH)
    cfg.monitor.actions = {"lr_zero": MonitorAction.stop}
    with pytest.raises(HealthStop) as stopped:
        train(cfg)
    assert stopped.value.exit_code == 4
    assert "lr_zero" in str(stopped.value) and "schedule" in str(stopped.value).lower()
    assert stopped.value.checkpoint is not None and Path(stopped.value.checkpoint).is_dir()
    assert [e["action"] for e in events(run) if e["kind"] == "action"] == ["stop"]


def test_monitor_state_survives_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrain.checkpoint.read import load_checkpoint
    from llmtrain.core.errors import Interrupted

    run = tmp_path / "run"
    overrides = {**WATCH, "checkpoint.every_steps": 4}
    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "10")
    with pytest.raises(Interrupted) as stopped:
        train(tiny_config(run, **overrides))
    saved = load_checkpoint(Path(stopped.value.checkpoint)).trainer["monitor"]
    assert saved["checks"] == 5 and len(saved["history"]["loss"]) == 5
    monkeypatch.delenv("LLMTRAIN_TEST_STOP_AT_STEP")
    train(tiny_config(run, **overrides))
    final = load_checkpoint(run / "checkpoints" / "step_00000040").trainer["monitor"]
    assert final["checks"] == 20, "the resumed monitor continued counting from the checkpoint"


def test_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(tiny_config(run, **{**WATCH, "max_steps": 6, "eval_interval": 3, "eval_batches": 1}, tensorboard=True))
    events_dir = run / "tensorboard"
    accumulator = EventAccumulator(str(events_dir))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "eval/val_loss", "health/param_norm", "health/block_grad_norms/0"} <= tags
    losses = [e.value for e in accumulator.Scalars("train/loss")]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx([r["loss"] for r in logged if r["kind"] == "train"])


def test_dense_activation_sampling_on_a_healthy_run_stays_silent(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, **{**WATCH, "max_steps": 60}))  # activations sampled every 4 steps: 15 samples
    assert alarms(run) == {}


def test_rollback_action_then_stop_when_it_recurs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = train_module.lr_at
    monkeypatch.setattr(train_module, "lr_at", lambda step, *a: 0.0 if step >= 10 else real(step, *a))
    run = tmp_path / "run"
    cfg = tiny_config(run, **{**WATCH, "checkpoint.every_steps": 4, "checkpoint.max_rollbacks": 1})
    cfg.monitor.actions = {"lr_zero": MonitorAction.rollback}
    with pytest.raises(HealthStop, match="max_rollbacks"):
        train(cfg)
    actions = [(e["action"], e["step"]) for e in events(run) if e["kind"] == "action"]
    assert [a for a, _ in actions] == ["rollback", "stop (checkpoint.max_rollbacks reached)"]


def test_a_resumed_run_that_still_shows_the_pattern_stops_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = train_module.lr_at
    monkeypatch.setattr(train_module, "lr_at", lambda step, *a: 0.0 if step >= 10 else real(step, *a))
    run = tmp_path / "run"
    for _ in range(2):  # the first run stops; its resume shows the same pattern and stops again
        cfg = tiny_config(run, **WATCH)
        cfg.monitor.actions = {"lr_zero": MonitorAction.stop}
        with pytest.raises(HealthStop):
            train(cfg)
    assert [e["action"] for e in events(run) if e["kind"] == "action"] == ["stop", "stop"]


def test_non_finite_values_nested_in_records_stay_strict_json(tmp_path: Path) -> None:
    from llmtrain.metrics.writer import JsonlSink

    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write({"kind": "health", "block_grad_norms": [float("inf"), 1.0], "nested": {"x": float("nan")}})
    sink.close()
    record = json.loads((tmp_path / "m.jsonl").read_text(), parse_constant=lambda c: pytest.fail(f"non-strict {c}"))
    assert record["block_grad_norms"] == ["inf", 1.0] and record["nested"] == {"x": "nan"}


@pytest.mark.slow  # wandb starts its service process
def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from llmtrain.config.schema import WandbMode

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train(tiny_config(run, **{**WATCH, "max_steps": 4}, wandb=WandbMode.offline))
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0


def test_mfu_is_reported_against_this_devices_measured_matmul_rate(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, **{**WATCH, "max_steps": 4}))
    checks = health(run)
    assert all(c["peak_flops_per_s"] > 1e8 and 0 < c["mfu"] < 1.5 for c in checks)


def test_the_monitor_does_not_change_training(tmp_path: Path) -> None:
    """Same seed, monitor on or off: identical losses (its probes use no training RNG and touch no state)."""
    on = train(tiny_config(tmp_path / "on", max_steps=12, **{"model.dropout": 0.1, "monitor.interval": 2,
                                                              "monitor.activation_interval": 4}))
    off = train(tiny_config(tmp_path / "off", max_steps=12, **{"model.dropout": 0.1, "monitor.enabled": False}))
    assert on.train_losses == off.train_losses
