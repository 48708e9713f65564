"""The step loop. `train(cfg)` sets the run up (`setup.build_run`) and calls `fit(run)`, which reads
top to bottom:

    for each optimizer step:
        stage     the sequence-length stage of the step (reshape the sampler, announce a new one)
        batch     the accumulation window's micro-batches; their real tokens, summed over the ranks
        lr        from the schedule, times the run's LR scale (cut by rollbacks and alarms)
        forward/backward per micro-batch: masked loss SUM / tokens in the window
        judge     unscale (fp16) -> clip -> finite? -> on a check step, the monitor's alarms
        apply or recover: the optimizer step; or the update is never applied and the run skips,
                  rolls back or stops (checkpoint.on_nonfinite, monitor.actions)
        log       every log_interval a `train` record and the console (progress.py)
        eval      every eval_interval, at the end and before a save (evaluator.py); not on a stop
        save      when due, at the end, or when SIGTERM / Ctrl-C asked to stop (then exit 75)
    then the final checkpoint (if its save failed in the loop, or a resumed run had no step left),
    the `end` record (also on a stop or failure), and the final weights on their own (then the
    `end` record once more, with the peaks of that save)

Each side concern is one call on the component that owns its cadence (the run's loop parts): the
monitor (a NullMonitor when monitoring is off), the checkpointer, the evaluator, the stages, the
progress log; the recovery (recovery.py) decides what becomes of a step that must not be applied
(one Outcome). The precision object does what fp16's loss scaling asks of the step (scaled
backward, unscale before clipping, the scaler's step), so the loop never asks whether there is one.

One host sync per step (the finiteness check) guarantees no NaN reaches the weights; everything
else that needs the host (loss values, grad norm) waits for the log interval.

Dividing each micro-batch's loss sum by the token count of the whole window makes the accumulated
gradient exactly the gradient of one big batch, whatever the micro-batch size, and lets a final
window with fewer micro-batches still step with the right scale.

Several processes (parallel=ddp|zero1|fsdp) run this same loop, each on its slice of every window:
the token count is summed over the ranks, gradients are averaged once per window, and every
decision that ends in a collective (stop, save, health action, skip) is taken together; rank 0
alone prints and writes. The single-process path is unchanged (no communication at all).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmtrain.checkpoint.write import save_final_weights
from llmtrain.config.schema import Config
from llmtrain.core import files
from llmtrain.core.errors import Interrupted, RunStopped
from llmtrain.core.files import Kind
from llmtrain.distributed.layout import all_reduce_sum, barrier, broadcast_from_main, end_process_group, layout_from_env
from llmtrain.engine.optim import set_lr as set_group_lr
from llmtrain.engine.repairs import lr_factor
from llmtrain.engine.schedule import lr_at
from llmtrain.engine.state import TrainResult, TrainState
from llmtrain.engine.step import Batch, accumulate_window, count_tokens, unscale_and_clip
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.monitor.probes import cuda_memory_mb, peak_rss_mb
from llmtrain.training.interrupts import StopRequest, signal_text
from llmtrain.training.recovery import Decision, Outcome
from llmtrain.training.run import Run
from llmtrain.training.setup import build_run


def train(cfg: Config, console: Dashboard | None = None,
          on_accept: Callable[[Path], None] | None = None) -> TrainResult:
    """Train as this process's part of the run: the whole run for one process; under torchrun or
    parallel.nproc, one rank of a ddp/zero1/fsdp run (rank 0 prints and writes). `on_accept(run_dir)`
    runs on rank 0 once the run is accepted (any resume fits), beside the writing of config.yaml:
    the CLI writes Hydra's record of the run there, so a refused run writes none."""
    layout = layout_from_env()
    try:
        # Signals from here on: a SIGTERM while setting up stops at once (StoppedBeforeStart); the
        # loop's StopRequest.looping() takes over (the same handlers, also the CLI's).
        with StopRequest.shared().setting_up():
            result = fit(build_run(cfg, console, layout, on_accept))
        barrier(layout)  # no rank tears the group down while another still talks to it (FSDP2 aborts)
        return result
    except RunStopped:
        barrier(layout)  # a stop (signal, non-finite, health) is decided on every rank at the same step
        raise
    finally:
        end_process_group()


def fit(run: Run) -> TrainResult:
    """Train `run` from its state's step to the last one; then the final checkpoint and weights."""
    layout, faults, plan, module, loop = run.context.layout, run.context.faults, run.plan, run.module, run.loop
    monitor, checkpointer, progress, precision = loop.monitor, loop.checkpointer, loop.progress, module.precision
    optimizer, timer, state = module.optimizer, progress.timer, run.state
    progress.begin(state)
    try:
        with StopRequest.shared().looping() as stop:
            while state.step < plan.total_steps:
                step = state.step
                faults.maybe_crash(layout.rank, step + 1)
                loop.stages.begin_step(step)
                timer.start(step + 1)  # every timing_interval-th step: where its time goes, for the report
                fetch_start = time.perf_counter()
                window, window_tokens = next_window(run, step)
                lr_schedule, lr = set_lr(run, step, state)
                monitor.waited_for_data(time.perf_counter() - fetch_start)
                monitor.before_forward(step + 1)
                timer.lap("other")

                loss = forward_backward(run, window, window_tokens)
                monitor.after_forward(loss)
                grad_norm = clip(run)
                loss, grad_norm = faults.poison(step + 1, loss, grad_norm)
                finite = precision.is_finite(loss, grad_norm)  # the step's one host sync
                outcome = health_verdict(run, state, step + 1, finite, loss, grad_norm, lr_schedule, window_tokens)
                timer.lap("other")
                applied = finite and outcome.decision is Decision.APPLY
                if applied:
                    precision.step(optimizer)  # under fp16, skipped if the gradients overflowed
                    outcome.state.consecutive_skips = 0
                monitor.after_step(applied=applied)
                optimizer.zero_grad(set_to_none=True)
                timer.lap("optimizer")
                if outcome.decision is not Decision.ROLLED_BACK:  # the step counts: its data was consumed
                    outcome.state.step += 1
                    outcome.state.tokens += window_tokens
                if not finite:  # the update was not applied: skip, roll back or stop
                    outcome = loop.recovery.on_nonfinite(outcome.state, loss, grad_norm)
                run.state = state = outcome.state
                if outcome.decision is Decision.ROLLED_BACK:  # the run goes on from the checkpoint's step
                    monitor.restart_interval(state.tokens)
                    progress.moved_to(state)  # the bar, and tokens/s counting from the checkpoint's tokens
                    continue

                last_step = state.step == plan.total_steps
                progress.step_done(state, loss, grad_norm, lr, applied, last_step)
                stop.step_finished()  # its duration: the first signal's message says how long a step takes
                # signals and the clock differ per rank: every rank stops and saves together
                stopping, saving = checkpointer.decide(state.step, stop.requested(state.step), last_step)
                # Asked to stop: save and leave, without evaluating (as long as several steps); the
                # resumed run evaluates on its cadence, and a checkpoint without a val loss is fine.
                if not stopping and loop.evaluator.maybe_run(state.step, forced=last_step or saving):
                    progress.restart_clock(state.tokens)  # tokens/s measures training, not evaluation
                if saving:
                    path = checkpointer.save(state)
                    progress.restart_clock()  # tokens/s measures training, not saving
                    if stopping:
                        raise interrupted(stop, state.step, path, run.context.run_dir)
        # Before the metrics writer closes (a save records its outcome in metrics.jsonl): the final
        # save failed in the loop, or a resumed run had no step left to take.
        checkpointer.save_final(state)
    finally:
        # The run's peaks, also when it stops or fails: the report's memory decision reads them.
        loop.metrics.write(end_record(run.state, run.context.device))
        run.context.dashboard.stop()
        monitor.close()
        loop.metrics.close()
    return finish(run)


def set_lr(run: Run, step: int, state: TrainState) -> tuple[float, float]:
    """The LR of step `step` (0-based) as the schedule has it (with what repairs made of it: a
    repair's LR is the run's own, not an LR overwritten behind the schedule's back), and as applied:
    times the run's LR scale (cut by rollbacks and alarms), set on every parameter group."""
    plan, cfg = run.plan, run.context.cfg
    lr_schedule = lr_at(step, plan.effective_lr, plan.schedule_steps, cfg.schedule)
    if state.repairs:
        lr_schedule *= lr_factor(state.repairs, step, cfg.optim.lr or 0.0)
    lr = lr_schedule * state.lr_scale
    for group in run.module.optimizer.param_groups:
        set_group_lr(group, lr)
    return lr_schedule, lr


def next_window(run: Run, step: int) -> tuple[list[Batch], int]:
    """The micro-batches of step `step` (a final window may have fewer), and their real target
    tokens over all ranks (instruction padding and prompts do not count)."""
    plan = run.plan
    window = [run.batches.train.next_batch()
              for _ in range(min(plan.accumulation_steps, plan.total_micro_batches - step * plan.accumulation_steps))]
    run.loop.progress.timer.lap("data")
    layout = run.context.layout  # the tp ranks and pipeline stages of one data-parallel rank count the same batch
    return window, int(all_reduce_sum([count_tokens(window)], layout)[0]) // layout.copies


def forward_backward(run: Run, window: list[Batch], window_tokens: int) -> torch.Tensor:
    """The window's gradients accumulated; its mean loss per token, the same on every rank."""
    layout, module = run.context.layout, run.module
    if module.pipeline is not None:  # the schedule runs the micro-batches through the stages
        loss = module.pipeline.forward_backward(window, window_tokens, layout.dp_size)
    else:
        loss = accumulate_window(module.train_model, window, run.context.device, module.precision,
                                 run.loop.progress.timer, label_smoothing=run.context.cfg.optim.label_smoothing,
                                 n_tokens=window_tokens, world_size=layout.dp_size)
    if layout.distributed:  # each rank's share -> the window's loss, the same on every rank
        torch.distributed.all_reduce(loss)
        loss /= layout.world_size
    return loss


def clip(run: Run) -> torch.Tensor:
    """The window's gradient norm over the whole model, clipped as configured (a tensor: no host sync)."""
    module, cfg = run.module, run.context.cfg.optim
    if module.pipeline is None:
        return unscale_and_clip(module.optimizer, module.precision, module.params, cfg)
    # Over every stage: the squares all-reduced, a tied weight's second copy counted once.
    norm = module.pipeline.clip_grad_norm(cfg.clip_grad_norm)
    if cfg.clip_grad_value is not None:
        torch.nn.utils.clip_grad_value_(module.params, cfg.clip_grad_value)
    return norm


def health_verdict(run: Run, state: TrainState, step: int, finite: bool, loss: torch.Tensor,
                   grad_norm: torch.Tensor, lr_schedule: float, window_tokens: int) -> Outcome:
    """On a check step with a finite loss and gradient: the monitor's alarms, acted on alike by
    every rank (rank 0's verdicts). APPLY on any other step: the monitor has nothing against it."""
    monitor = run.loop.monitor
    if not (finite and monitor.is_check(step)):
        monitor.skip_check()
        return Outcome(Decision.APPLY, state)
    alarms = monitor.check(step, loss, grad_norm, float(run.module.optimizer.param_groups[0]["lr"]), lr_schedule,
                           state.tokens + window_tokens, run.module.precision.loss_scale())
    alarms = broadcast_from_main(alarms, run.context.layout)  # every rank acts on rank 0's verdicts
    return run.loop.recovery.on_alarms(alarms, state)


def interrupted(stop: StopRequest, step: int, path: Path | None, run_dir: Path) -> Interrupted:
    """The stop's one line, after the CLI's `llmtrain: stopped:`: which signal, after which step, and
    where the checkpoint is."""
    saved = f"checkpoint saved: {path}" if path else "its checkpoint could NOT be saved (see above)"
    return Interrupted(f"{signal_text(stop.signal_name or 'a signal to another rank')} after step {step}; {saved}",
                       checkpoint=path, run_dir=run_dir)


def end_record(state: TrainState, device: torch.device) -> dict:
    """The `end` record: where the run ended, and its memory peaks."""
    return {"kind": Kind.END, "step": state.step, "tokens": state.tokens, "peak_rss_mb": peak_rss_mb(),
            **cuda_memory_mb(device)}


def finish(run: Run) -> TrainResult:
    """The final weights on their own (for `sample` and `export`), the peaks once more, the summary."""
    context, loop = run.context, run.loop
    weights = run.module.model_state.state_dict()  # every rank: under FSDP2 this gathers the shards on rank 0
    if context.layout.is_main:
        save_final_weights(weights, context.run_dir, run.state.step)
        # The peaks again, now that the final save and (FSDP2) the gather of the weights are done.
        # The metrics writer is closed: it appends this record to metrics.jsonl alone (TensorBoard
        # and W&B are finished), through a handle of its own.
        loop.metrics.write(end_record(run.state, context.device))
    summary = loop.progress.summary(run.state, context.data.unigram_entropy)
    context.dashboard.print(f"{summary}. Weights: {context.run_dir / files.FINAL_WEIGHTS}")
    return loop.result
