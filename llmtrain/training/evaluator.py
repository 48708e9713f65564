"""Evaluation at the run's cadence: every eval_interval steps, at the last step and before every
save but a requested stop's (so a checkpoint knows its val loss, for keep_best). First the loss on
the run's fixed validation batches, then every eval.tasks entry (held-out perplexity, multiple
choice, harness tasks), one `eval_task` record each.

Evaluation must not change training: the model's mode is restored (the scorer's and evaluate()'s
job), and the tasks run between saved and restored RNG states, so dropout and anything else that
draws from a global generator (the harness seeds Python's, NumPy's and torch's) draw the same
numbers as in a run without tasks. The samplers have generators of their own. Its time is not
training time: the health monitor's interval leaves it out (the loop restarts the tokens/s clock).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from llmtrain.checkpoint.policy import Checkpointer
from llmtrain.core.files import Kind
from llmtrain.engine.state import TrainResult
from llmtrain.engine.step import Batch, evaluate
from llmtrain.evaluation.scoring import Scorer, random_states_kept
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.monitor.watch import Monitor, NullMonitor


class Evaluator:
    """The run's evaluations, at its cadence; `model` is the plain model (not the DDP wrapper:
    evaluation needs no gradient sync), `tasks` the encoded eval.tasks (llmtrain.evaluation.tasks.Task),
    scored by `scorer` on that model."""

    def __init__(self, *, eval_interval: int, model: torch.nn.Module, batches: list[Batch], device: torch.device,
                 autocast: Callable[[], ContextManager], dashboard: Dashboard, metrics: Any, result: TrainResult,
                 checkpointer: Checkpointer, monitor: Monitor | NullMonitor, scorer: Scorer,
                 tasks: Sequence[Any] = (), pipeline: Any = None) -> None:
        self.eval_interval, self.model, self.batches, self.device, self.autocast = (
            eval_interval, model, batches, device, autocast)
        self.pipeline = pipeline  # pipeline parallel: the batches go through its stages (forward only)
        self.dashboard, self.metrics, self.result, self.checkpointer = dashboard, metrics, result, checkpointer
        self.tasks, self.scorer = list(tasks), scorer
        self.monitor = monitor  # a NullMonitor with monitor.enabled=false

    def maybe_run(self, step: int, forced: bool) -> bool:
        """Evaluate after `step` when due, or when `forced` (the last step, a save); True if it ran."""
        if not self.eval_interval or not (step % self.eval_interval == 0 or forced):
            return False
        started = time.perf_counter()
        val_loss = (self.pipeline.evaluate(self.batches) if self.pipeline is not None
                    else evaluate(self.model, self.batches, self.device, self.autocast))
        record = {"kind": Kind.EVAL, "step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
        self.result.val_losses[step] = val_loss
        self.metrics.write(record)
        self.dashboard.log_eval(record)
        self.checkpointer.evaluated(step, val_loss)
        self.monitor.evaluated(step, val_loss)
        self.run_tasks(step)
        self.monitor.paused(time.perf_counter() - started)
        return True

    def run_tasks(self, step: int) -> None:
        """Every task on the current weights: an `eval_task` record and a console line each. Every
        rank runs them (a sharded model needs all ranks in each forward); rank 0's sinks write."""
        if not self.tasks:
            return
        with random_states_kept():
            for task in self.tasks:
                record = {"kind": Kind.EVAL_TASK, "step": step, "task": task.spec.name, **task.run(self.scorer)}
                self.metrics.write(record)
                self.dashboard.log_eval_task(record)
