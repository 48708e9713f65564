"""The loop's account of itself: the `train` record every log_interval (loss, lr, grad norm,
tokens/s), the `timing` record of sampled steps, the progress bar, and the closing summary.

tokens/s measures training only: its clock restarts after an evaluation and after a save.
Loss and grad norm are read from the device here, at log steps only (their one host sync).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from llmtrain.data.sampler import EpochOrder
from llmtrain.runs.files import Kind
from llmtrain.sinks import ConsoleSink
from llmtrain.training.stages import SeqLenStages
from llmtrain.training.state import TrainResult, TrainState
from llmtrain.training.timing import StepTimer


class Progress:
    def __init__(self, log_interval: int, timer: StepTimer, sink: ConsoleSink, metrics: Any,
                 result: TrainResult, flops_per_token: float, scaler: torch.amp.GradScaler | None, sampler: Any,
                 stages: SeqLenStages) -> None:
        self.log_interval = log_interval
        self.timer, self.sink, self.metrics, self.result = timer, sink, metrics, result
        self.flops_per_token, self.scaler, self.sampler, self.stages = flops_per_token, scaler, sampler, stages
        self.start = self.last_log_time = time.perf_counter()
        self.start_tokens = self.last_log_tokens = 0

    def begin(self, state: TrainState) -> None:
        """The loop starts (from step 0, or where a resume left off): the bar and the clocks."""
        self.sink.start()
        self.sink.advance(state.step)
        self.start = self.last_log_time = time.perf_counter()
        self.start_tokens = self.last_log_tokens = state.tokens

    def restart_clock(self, tokens: int | None = None) -> None:
        """Time spent since was not training (an evaluation, a save): tokens/s starts over here,
        and counts from `tokens` when given."""
        self.last_log_time = time.perf_counter()
        if tokens is not None:
            self.last_log_tokens = tokens

    def moved_to(self, state: TrainState) -> None:
        """After a rollback: the bar back at the checkpoint's step, and tokens/s counting from the
        checkpoint's tokens (against the count before it, the next rate came out negative)."""
        self.sink.advance(state.step)
        self.restart_clock(state.tokens)

    def step_done(self, state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
                  applied: bool, last_step: bool) -> None:
        """A step that counts: the result, the bar, the train record when due (a step whose update
        was not applied has its own record), and the timing record of a sampled step."""
        self.result.steps, self.result.tokens = state.step, state.tokens
        self.sink.advance(state.step)
        if applied and (state.step % self.log_interval == 0 or last_step):
            self._log(state, loss, grad_norm, lr)
        timing = self.timer.finish(state.step)
        if timing is not None:
            self.metrics.write(timing)

    def _log(self, state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        now = time.perf_counter()
        record = {
            "kind": Kind.TRAIN,
            "step": state.step,
            "tokens": state.tokens,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": (state.tokens - self.last_log_tokens) / max(now - self.last_log_time, 1e-9),
            "elapsed_s": now - self.start,
        }
        record["flops_per_s"] = record["tokens_per_s"] * self.flops_per_token
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        if isinstance(self.sampler, EpochOrder):
            record["epoch"] = self.sampler.epochs_done
        if self.stages.staged:
            record["seq_len"] = self.stages.current.seq_len
        self.last_log_time, self.last_log_tokens = now, state.tokens
        self.result.train_losses[state.step] = record["loss"]
        self.metrics.write(record)
        self.sink.log_train(record)

    def summary(self, state: TrainState, unigram_entropy: float) -> str:
        """The closing line's figures: steps, tokens and their rate, the final val loss against the
        unigram entropy, and what was skipped or rolled back."""
        elapsed = time.perf_counter() - self.start
        trained = state.tokens - self.start_tokens
        summary = (f"[bold]done[/]: step {state.step}, {trained:,} tokens in {elapsed:.1f}s "
                   f"({trained / max(elapsed, 1e-9):,.0f} tok/s)")
        result = self.result
        if result.val_losses and unigram_entropy > 0:
            below = 1 - result.final_val_loss / unigram_entropy
            summary += (
                f"; final val loss {result.final_val_loss:.4f} is {abs(below):.0%} {'below' if below >= 0 else 'ABOVE'} "
                f"the unigram entropy {unigram_entropy:.4f}"
            )
        if state.skipped_steps or state.rollbacks or state.alarm_skipped_steps:
            summary += (f"; {state.skipped_steps} non-finite step(s) skipped, {state.alarm_skipped_steps} skipped by "
                        f"alarms, {state.rollbacks} rollback(s)")
        return summary
