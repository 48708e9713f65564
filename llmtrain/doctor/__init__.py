"""`llmtrain doctor <experiment>`: short diagnostic experiments that tell a code bug from a bad setting.

The seed's debugging habits, each one command on the user's own (composed, validated) config:

- `overfit` (`overfit.py`): the config's model, dropout off, memorizes ONE fixed small batch with Adam
  at a constant LR. A correct model and loss get there within a few hundred steps whatever the real
  run's hyper-parameters, so a failure means a code bug, and quick probes name the suspects.
- `lr-range` (`lr_range.py`): an exponential LR sweep with the config's model, optimizer, clipping and
  precision on fresh batches, stopped when the loss diverges; suggests a peak LR.
- `grad-check` (`grad_check.py`): gradients with activation checkpointing on and off, in fp32 and under
  autocast, and accumulated over micro-batches as the train loop does against the whole batch at once.
- `eval-consistency` (`eval_consistency.py`): eval mode is deterministic and equals train mode with
  dropout off, dropout is random in train mode, and the train loop's `evaluate` leaves the model in
  train mode.

`bench.py` holds what they share: the bench (device, data, models), the out-dir and strict-JSON
helpers, the gradient helpers and the `Check` table. This file holds `EXPERIMENTS` and `run_doctor`.

Everything reuses the train loop's building blocks (training/setup.py's runtime, data, train
sampler and model builders, `accumulate_window`, `evaluate`, `build_optimizer`, `clip_gradients`,
the autocast factory, engine/modes.py's train/eval-mode probe), so what is checked is the code
`llmtrain train` runs, set up as it sets up. Every experiment takes an optional model factory
(`build_model(model_cfg, vocab_size) -> nn.Module`, default `GPT`): the tests hand in deliberately
broken models and check that each experiment catches them. The measured comparisons are `Check`s,
each a `Finding` (core/findings.py) printed by the shared findings table.

Only the standard library and llmtrain's config are imported here: `llmtrain doctor --help` imports
`EXPERIMENTS` and must not pay for torch. The experiment modules are imported when an experiment
runs (`run_doctor`) or when one of their names below is first looked up (`from llmtrain.doctor import
run_overfit` works as before).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtrain.config.finetune import is_lora
from llmtrain.config.schema import Config
from llmtrain.core.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console

    from llmtrain.doctor.bench import ModelFactory

EXPERIMENTS: dict[str, str] = {
    "overfit": "memorize one small batch; failing means a code bug, not a hyper-parameter",
    "lr-range": "exponential LR sweep until the loss diverges; suggests a peak LR",
    "grad-check": "gradients with and without activation checkpointing, fp32 vs autocast, accumulated vs whole batch",
    "eval-consistency": "eval mode deterministic and equal to train mode without dropout; evaluation restores "
    "train mode",
}

# Imported on first use (PEP 562 `__getattr__` below): these modules import torch.
_EXPORTS = {
    "run_overfit": "overfit", "OverfitResult": "overfit", "probe_targets": "overfit",
    "run_lr_range": "lr_range", "LRRangeResult": "lr_range",
    "run_grad_check": "grad_check", "GradCheckResult": "grad_check",
    "run_eval_consistency": "eval_consistency", "EvalConsistencyResult": "eval_consistency",
    "Check": "bench", "ModelFactory": "bench",
}
__all__ = ["EXPERIMENTS", "run_doctor", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"llmtrain.doctor.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'llmtrain.doctor' has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------


def run_doctor(
    experiment: str, cfg: Config, out_dir: Path, console: Console, build_model: ModelFactory | None = None
) -> int:
    """Run one experiment; 0 when it passed, 1 when it found a problem (the console says which)."""
    from llmtrain.doctor.eval_consistency import run_eval_consistency
    from llmtrain.doctor.grad_check import run_grad_check
    from llmtrain.doctor.lr_range import run_lr_range
    from llmtrain.doctor.overfit import run_overfit

    runners: dict[str, Callable[..., Any]] = {
        "overfit": run_overfit, "lr-range": run_lr_range, "grad-check": run_grad_check,
        "eval-consistency": run_eval_consistency,
    }
    if experiment not in runners:
        raise UserError(f"'{experiment}' is not a doctor experiment; valid experiments: {', '.join(EXPERIMENTS)}.")
    if is_lora(cfg):  # the experiments build and train a fresh model of their own: every weight
        method = f"finetune={getattr(cfg.finetune.method, 'value', cfg.finetune.method)}"
        raise UserError(f"llmtrain doctor {experiment} trains a freshly built model's every weight, and does not "
                        f"run with {method} yet; drop {method} (the experiments' findings about the model "
                        "and the optimizer hold for the base model), or check a LoRA run with `llmtrain check`.")
    result = runners[experiment](cfg, out_dir, console, build_model=build_model)
    return 0 if result.passed else 1
