"""Repair (`monitor.repair=true`): an alarm's most likely cause, when the run's evidence confirms
it, is fixed mid-run, and the run goes on. The fix is the cause's own (the diagnosis's `fix`, the
config lines the alarm prints); when every line of it is a setting the run can change mid-run
(engine/repairs.py) it is applied, else the command that reruns with it is printed once.

Each repair is a `repair` record in events.jsonl and metrics.jsonl (the alarm, the cause, each
setting from what to what, the checkpoint rolled back to), a line on the console, and a change of
`TrainState.repairs`, which every later checkpoint keeps. Recovery (recovery.py) decides the rollback;
this module decides what to change and carries it out."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmtrain.config.derived import resolved_warmup_steps
from llmtrain.config.hydra import command_line_of_this_run
from llmtrain.config.schema import Config
from llmtrain.core.files import Kind
from llmtrain.engine.repairs import KNOBS, WARMUP_RESTART, apply_repairs, current_value, repairable
from llmtrain.engine.state import TrainState
from llmtrain.monitor.detectors import Alarm
from llmtrain.monitor.diagnosis import Cause, RunFacts
from llmtrain.monitor.watch import Monitor, NullMonitor
from llmtrain.preflight.render import rerun_command_line

# A cause's score from which its evidence confirms it: the fixed priors of causes the run cannot
# see (<= 0.5) and the weak readings of a setting inside its usual range stay below.
CONFIRMED = 0.6
# Causes whose steps may have thrown the weights off: their repair starts again from the last good
# checkpoint when there is one. The others (too small or too damped updates) only slowed learning.
THROWN_OFF = frozenset({"lr_too_high", "no_warmup", "no_clipping", "beta2_too_low", "batch_too_small"})


# A fix's aside in parentheses is a note or an alternative ("(or precision=bf16)"), never a line to apply.
_ASIDE = re.compile(r"\([^()]*\)")
_LINE = re.compile(r"(\+{0,2}[A-Za-z_][\w.\-/@]*)=(\S+)")


def fix_lines(fix: str | None) -> dict[str, str]:
    """The `key=value` config lines of a cause's fix, in order (its other words explain it; a sentence's
    trailing ',' or ';' is not part of a value)."""
    lines = {}
    for token in _ASIDE.sub(" ", fix or "").split():
        if match := _LINE.fullmatch(token.rstrip(",;")):
            lines[match[1]] = match[2]
    return lines


@dataclass(frozen=True)
class Remedy:
    """What a confirmed cause's fix asks: settings to change now, or (`rerun`) lines for a new run."""

    cause: Cause
    changes: dict[str, float]
    rerun: dict[str, str] | None = None


class Repairer:
    """Decides and applies repairs for one run; `base_facts` are the run's facts as configured
    (the monitor's), from which every repaired set is derived."""

    def __init__(self, *, cfg: Config, optimizer: torch.optim.Optimizer, monitor: Monitor | NullMonitor,
                 say: Callable[[str], None], schedule_steps: int, base_facts: RunFacts | None) -> None:
        self.cfg, self.optimizer, self.monitor, self.say = cfg, optimizer, monitor, say
        self.schedule_steps, self.base_facts = schedule_steps, base_facts
        self.configured_lr = float(cfg.optim.lr or 0.0)
        self.rerun_said: set[str] = set()

    def remedy(self, alarm: Alarm, state: TrainState) -> Remedy | None:
        """The top cause's fix when its evidence confirms it and it would change something; None otherwise."""
        if not self.cfg.monitor.repair or not alarm.causes or state.repairs_made >= self.cfg.monitor.max_repairs:
            return None
        cause = alarm.causes[0]
        lines = fix_lines(cause.fix)
        if cause.score < CONFIRMED or not lines:
            return None
        changes = {}
        for key, text in lines.items():
            value = self._value(key, text)
            if value is None:  # a line the run cannot apply mid-run: the whole fix is for a new run
                return None if cause.cause in self.rerun_said else Remedy(cause, {}, lines)
            key = "schedule.warmup_steps" if key == "schedule.warmup_fraction" else key
            if value != self._now(key, state):
                changes[key] = value
        return Remedy(cause, changes) if changes else None

    def _value(self, key: str, text: str) -> float | None:
        """The repaired value of a fix line, or None when it is not a mid-run setting of this run."""
        try:
            value = float(text)
        except ValueError:
            return None
        if key == "schedule.warmup_fraction":
            schedule = dataclasses.replace(self.cfg.schedule, warmup_steps=None, warmup_fraction=value)
            return float(max(1, resolved_warmup_steps(schedule, self.schedule_steps)))
        return value if repairable(key, self.cfg) and math.isfinite(value) and value >= 0 else None

    def _now(self, key: str, state: TrainState) -> float | None:
        if key == "schedule.warmup_steps" and key not in state.repairs:
            return None  # a restarted warmup is a change even at the configured length
        return current_value(key, self.cfg, state.repairs)

    def _before(self, key: str, state: TrainState) -> float | None:
        """The value to show as the one replaced (a warmup never repaired: its configured length)."""
        if key == "schedule.warmup_steps" and key not in state.repairs:
            return float(resolved_warmup_steps(self.cfg.schedule, self.schedule_steps))
        return current_value(key, self.cfg, state.repairs)

    def apply(self, remedy: Remedy, alarm: Alarm, state: TrainState, rolled_back_to: Path | None) -> TrainState:
        """Change the settings (from `state.step`: after a rollback, the checkpoint's), record and say it."""
        before = {key: self._before(key, state) for key in remedy.changes}
        state.repairs = {**state.repairs, **remedy.changes}
        if "schedule.warmup_steps" in remedy.changes:
            state.repairs[WARMUP_RESTART] = float(state.step)
        state.repairs_made += 1
        apply_repairs(state.repairs, self.cfg, self.optimizer)
        self.refresh_facts(state.repairs)
        self.monitor.judge_afresh(alarm.name)  # a pattern that persists under the repair returns
        changes = [{"key": key, "from": before[key], "to": value} for key, value in remedy.changes.items()]
        self._record(alarm, remedy.cause, changes=changes, applied=True, rerun=None,
                     rolled_back_to=state.step if rolled_back_to else None,
                     checkpoint=str(rolled_back_to) if rolled_back_to else None)
        text = ", ".join(f"{c['key']} {_shown(c['from'])} -> {_shown(c['to'])}" for c in changes)
        back = f" after rolling back to step {state.step}" if rolled_back_to else ""
        warmup = (f"; the warmup restarts at step {state.step}" if "schedule.warmup_steps" in remedy.changes else "")
        self.say(f"repair at step {alarm.step} ({alarm.name}: {remedy.cause.title.lower()}): {text}{back}{warmup}. "
                 "The change is kept in every checkpoint from here on; resuming keeps it.")
        return state

    def suggest_rerun(self, remedy: Remedy, alarm: Alarm) -> None:
        """A fix that needs a new run: the command, printed and recorded once per cause."""
        assert remedy.rerun is not None
        self.rerun_said.add(remedy.cause.cause)
        command = rerun_command_line(*command_line_of_this_run(), remedy.rerun)
        self._record(alarm, remedy.cause, changes=[], applied=False, rerun=command, rolled_back_to=None,
                     checkpoint=None)
        self.say(f"repair at step {alarm.step} ({alarm.name}: {remedy.cause.title.lower()}): the fix "
                 f"({' '.join(f'{k}={v}' for k, v in remedy.rerun.items())}) cannot be applied mid-run; "
                 f"rerun with it: {command}")

    def refresh_facts(self, repairs: dict[str, float]) -> None:
        """The monitor's facts with the repaired settings (the LR's as the peak the run now reaches)."""
        if self.base_facts is None:
            return
        changed = {KNOBS[key].fact: value for key, value in repairs.items() if key in KNOBS}
        if "optim.lr" in repairs and self.configured_lr > 0:
            changed["lr"] = self.base_facts.lr * repairs["optim.lr"] / self.configured_lr
        if "warmup_steps" in changed:
            changed["warmup_steps"] = int(changed["warmup_steps"])
        self.monitor.update_facts(dataclasses.replace(self.base_facts, **changed))

    def _record(self, alarm: Alarm, cause: Cause, **fields: object) -> None:
        record = {"kind": Kind.REPAIR, "step": alarm.step, "alarm": alarm.name, "cause": cause.cause,
                  "title": cause.title, "evidence": cause.evidence, **fields}
        self.monitor.repaired(record)


def _shown(value: float | None) -> str:
    return "unset" if value is None else f"{value:g}"
