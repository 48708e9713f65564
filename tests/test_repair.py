"""monitor.repair: a confirmed cause fixed mid-run, recorded, kept by checkpoints and resumes;
fixes that need a new run printed as the command; a healthy run unchanged by it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint.read import load_checkpoint
from llmtrain.config.schema import Config, OptimConfig, OptimizerName
from llmtrain.core.errors import CheckpointError
from llmtrain.engine.optim import build_optimizer
from llmtrain.engine.repairs import WARMUP_RESTART, apply_repairs, check_repairs, lr_factor, warmup_ramp
from llmtrain.engine.schedule import lr_at
from llmtrain.engine.state import TrainState
from llmtrain.monitor.detectors import Alarm
from llmtrain.monitor.diagnosis import Cause
from llmtrain.monitor.watch import NullMonitor
from llmtrain.preflight.render import rerun_command_line
from llmtrain.runs.report import write_report
from llmtrain.training.loop import train
from llmtrain.training.repair import Repairer, fix_lines

from .conftest import tiny_config


def records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind] if path.exists() else []


# ---- the pieces --------------------------------------------------------------------------------

def test_fix_lines_keep_the_config_lines_of_a_fix() -> None:
    assert fix_lines("optim.lr=0.003") == {"optim.lr": "0.003"}
    assert fix_lines("schedule.warmup_steps=10 (5% of the run)") == {"schedule.warmup_steps": "10"}
    assert fix_lines("optim.label_smoothing=0.0 model.dropout=0.1") == {"optim.label_smoothing": "0.0",
                                                                        "model.dropout": "0.1"}
    assert fix_lines(None) == {} and fix_lines("compare the norm layers") == {}


def test_the_rerun_command_replaces_the_fixed_keys_and_drops_the_run_dir() -> None:
    command = rerun_command_line(["optim.lr=0.09", "out_dir=runs/a", "hydra.run.dir=x", "model=gpt_tiny"], None,
                                 {"optim.lr": "0.003"})
    assert command == "llmtrain train model=gpt_tiny optim.lr=0.003"
    assert rerun_command_line(None, "my_conf", {"optim.eps": "1e-8"}) == "llmtrain train -cd my_conf optim.eps=1e-8"


def test_lr_factor_and_a_restarted_warmup() -> None:
    assert lr_factor({}, 5, 3e-3) == 1.0
    assert lr_factor({"optim.lr": 3e-3}, 5, 3e-2) == pytest.approx(0.1)
    repairs = {"schedule.warmup_steps": 10.0, WARMUP_RESTART: 20.0}
    assert [warmup_ramp(repairs, step) for step in (20, 24, 29, 40)] == [0.1, 0.5, 1.0, 1.0]
    assert lr_factor({**repairs, "optim.lr": 1e-3}, 24, 2e-3) == pytest.approx(0.25)


def test_apply_repairs_sets_the_config_and_the_optimizer_groups() -> None:
    cfg = Config(optim=OptimConfig(lr=3e-3, weight_decay=10.0, eps=1.0, beta2=0.3, clip_grad_norm=1e-4))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    apply_repairs({"optim.weight_decay": 0.1, "optim.eps": 1e-8, "optim.beta2": 0.95, "optim.clip_grad_norm": 1.0,
                   "optim.lr": 3e-4}, cfg, optimizer)
    decaying, plain = optimizer.param_groups
    assert decaying["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0  # norms and biases never decay
    assert all(g["eps"] == 1e-8 and g["betas"] == (0.9, 0.95) for g in optimizer.param_groups)
    assert (cfg.optim.clip_grad_norm, cfg.optim.weight_decay) == (1.0, 0.1)
    assert cfg.optim.lr == 3e-3  # the configured peak stays: lr_factor scales the schedule


def test_a_forged_repairs_entry_is_refused() -> None:
    assert check_repairs({"optim.lr": 3e-4, WARMUP_RESTART: 20}) is None
    assert "keys other than" in (check_repairs({"model.n_layer": 2}) or "")
    assert "cannot reach" in (check_repairs({"optim.lr": math.inf}) or "")
    assert "cannot reach" in (check_repairs({"optim.lr": "0.1"}) or "")
    assert "not an object" in (check_repairs([1]) or "")


def _repairer(cfg: Config) -> Repairer:
    model = torch.nn.Linear(4, 4)
    return Repairer(cfg=cfg, optimizer=build_optimizer(model, cfg.optim, "cpu"), monitor=NullMonitor(),
                    say=lambda text: None, schedule_steps=200, base_facts=None)


def _alarm(cause: str, score: float, fix: str | None) -> Alarm:
    return Alarm("loss_not_decreasing", 120, "warning", "loss", [3.2], "band",
                 causes=[Cause(cause, cause.replace("_", " "), "evidence", fix, score)])


def test_only_a_confirmed_cause_with_a_fix_that_changes_something_is_repaired() -> None:
    cfg = Config(optim=OptimConfig(lr=3e-3, eps=1.0))
    cfg.monitor.repair = True
    repairer, state = _repairer(cfg), TrainState(step=120)
    remedy = repairer.remedy(_alarm("eps_too_large", 0.9, "optim.eps=1e-8"), state)
    assert remedy is not None and remedy.changes == {"optim.eps": 1e-8} and remedy.rerun is None
    assert repairer.remedy(_alarm("eps_too_large", 0.5, "optim.eps=1e-8"), state) is None  # not confirmed
    assert repairer.remedy(_alarm("bad_batch", 0.9, None), state) is None  # nothing to change
    assert repairer.remedy(_alarm("eps_too_large", 0.9, "optim.eps=1.0"), state) is None  # already so
    # A fix that needs a new run (the model's init): the command, not a change.
    rerun = repairer.remedy(_alarm("init_too_large", 0.9, "model.init_std=0.088"), state)
    assert rerun is not None and rerun.changes == {} and rerun.rerun == {"model.init_std": "0.088"}
    cfg.monitor.max_repairs = 1
    assert repairer.remedy(_alarm("eps_too_large", 0.9, "optim.eps=1e-8"), TrainState(repairs_made=1)) is None
    cfg.monitor.repair = False
    assert repairer.remedy(_alarm("eps_too_large", 0.9, "optim.eps=1e-8"), state) is None


def test_a_setting_the_optimizer_does_not_have_needs_a_new_run() -> None:
    cfg = Config(optim=OptimConfig(name=OptimizerName.sgd, lr=0.1, momentum=0.0))
    cfg.monitor.repair = True
    remedy = _repairer(cfg).remedy(_alarm("beta2_too_low", 0.8, "optim.beta2=0.95"), TrainState())
    assert remedy is not None and remedy.rerun == {"optim.beta2": "0.95"}
    sgd = _repairer(cfg).remedy(_alarm("sgd_without_momentum", 0.6, "optim.momentum=0.9"), TrainState())
    assert sgd is not None and sgd.changes == {"optim.momentum": 0.9}


# ---- a run ---------------------------------------------------------------------------------------

WATCH = {"monitor.interval": 2, "monitor.activation_interval": 4, "checkpoint.every_steps": 20, "max_steps": 30,
         "monitor.repair": True}


def test_an_lr_far_too_high_is_repaired_from_the_initial_checkpoint_and_a_resume_keeps_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = train(tiny_config(run, **WATCH, **{"optim.lr": 1.0}, allow_check_failures=True))
    repairs = records(run / "events.jsonl", "repair")
    assert repairs, records(run / "events.jsonl", "alarm")
    first = repairs[0]
    assert first["cause"] == "lr_too_high" and first["applied"] is True
    assert first["changes"][0]["key"] == "optim.lr" and first["changes"][0]["from"] == 1.0
    assert first["changes"][0]["to"] < 0.05 and first["rolled_back_to"] == 0
    assert records(run / "metrics.jsonl", "repair") == repairs
    # From the repair on, the applied LR is the schedule's times the repaired peak over the configured one;
    # the monitor's schedule LR is the repaired one (a repair is no LR overwritten behind its back).
    factor = first["changes"][0]["to"] / 1.0
    schedule = tiny_config(run, **WATCH, **{"optim.lr": 1.0}).schedule

    def configured(step: int, steps: int) -> float:
        return lr_at(step - 1, 1.0, steps, schedule)

    after = [h for h in records(run / "metrics.jsonl", "health") if h["step"] > first["step"]]
    assert after and all(h["lr_applied"] == pytest.approx(configured(h["step"], 30) * factor) for h in after)
    assert all(h["lr_applied"] == pytest.approx(h["lr_schedule"]) for h in after)
    assert not [a for a in records(run / "events.jsonl", "alarm") if a["alarm"] == "lr_exploding"]
    assert math.isfinite(result.final_val_loss) or result.val_losses == {}
    saved = load_checkpoint(run / "checkpoints" / "step_00000020")
    assert saved.state.repairs["optim.lr"] == first["changes"][0]["to"] and saved.state.repairs_made == len(repairs)
    # Resumed for 10 more steps: the repaired LR goes on (the command line still says 1.0).
    train(tiny_config(run, **{**WATCH, "max_steps": 40, "checkpoint.every_steps": 40}, **{"optim.lr": 1.0},
                      allow_check_failures=True))
    resumed = [h for h in records(run / "metrics.jsonl", "health") if h["step"] > 30]
    assert resumed and all(h["lr_applied"] == pytest.approx(configured(h["step"], 40) * factor) for h in resumed)
    write_report(run, inference=False)
    assert "repaired: optim.lr 1.0 ->" in (run / "report.md").read_text()


def test_a_healthy_run_is_the_same_with_repair_on(tmp_path: Path) -> None:
    """No alarm, no change: the same losses with the monitor off, on, and on with repair."""
    steps = {"max_steps": 24, "model.dropout": 0.1}
    off = train(tiny_config(tmp_path / "off", **steps, **{"monitor.enabled": False}))
    on = train(tiny_config(tmp_path / "on", **steps, **{"monitor.interval": 2}))
    repair = train(tiny_config(tmp_path / "repair", **steps, **{"monitor.interval": 2, "monitor.repair": True}))
    assert off.train_losses == on.train_losses == repair.train_losses
    assert records(tmp_path / "repair" / "events.jsonl", "alarm") == []


def test_a_forged_repair_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, max_steps=4, **{"checkpoint.every_steps": 4}))
    step = run / "checkpoints" / "step_00000004"
    state_file = step / "trainer_state.json"
    trainer = json.loads(state_file.read_text())
    trainer["state"]["repairs"] = {"model.n_layer": 48}
    state_file.write_text(json.dumps(trainer))
    with pytest.raises(CheckpointError, match="repairs"):
        load_checkpoint(step, verify_files=False)


def test_repair_with_the_monitor_off_is_refused_before_any_work(tmp_path: Path) -> None:
    from llmtrain.config.validate import validate
    from llmtrain.core.errors import ConfigError

    cfg = tiny_config(tmp_path / "run", **{"monitor.enabled": False, "monitor.repair": True})
    with pytest.raises(ConfigError, match="monitor.repair' is true but the monitor is off"):
        validate(cfg)
    assert not (tmp_path / "run").exists()


def test_an_alternative_in_parentheses_is_not_a_line_of_the_fix() -> None:
    """The mixed-precision fix offers bf16 as an alternative: the rerun command got 'precision=bf16)',
    which Hydra refuses, and both lines at once."""
    assert fix_lines("precision.loss_scaling=true (or precision=bf16)") == {"precision.loss_scaling": "true"}
    assert fix_lines("seed=1337 (or data.seed=N)") == {"seed": "1337"}
    assert fix_lines("optim.lr=0.00053; or raise the batch (global_batch_size) x= =3") == {"optim.lr": "0.00053"}
