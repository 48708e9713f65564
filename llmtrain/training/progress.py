"""The loop's account of itself: the `train` record every log_interval (loss, lr, grad norm,
tokens/s), the `timing` record of sampled steps, the progress bar and its ETA (eta.py), the
slowdown warning (throughput.py), threads=auto's thread count following the machine
(threads_follow.py) and compile=auto's trial (compile_trial.py), both told of every step and every
pause, and the closing summary.

tokens/s measures training only: its clock restarts after an evaluation and after a save.
Loss and grad norm are read from the device here, at log steps only (their one host sync), and on
the steps shown besides: every step when steps are slow (> 10 s: eta.SLOW_STEP_S), and the first
step when the first log line would otherwise be more than 30 s away.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from llmtrain.core.files import Kind
from llmtrain.data.sampler import EpochOrder
from llmtrain.engine.precision import NumericPrecision
from llmtrain.engine.state import TrainResult, TrainState
from llmtrain.engine.timing import StepTimer
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.training.compile_trial import CompileTrial, NullCompileTrial
from llmtrain.training.eta import StepClock
from llmtrain.training.stages import SeqLenStages
from llmtrain.training.threads_follow import NullThreadFollower, ThreadFollower
from llmtrain.training.throughput import NullSlowdownWatch, SlowdownWatch


class Progress:
    """The `train` records, the console's progress and the closing summary; `precision` for the
    loss scale in the records, `sampler` for the epoch, `stages` for the sequence length, `threads`
    for threads=auto's count following the machine, `compile_trial` for compile=auto's measurement."""

    def __init__(self, *, log_interval: int, timer: StepTimer, dashboard: Dashboard, metrics: Any,
                 result: TrainResult, flops_per_token: float, precision: NumericPrecision, sampler: Any,
                 stages: SeqLenStages, eta: StepClock, slowdown: SlowdownWatch | NullSlowdownWatch,
                 threads: ThreadFollower | NullThreadFollower | None = None,
                 compile_trial: CompileTrial | NullCompileTrial | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.log_interval = log_interval
        self.timer, self.dashboard, self.metrics, self.result = timer, dashboard, metrics, result
        self.flops_per_token, self.precision, self.sampler, self.stages = flops_per_token, precision, sampler, stages
        self.clock, self.eta, self.slowdown = clock, eta, slowdown
        self.threads = threads or NullThreadFollower()
        self.compile_trial = compile_trial or NullCompileTrial()
        self.start = self.last_log_time = clock()
        self.start_tokens = self.last_log_tokens = self.step_tokens = 0
        self.clean = False  # the interval since the last log line had no evaluation, save or rollback (nor the warm-up)

    def begin(self, state: TrainState) -> None:
        """The loop starts (from step 0, or where a resume left off): the bar and the clocks."""
        self.dashboard.start()
        self.eta.begin(state.step)
        self.dashboard.advance(state.step, self.eta.eta_text())
        if self.eta.slow():  # predicted: say so now, before a first step that may take minutes
            per_step, _ = self.eta.per_step()
            self.dashboard.print(f"[dim]steps are estimated at ~{per_step:.0f} s each: every step is logged with its "
                            "time[/]", highlight=False)
        self.start = self.last_log_time = self.clock()
        self.start_tokens = self.last_log_tokens = self.step_tokens = state.tokens
        self.clean = False  # the first interval holds the warm-up step

    def restart_clock(self, tokens: int | None = None) -> None:
        """Time spent since was not training (an evaluation, a save): tokens/s starts over here,
        and counts from `tokens` when given; the ETA leaves the pause out of the steps' time."""
        self.last_log_time = self.clock()
        self.eta.paused()
        self.threads.paused()
        self.compile_trial.paused()
        self.clean = False
        if tokens is not None:
            self.last_log_tokens = self.step_tokens = tokens

    def moved_to(self, state: TrainState) -> None:
        """After a rollback: the bar back at the checkpoint's step, and tokens/s counting from the
        checkpoint's tokens (against the count before it, the next rate came out negative)."""
        self.eta.moved_to(state.step)
        self.dashboard.advance(state.step, self.eta.eta_text())
        self.restart_clock(state.tokens)

    def step_done(self, state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
                  applied: bool, last_step: bool) -> None:
        """A step that counts: the result, the bar, the train record when due (a step whose update
        was not applied has its own record), a console line for a slow or first step, the thread
        follower and the compile trial told of the step, and the timing record of a sampled step."""
        self.result.steps, self.result.tokens = state.step, state.tokens
        duration = self.eta.step_done(state.step)
        step_tokens, self.step_tokens = state.tokens - self.step_tokens, state.tokens
        self.dashboard.advance(state.step, self.eta.eta_text())
        slow = self.eta.slow(duration)
        if self.threads.step_done(state.step, state.tokens, self._stage()):  # may switch the count: a step boundary
            self.clean = False  # a step on a thread trial: its tokens/s are neither a collapse nor the reference
        timed, compiling_s = self.compile_trial.step_done(state.step)  # may compile or un-compile: a step boundary
        if timed:
            self.clean = False  # eager then compiled steps: a change of speed by design
        if compiling_s is not None:
            self.eta.set_aside_last()  # the compile's seconds say nothing of the steps to come
        if applied and (state.step % self.log_interval == 0 or last_step):
            self._log(state, loss, grad_norm, lr, self._timing_text(duration, slow), slow)
        elif applied and (slow or self.eta.first_line_due(state.step, self.log_interval)):
            # shown only (metrics.jsonl keeps its train records at log_interval, which the report reads)
            shown = {"step": state.step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                     "tokens_per_s": step_tokens / max(duration, 1e-9)}
            self.dashboard.log_train(shown, self._timing_text(duration, slow), above_bar=slow)
        timing = self.timer.finish(state.step)
        if timing is not None:
            self.metrics.write(timing)

    def _timing_text(self, duration: float, slow: bool) -> str:
        """'12.3 s/step  0:37 elapsed, ETA 3:24:10' (the step's own time when steps are slow)."""
        return (f"{duration:.1f} s/step  " if slow else "") + self.eta.status_text()

    def _log(self, state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, timing: str,
             slow: bool) -> None:
        now = self.clock()
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
        loss_scale = self.precision.loss_scale()
        if loss_scale is not None:  # fp16 with loss scaling
            record["loss_scale"] = loss_scale
        if isinstance(self.sampler, EpochOrder):
            record["epoch"] = self.sampler.epochs_done
        if self.stages.staged:
            record["seq_len"] = self.stages.current.seq_len
        self.last_log_time, self.last_log_tokens = now, state.tokens
        self.result.train_losses[state.step] = record["loss"]
        self.metrics.write(record)
        self.dashboard.log_train(record, timing, above_bar=slow)
        self.slowdown.interval(state.step, record["tokens_per_s"], self.clean, self._stage())
        self.clean = True

    def _stage(self) -> int | None:
        """The sequence length of a staged run (a new stage: new tokens/s by design); None unstaged."""
        return self.stages.current.seq_len if self.stages.staged else None

    def summary(self, state: TrainState, unigram_entropy: float) -> str:
        """The closing line's figures: steps, tokens and their rate, the final val loss against the
        unigram entropy, and what was skipped or rolled back."""
        elapsed = self.clock() - self.start
        trained = state.tokens - self.start_tokens
        summary = (f"[bold]done[/]: step {state.step}, {trained:,} tokens in {elapsed:.1f}s "
                   f"({trained / max(elapsed, 1e-9):,.0f} tok/s)")
        result = self.result
        if result.val_losses and unigram_entropy > 0:
            below = 1 - result.final_val_loss / unigram_entropy
            summary += (
                f"; final val loss {result.final_val_loss:.4f} is {abs(below):.0%} "
                f"{'below' if below >= 0 else 'ABOVE'} "
                f"the unigram entropy {unigram_entropy:.4f}"
            )
        if state.skipped_steps or state.rollbacks or state.alarm_skipped_steps:
            summary += (f"; {state.skipped_steps} non-finite step(s) skipped, {state.alarm_skipped_steps} skipped by "
                        f"alarms, {state.rollbacks} rollback(s)")
        return summary
