"""Evaluation on the run's fixed validation batches, at its cadence: every eval_interval steps,
at the last step and before every save (so a checkpoint knows its val loss, for keep_best)."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from llmtrain.checkpoint.policy import CheckpointPolicy
from llmtrain.runs.files import Kind
from llmtrain.sinks import ConsoleSink
from llmtrain.training.state import TrainResult
from llmtrain.training.step import Batch, evaluate


class Evaluator:
    def __init__(self, eval_interval: int, model: torch.nn.Module, batches: list[Batch], device: torch.device,
                 autocast: Callable[[], ContextManager], sink: ConsoleSink, metrics: Any, result: TrainResult,
                 saver: CheckpointPolicy) -> None:
        # model: the plain model (not the DDP wrapper): evaluation needs no gradient sync
        self.eval_interval, self.model, self.batches, self.device, self.autocast = (
            eval_interval, model, batches, device, autocast)
        self.sink, self.metrics, self.result, self.saver = sink, metrics, result, saver

    def maybe_run(self, step: int, forced: bool) -> bool:
        """Evaluate after `step` when due, or when `forced` (the last step, a save); True if it ran."""
        if not self.eval_interval or not (step % self.eval_interval == 0 or forced):
            return False
        val_loss = evaluate(self.model, self.batches, self.device, self.autocast)
        record = {"kind": Kind.EVAL, "step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
        self.result.val_losses[step] = val_loss
        self.metrics.write(record)
        self.sink.log_eval(record)
        self.saver.evaluated(step, val_loss)
        return True
