"""The loop's parts, built together once the banner is printed (the metrics writer opens files,
and W&B prints): the metrics writer (and the `start` record), the health monitor, the
checkpointer, the recovery, the evaluator, the sequence-length stages and the progress log. Each
component is built from its config section with keyword arguments."""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape

from llmtrain.checkpoint.layout import Checkpoint
from llmtrain.checkpoint.policy import Checkpointer, RankAgreement, SavedObjects
from llmtrain.config.schema import LOW_BIT_OPTIMIZERS, Precision
from llmtrain.core.files import Kind
from llmtrain.distributed.cores import CoreMeter
from llmtrain.distributed.layout import all_reduce_sum, broadcast_from_main, local_world_size
from llmtrain.engine.compiling import CompileRecords
from llmtrain.engine.schedule import lr_at
from llmtrain.engine.state import TrainResult, TrainState
from llmtrain.engine.timing import StepTimer
from llmtrain.evaluation.scoring import Scorer
from llmtrain.evaluation.tasks import Task
from llmtrain.hf.lora_base import BASE_RECORD
from llmtrain.metrics.writer import MetricsWriter, NullMetricsWriter
from llmtrain.monitor.diagnosis import run_facts
from llmtrain.monitor.probes import BlockSpan, device_memory_mb
from llmtrain.monitor.watch import Monitor, NullMonitor
from llmtrain.training.banner import run_estimate
from llmtrain.training.compile_trial import CompileTrial, NullCompileTrial
from llmtrain.training.eta import StepClock
from llmtrain.training.evaluator import Evaluator
from llmtrain.training.parts import Batches, Context, TrainModule
from llmtrain.training.plan import Plan
from llmtrain.training.progress import Progress
from llmtrain.training.recovery import Recovery
from llmtrain.training.repair import Repairer
from llmtrain.training.run import LoopParts
from llmtrain.training.stages import SeqLenStages
from llmtrain.training.threads_follow import ThreadFollower, thread_follower
from llmtrain.training.throughput import NullSlowdownWatch, SlowdownWatch


def build_loop_parts(context: Context, plan: Plan, module: TrainModule, batches: Batches, state: TrainState,
                     checkpoint: Checkpoint | None, eval_tasks: list[Task]) -> LoopParts:
    """The metrics writer (and its `start` record), then the monitor, checkpointer, recovery,
    evaluator, stages and progress; `checkpoint` (resumed from) restores the monitor's state."""
    cfg, layout, dashboard, warn = context.cfg, context.layout, context.dashboard, context.warn
    metrics = (MetricsWriter(context.run_dir, cfg.tensorboard, cfg.wandb.value, cfg.wandb_project,
                             context.config_dict, warn) if layout.is_main else NullMetricsWriter())
    # Appending (never truncating) keeps earlier records (a resumed run continues the same file).
    metrics.write(start_record(context, plan, state))
    result = TrainResult(run_dir=context.run_dir, steps=state.step, tokens=state.tokens,
                         unigram_entropy=context.data.unigram_entropy)
    monitor = build_monitor(context, plan, module, metrics, state, checkpoint)
    checkpointer = build_checkpointer(context, module, batches, metrics, monitor, state)
    repairer = Repairer(cfg=cfg, optimizer=module.optimizer, monitor=monitor,
                        say=lambda text: dashboard.print(escape(text)), schedule_steps=plan.schedule_steps,
                        base_facts=monitor.facts)
    repairer.refresh_facts(state.repairs)  # a resumed run goes on with its repairs (setup applied them)
    recovery = Recovery(cfg=cfg, module=module, monitor=monitor, checkpointer=checkpointer, metrics=metrics, warn=warn,
                        repairer=repairer)
    if cfg.monitor.repair and cfg.monitor.enabled and state.step == 0:
        # A repair of a cause that throws the weights off (an LR far too high) starts again from the
        # last good checkpoint: a fresh run's first is its initial state, before the first step.
        checkpointer.save(state)
    # The tasks score the plain model, as the val loss does; the window is the longest the run trains on.
    scorer = Scorer(module.model, plan.longest_seq_len, cfg.eval.batch_size, module.precision.autocast)
    evaluator = Evaluator(eval_interval=cfg.eval_interval, model=module.model, pipeline=module.pipeline,
                          batches=batches.val,
                          device=context.device, autocast=module.precision.autocast, dashboard=dashboard,
                          metrics=metrics, result=result, checkpointer=checkpointer, monitor=monitor, scorer=scorer,
                          tasks=eval_tasks)
    stages = SeqLenStages(stages=plan.seq_len_stages, sampler=batches.train, dashboard=dashboard, metrics=metrics,
                          processes_per_step=plan.accumulation_steps * layout.dp_size)
    estimate = run_estimate(context)
    compiling = context.compiling
    eta = StepClock(plan.total_steps, estimate.step_seconds if estimate else None,
                    first_step_compiles=cfg.optim.name in LOW_BIT_OPTIMIZERS or bool(compiling and compiling.compile))
    # compile=auto with no verdict for this shape on this machine: a few eager steps, then compiled ones.
    trial = (CompileTrial(model=module.model, key=compiling.key, records=CompileRecords(), metrics=metrics,
                          say=lambda text: dashboard.print(escape(text)))
             if compiling is not None and compiling.trial and compiling.key is not None else NullCompileTrial())
    runtime = context.runtime
    # threads=auto: the count follows the machine mid-run where it may (one process on the CPU: threads_follow.py).
    threads = thread_follower(cfg.threads, threads=runtime.threads, device=context.device,
                              world_size=layout.world_size, metrics=metrics,
                              say=lambda text: dashboard.print(escape(text)), hold=lambda: trial.running)
    # Rank 0 speaks for the run: it alone watches tokens/s, and measures how busy the cores are for the warning's words.
    slowdown = (SlowdownWatch(warn, metrics, runtime.threads, CoreMeter(),
                              sibling_cores=(local_world_size() - 1) * runtime.threads,
                              threads_now=(lambda: threads.threads) if isinstance(threads, ThreadFollower) else None)
                if layout.is_main else NullSlowdownWatch())
    progress = Progress(log_interval=cfg.log_interval, timer=StepTimer(cfg.timing_interval, context.device),
                        dashboard=dashboard, metrics=metrics, result=result, flops_per_token=plan.flops_per_token,
                        precision=module.precision, sampler=batches.train, stages=stages, eta=eta, slowdown=slowdown,
                        threads=threads, compile_trial=trial)
    return LoopParts(metrics=metrics, result=result, monitor=monitor, checkpointer=checkpointer, recovery=recovery,
                     evaluator=evaluator, stages=stages, progress=progress)


def start_record(context: Context, plan: Plan, state: TrainState) -> dict:
    """The `start` record: the run's plan, where it starts, on what, and the pre-flight verdicts."""
    runtime, check, device = context.runtime, context.check, context.device
    return {"kind": Kind.START, "time": time.time(), "steps": plan.total_steps, "tokens_per_step": plan.tokens_per_step,
            "resumed_from": str(context.resume_from) if context.resume_from else None, "step": state.step,
            "seed": runtime.seed, "check": {row.item: row.status.value for row in check.rows},
            "unigram_entropy": context.data.unigram_entropy, "vocab_size": plan.model_vocab_size,
            "parameters": check.facts.parameters.record(),
            "device": str(device), "device_memory_mb": device_memory_mb(device),
            "world_size": context.layout.world_size, "local_world_size": local_world_size(),
            "flops_per_token": plan.flops_per_token, "precision": runtime.precision.name.value}


def build_monitor(context: Context, plan: Plan, module: TrainModule, metrics: MetricsWriter | NullMetricsWriter,
                  state: TrainState, checkpoint: Checkpoint | None) -> Monitor | NullMonitor:
    """The health monitor's side of the loop (NullMonitor with monitor.enabled=false), resumed with
    the checkpoint's monitor state (windows, counts, active alarms)."""
    cfg = context.cfg
    if not cfg.monitor.enabled:
        return NullMonitor()
    fp16_unscaled = context.runtime.precision.name is Precision.fp16 and not module.precision.loss_scaling
    facts = run_facts(cfg, context.check.rows, peak_lr=plan.effective_lr, total_steps=plan.total_steps,
                      schedule_steps=plan.schedule_steps,
                      schedule_floor=lr_at(plan.schedule_steps, plan.effective_lr, plan.schedule_steps, cfg.schedule),
                      baseline=context.data.unigram_entropy, vocab_size=plan.model_vocab_size,
                      fp16_without_scaler=fp16_unscaled, tokens_per_step=plan.tokens_per_step)
    monitor = Monitor(cfg.monitor, module.model, run_dir=context.run_dir, dashboard=context.dashboard, metrics=metrics,
                      total_steps=plan.total_steps, fp16_without_scaler=fp16_unscaled,
                      flops_per_token=plan.flops_per_token, write_events=context.layout.is_main,
                      world_size=context.layout.world_size, facts=facts, peak_flops=context.runtime.matmul_flops,
                      span=pipeline_span(module.pipeline, cfg.model.n_layer) if module.pipeline is not None else None,
                      optimizer=module.optimizer)
    monitor.restart_interval(state.tokens)
    if checkpoint is not None:
        monitor.restore(checkpoint.trainer.get("monitor"))
    return monitor


def pipeline_span(pipeline: Any, n_layer: int) -> BlockSpan:
    """Pipeline parallel: the monitor measures this process's stages (its blocks by their index in
    the model, its parameters without a tied weight's second copy) and sums them over the pipeline."""
    blocks = pipeline.module.blocks
    return BlockSpan(modules=list(blocks.values()), indices=[int(key) for key in blocks], count=n_layer,
                     params=[p for p in pipeline.counted_parameters() if p.requires_grad], join=pipeline.join)


def build_checkpointer(context: Context, module: TrainModule, batches: Batches,
                       metrics: MetricsWriter | NullMetricsWriter, monitor: Monitor | NullMonitor,
                       state: TrainState) -> Checkpointer:
    """checkpoint.*: what a save holds (the state views, the precision, the sampler, the run's
    seed and the monitor's state) and how the ranks agree on it."""
    layout, seed = context.layout, context.runtime.seed
    # adapter-only checkpoints name the base they need (hf/lora_base.py): a resume checks it
    lora_base = {BASE_RECORD: context.lora_base} if context.lora_base is not None else {}
    saved = SavedObjects(model_state=module.model_state, optimizer_state=module.optimizer_state,
                         sampler=batches.train, precision=module.precision,
                         extra_state=lambda: {"run_seed": seed, **lora_base, **monitor.checkpoint_state()})
    ranks = RankAgreement(writer=layout.is_main, agree=lambda value: broadcast_from_main(value, layout),
                          vote=lambda values: all_reduce_sum(values, layout))
    return Checkpointer(cfg=context.cfg.checkpoint, run_dir=context.run_dir, saved=saved,
                        config_dict=context.config_dict, metrics=metrics, warn=context.warn, ranks=ranks,
                        shard_layout=(layout.rank, layout.world_size) if module.sharded_files else None,
                        resumed_at=state.step if context.resume_from else None)
