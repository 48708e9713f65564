"""The settings a run can change mid-run (`monitor.repair=true`): each a config key, its repaired
value kept in `TrainState.repairs` (so every checkpoint holds it and a resume keeps it), and what
applying it touches: the run's own config object (read every step: clipping, label smoothing) and
the optimizer's parameter groups (weight decay, epsilon, beta2, momentum). A fix that needs
anything else (the model's shape, its init, the data, the batch) needs a restart.

The LR is the exception: the config and the plan keep their peak LR, and `lr_factor` scales the
schedule's LR by the repaired peak over the configured one. The warmup is restarted rather than
changed: `WARMUP_RESTART` holds the step it restarted at, and the LR ramps up again from there over
`schedule.warmup_steps` steps (`warmup_ramp`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmtrain.config.schema import ADAM_FAMILY, Config, OptimizerName

WARMUP_RESTART = "warmup_restart_step"  # not a config key: the step the repaired warmup began at


@dataclass(frozen=True)
class Knob:
    """One repairable setting: its config key's section and field, and the optimizer's parameter-group
    key it lives in (None: read from the config each step, or re-derived)."""

    section: str
    name: str
    fact: str  # the monitor's RunFacts field it is, so later alarms are diagnosed against the repaired run
    group_key: str | None = None
    optimizers: tuple[OptimizerName, ...] = tuple(OptimizerName)  # where it means something
    on_config: bool = True  # False: the config keeps its value (the LR: lr_factor; the warmup: warmup_ramp)


_ADAM = ADAM_FAMILY  # eps and beta2 are group settings of torchao's 8-/4-bit AdamW too
KNOBS: dict[str, Knob] = {
    "optim.lr": Knob("optim", "lr", "lr", on_config=False),
    "optim.clip_grad_norm": Knob("optim", "clip_grad_norm", "clip"),
    "optim.weight_decay": Knob("optim", "weight_decay", "weight_decay", "weight_decay"),
    "optim.eps": Knob("optim", "eps", "eps", "eps", _ADAM),
    "optim.beta2": Knob("optim", "beta2", "beta2", "betas", _ADAM),
    "optim.momentum": Knob("optim", "momentum", "momentum", "momentum", (OptimizerName.sgd,)),
    "optim.label_smoothing": Knob("optim", "label_smoothing", "label_smoothing"),
    # The schedule keeps its own warmup (a shorter one would reshape its decay too): the restarted
    # warmup is warmup_ramp's, from the repair's step.
    "schedule.warmup_steps": Knob("schedule", "warmup_steps", "warmup_steps", on_config=False),
}
REPAIR_KEYS = (*KNOBS, WARMUP_RESTART)


def repairable(key: str, cfg: Config) -> bool:
    """Whether `key` can be changed mid-run in this run (its optimizer has the setting)."""
    knob = KNOBS.get(key)
    return knob is not None and cfg.optim.name in knob.optimizers


def current_value(key: str, cfg: Config, repairs: dict[str, float]) -> float | None:
    """The value the run uses now: repaired, or as configured."""
    if key in repairs:
        return repairs[key]
    knob = KNOBS[key]
    return getattr(getattr(cfg, knob.section), knob.name)


def apply_repairs(repairs: dict[str, float], cfg: Config, optimizer: torch.optim.Optimizer) -> None:
    """Set every repaired value on the run's config and in the optimizer's parameter groups. Idempotent:
    called at each repair, after a rollback (loading the optimizer's state put its groups back) and on
    resume. Weight decay goes only into the groups that decay (biases and norms never do)."""
    for key, value in repairs.items():
        knob = KNOBS.get(key)
        if knob is None or not repairable(key, cfg):
            continue
        if knob.on_config:
            setattr(getattr(cfg, knob.section), knob.name, value)
        if knob.group_key is None:
            continue
        for group in optimizer.param_groups:
            if knob.group_key not in group:
                continue
            if knob.group_key == "betas":
                group["betas"] = (group["betas"][0], value)
            elif knob.group_key != "weight_decay" or group["weight_decay"] > 0:
                group[knob.group_key] = value


def lr_factor(repairs: dict[str, float], step: int, configured_lr: float) -> float:
    """What repairs make of the schedule's LR at `step` (0-based): the repaired peak over the
    configured one (the config keeps its own, so the plan's peak LR stays what it derived), times a
    restarted warmup's ramp. 1 without repairs."""
    factor = repairs["optim.lr"] / configured_lr if "optim.lr" in repairs and configured_lr > 0 else 1.0
    return factor * warmup_ramp(repairs, step)


def warmup_ramp(repairs: dict[str, float], step: int) -> float:
    """The LR factor of a restarted warmup at `step` (0-based): a linear ramp from the restart, 1 without one."""
    start = repairs.get(WARMUP_RESTART)
    length = repairs.get("schedule.warmup_steps")
    if start is None or not length:
        return 1.0
    return min(1.0, (step - start + 1) / length)


def check_repairs(repairs: object) -> str | None:
    """What is wrong with a checkpoint's `repairs` (a forged or damaged trainer state), or None."""
    if not isinstance(repairs, dict):
        return "'repairs' is not an object"
    unknown = sorted(set(repairs) - set(REPAIR_KEYS))
    if unknown:
        return f"'repairs' holds keys other than {', '.join(REPAIR_KEYS)} ({', '.join(map(str, unknown[:3]))})"
    bad = [k for k, v in repairs.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0]
    return f"'repairs' holds values a run cannot reach ({', '.join(bad[:3])})" if bad else None
