"""What the loop carries from step to step (TrainState, saved in every checkpoint) and what a
run returns (TrainResult)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainState:
    """Everything the loop itself carries from step to step (the rest lives in the objects)."""

    step: int = 0  # optimizer steps taken (including skipped ones: their data was consumed)
    tokens: int = 0
    best_val_loss: float | None = None
    best_step: int | None = None
    lr_scale: float = 1.0  # cut by rollbacks
    rollbacks: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    alarm_skipped_steps: int = 0  # updates dropped by a health alarm's skip_step action
    # monitor.repair: the settings changed mid-run, config key -> value (engine/repairs.py), kept by
    # every checkpoint so that a resume goes on with them
    repairs: dict[str, float] = field(default_factory=dict)
    repairs_made: int = 0  # how many (monitor.max_repairs caps them)


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    train_losses: dict[int, float] = field(default_factory=dict)  # step -> mean loss of that step
    val_losses: dict[int, float] = field(default_factory=dict)
    unigram_entropy: float = math.nan

    @property
    def final_val_loss(self) -> float:
        return self.val_losses[max(self.val_losses)] if self.val_losses else math.nan
