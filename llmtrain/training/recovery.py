"""What happens when a step must not be applied: non-finite loss or gradient, alarm actions,
rollback to a checkpoint. One `Recovery` per run holds what it needs (the config, the train
module, the monitor, the checkpointer, the metrics and the console's warnings) and is asked two
things: `on_nonfinite` (checkpoint.on_nonfinite: skip, roll back or stop) and `on_alarms` (each
alarm's repair under monitor.repair=true, else its monitor.actions entry: warn, reduce_lr,
skip_step, rollback or stop).

One convention: each decision returns an `Outcome`, the decision on the step's update and the
TrainState to go on from (the same one, or the checkpoint's after a rollback). A stop is raised
(NonFiniteStop, HealthStop) after saving the last good weights.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmtrain.checkpoint.policy import Checkpointer
from llmtrain.checkpoint.read import find_good_checkpoint, load_checkpoint
from llmtrain.checkpoint.rng import restore_rng
from llmtrain.config.schema import Config, MonitorAction, NonFinitePolicy
from llmtrain.core.errors import HealthStop, NonFiniteStop
from llmtrain.core.files import Kind
from llmtrain.engine.repairs import apply_repairs
from llmtrain.engine.state import TrainState
from llmtrain.metrics.writer import MetricsWriter, NullMetricsWriter
from llmtrain.monitor.detectors import Alarm
from llmtrain.monitor.watch import Monitor, NullMonitor
from llmtrain.training.parts import TrainModule
from llmtrain.training.repair import THROWN_OFF, Repairer


class Decision(enum.Enum):
    APPLY = "apply"  # the update goes ahead
    SKIP = "skip"  # this step's update is dropped; the step still counts (its data was consumed)
    ROLLED_BACK = "rolled_back"  # the run goes on from a checkpoint's step


@dataclass(frozen=True)
class Outcome:
    """What became of a step: the decision, and the state the loop goes on from."""

    decision: Decision
    state: TrainState


@dataclass(frozen=True)
class Restored:
    """What a rollback loaded: the checkpoint's TrainState (with the run's counters carried over)
    and its monitor state (None when it has none)."""

    state: TrainState
    monitor: dict | None


class Recovery:
    """The run's answer to a step that must not be applied, the same on every rank (the loop calls
    it with rank 0's verdicts; a rollback's checkpoint is the one rank 0 finds)."""

    def __init__(self, *, cfg: Config, module: TrainModule, monitor: Monitor | NullMonitor,
                 checkpointer: Checkpointer, metrics: MetricsWriter | NullMetricsWriter,
                 warn: Callable[[str], None], repairer: Repairer) -> None:
        self.cfg, self.module, self.monitor, self.checkpointer = cfg, module, monitor, checkpointer
        self.metrics, self.warn, self.repairer = metrics, warn, repairer

    def on_nonfinite(self, state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor) -> Outcome:
        """The update of this step was not applied. Skip it, roll back, or stop, as configured. The
        step and what it caused are also events of the run (events.jsonl, through the monitor)."""
        policy, checkpointer = self.cfg.checkpoint, self.checkpointer
        state.skipped_steps += 1
        state.consecutive_skips += 1
        action, why = policy.on_nonfinite, ""
        if action is NonFinitePolicy.skip and state.consecutive_skips >= policy.max_consecutive_skips:
            action, why = NonFinitePolicy.rollback, f"{state.consecutive_skips} non-finite steps in a row"
        target = None
        if action is NonFinitePolicy.rollback:
            if state.rollbacks >= policy.max_rollbacks:
                action = NonFinitePolicy.stop
                why = f"it recurred after {state.rollbacks} rollback(s) (checkpoint.max_rollbacks)"
            else:
                target = self.agreed_good_checkpoint()
                if target is None:
                    action, why = NonFinitePolicy.stop, "there is no checkpoint to roll back to yet"
        record = {"kind": Kind.NONFINITE, "step": state.step, "loss": loss.item(), "grad_norm": grad_norm.item(),
                  "action": action.value, "consecutive": state.consecutive_skips,
                  "skipped_total": state.skipped_steps}
        self.metrics.write(record)
        self.monitor.nonfinite({**record, "why": why} if why else record)
        self.warn(f"non-finite loss/gradient at step {state.step} (loss {record['loss']}, grad norm "
                  f"{record['grad_norm']}): the update was not applied; action: {action.value}"
                  f"{f' ({why})' if why else ''}")
        if action is NonFinitePolicy.stop:
            path = checkpointer.save(state)  # the weights are still the last good ones
            saved = f"checkpoint: {path}" if path else "its checkpoint could NOT be saved (see above)"
            raise NonFiniteStop(
                f"non-finite loss or gradient at step {state.step}{f': {why}' if why else ''}. Nothing non-finite "
                f"reached the weights; {saved}. Likely causes: LR too high (optim.lr={self.cfg.optim.lr:g}), missing "
                "warmup, no gradient clipping, fp16 without loss scaling, or bad data. Check the grad_norm history in "
                "metrics.jsonl.",
                checkpoint=path, run_dir=checkpointer.run_dir,
            )
        if action is NonFinitePolicy.rollback:
            restored = self.roll_back(target, state, policy.rollback_lr_factor)
            return Outcome(Decision.ROLLED_BACK, restored.state)
        return Outcome(Decision.SKIP, state)

    def on_alarms(self, alarms: list[Alarm], state: TrainState) -> Outcome:
        """Every alarm's action, in order, each on the state the previous one left: a rollback wins
        over a skip, a skip over applying."""
        verdicts = []
        for alarm in alarms:
            outcome = self.on_alarm(alarm, state)
            verdicts.append(outcome.decision)
            state = outcome.state
        for decision in (Decision.ROLLED_BACK, Decision.SKIP):
            if decision in verdicts:
                return Outcome(decision, state)
        return Outcome(Decision.APPLY, state)

    def on_alarm(self, alarm: Alarm, state: TrainState) -> Outcome:
        """Carry out an alarm's configured action: APPLY (the update goes ahead, maybe with a cut LR
        scale), SKIP (this step's update is dropped) or ROLLED_BACK (to the checkpoint's step and
        counters, the monitor included); a stop saves and raises HealthStop."""
        cfg, monitor = self.cfg, self.monitor
        repaired = self.repair(alarm, state)
        if repaired is not None:
            return repaired
        action = MonitorAction(alarm.action)
        if action is MonitorAction.reduce_lr:
            state.lr_scale *= cfg.monitor.reduce_lr_factor
            monitor.action_taken(alarm, f"LR scale now {state.lr_scale:g} (x{cfg.monitor.reduce_lr_factor:g})")
        elif action is MonitorAction.skip_step:
            state.alarm_skipped_steps += 1
            monitor.action_taken(alarm, "this step's update was not applied")
            return Outcome(Decision.SKIP, state)
        elif action is MonitorAction.rollback:
            target = self.agreed_good_checkpoint()
            if target is None or state.rollbacks >= cfg.checkpoint.max_rollbacks:
                why = "no checkpoint to roll back to" if target is None else "checkpoint.max_rollbacks reached"
                action, alarm.action = MonitorAction.stop, f"stop ({why})"
            else:
                restored = self.roll_back(target, state, cfg.checkpoint.rollback_lr_factor)
                monitor.restore(restored.monitor)  # the monitor goes back too: a recurring pattern is raised again
                monitor.action_taken(alarm, f"rolled back to step {restored.state.step} ({target})")
                return Outcome(Decision.ROLLED_BACK, restored.state)
        if action is MonitorAction.stop:
            monitor.after_step(applied=False)  # the check step's health record, before the run ends
            monitor.forget_alarm(alarm.name)
            path = self.checkpointer.save(state)
            monitor.action_taken(alarm, f"stopped; checkpoint {path}")
            raise HealthStop(f"health alarm: {alarm.explain()}\nCheckpoint: {path}", checkpoint=path,
                             run_dir=self.checkpointer.run_dir)
        return Outcome(Decision.APPLY, state)

    def repair(self, alarm: Alarm, state: TrainState) -> Outcome | None:
        """monitor.repair: the alarm's confirmed cause fixed (from the last good checkpoint when its
        steps may have thrown the weights off), instead of the alarm's configured action; None when
        there is nothing to repair now (a fix for a new run is printed, and the action goes on)."""
        remedy = self.repairer.remedy(alarm, state)
        if remedy is None:
            return None
        if remedy.rerun is not None:
            self.repairer.suggest_rerun(remedy, alarm)
            return None
        target = (self.agreed_good_checkpoint() if remedy.cause.cause in THROWN_OFF
                  and state.rollbacks < self.cfg.checkpoint.max_rollbacks else None)
        decision = Decision.APPLY
        if target is not None:
            restored = self.roll_back(target, state, lr_factor=1.0)
            self.monitor.restore(restored.monitor)
            state, decision = restored.state, Decision.ROLLED_BACK
        return Outcome(decision, self.repairer.apply(remedy, alarm, state, rolled_back_to=target))

    def agreed_good_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies and reads, as rank 0 finds it, on every rank: one rank
        hashes the files, and all ranks roll back to the same step even if a file looks different from
        another node. Read, not just hashed: roll_back must not meet a file it cannot load."""
        checkpointer = self.checkpointer
        return checkpointer.agree(find_good_checkpoint(checkpointer.run_dir, self.warn, readable=True)
                                  if checkpointer.writer else None)

    def roll_back(self, target: Path, state: TrainState, lr_factor: float) -> Restored:
        """Reload weights, optimizer, loss scaler and RNG from a checkpoint; the data sampler is NOT
        rewound, so the windows since the checkpoint (the bad one included) are skipped."""
        module = self.module
        # verified already: agreed_good_checkpoint read it
        checkpoint = load_checkpoint(target, next(module.model.parameters()).device, verify_files=False)
        checkpoint.load_into(module.model_state, module.optimizer_state)
        module.precision.load_state_dict(checkpoint.scaler)
        restore_rng(checkpoint.rng, checkpoint.trainer["rng"])
        restored = checkpoint.state
        restored.rollbacks = state.rollbacks + 1
        restored.lr_scale = state.lr_scale * lr_factor
        restored.skipped_steps = state.skipped_steps
        restored.alarm_skipped_steps = state.alarm_skipped_steps
        restored.consecutive_skips = 0
        # Repairs are the run's, not the checkpoint's: they stay, and the optimizer's groups (just
        # loaded as the checkpoint had them) take them again.
        restored.repairs, restored.repairs_made = dict(state.repairs), state.repairs_made
        apply_repairs(restored.repairs, self.cfg, module.optimizer)
        self.metrics.write({"kind": Kind.ROLLBACK, "step": state.step, "to_step": restored.step, "path": str(target),
                            "lr_scale": restored.lr_scale, "rollbacks": restored.rollbacks})
        return Restored(restored, checkpoint.trainer.get("monitor"))
