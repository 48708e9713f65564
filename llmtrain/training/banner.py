"""The run's banner: what is about to be trained, how, on what."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmtrain.config.derived import (
    Degrees,
    SeqLenStage,
    degrees_of,
    describe_lr,
    micro_batch_size_derived,
    resolved_warmup_steps,
)
from llmtrain.config.finetune import is_lora, quantized_base
from llmtrain.config.schema import LOW_BIT_OPTIMIZERS, Config, Precision, SeqLenKeep
from llmtrain.engine.schedule import final_lr, held_lr_text, lr_at
from llmtrain.engine.state import TrainState
from llmtrain.lora import trainable_count
from llmtrain.preflight.compute import ComputeEstimate, estimate_compute, format_seconds
from llmtrain.preflight.estimate import describe_footprint
from llmtrain.preflight.parameters import trainable_text
from llmtrain.qlora import nf4_footprint
from llmtrain.training.compile_trial import TIMED_STEPS, WARM_STEPS, CompileChoice
from llmtrain.training.parts import Context, TrainModule
from llmtrain.training.plan import Plan


def lora_text(cfg: Config, module: TrainModule) -> str:
    """The banner's finetune row: the adapters, and what trains of the built model."""
    f = cfg.finetune
    trainable, total = trainable_count(module.model)
    quantized = nf4_footprint(module.model) if quantized_base(cfg) else (0, 0)
    return (f"{'QLoRA' if quantized[0] else 'LoRA'} rank {f.rank}, alpha {f.alpha:g} (scaling {f.alpha / f.rank:g}) "
            f"on {', '.join(f.targets)}: {trainable_text(trainable, total)}, every other weight frozen"
            + (f"; {describe_footprint(*quantized)}" if quantized[0] else ""))


def print_banner(context: Context, plan: Plan, module: TrainModule, state: TrainState) -> None:
    """The banner on the console: model, batch, stages, accumulation, steps, the estimated time,
    optimizer, device, data, checkpoints and the pre-flight verdicts, one row each (`state`: the
    step a resumed run starts at)."""
    cfg, layout, device, data, check, runtime = (context.cfg, context.layout, context.device, context.data,
                                                 context.check, context.runtime)
    optimizer, seq_len, resumed = module.optimizer, plan.seq_len, context.resume_from is not None
    accum, total_steps, peak_lr = plan.accumulation_steps, plan.total_steps, plan.effective_lr
    estimate = run_estimate(context)
    compiles = cfg.optim.name in LOW_BIT_OPTIMIZERS  # torchao compiles its optimizer step on first use
    scaled = "" if peak_lr == cfg.optim.lr else (
        f" -> {peak_lr:g} ({cfg.schedule.lr_scaling.value} scaling from batch {cfg.schedule.reference_batch_size} "
        f"to {cfg.global_batch_size})")
    context.dashboard.banner(
        f"llmtrain: {cfg.model.name} on {cfg.data.source.value} -> {context.run_dir}",
        [
            # the check's counts: the same numbers, under the same names, as `llmtrain check` and the report
            ("parameters", check.facts.parameters.text()
                           + (f", weights from {cfg.model.init_from}" if cfg.model.init_from and not resumed else "")),
            *([("finetune", lora_text(cfg, module))] if is_lora(cfg) else []),
            ("batch", f"{cfg.global_batch_size} sequences x {seq_len} tokens = {plan.tokens_per_step:,} tokens/step"),
            *([("seq_len stages", describe_stages(plan.seq_len_stages, accum * layout.dp_size,
                                                  cfg.data.seq_len_keep))]
              if len(plan.seq_len_stages) > 1 else []),
            ("accumulation", f"{accum} micro-batch{'es' if accum > 1 else ''} of {cfg.micro_batch_size} per process "
                             f"(world size {layout.world_size}{_engine(cfg, device) if layout.distributed else ''})"
                             f"{' (derived: micro_batch_size not set)' if micro_batch_size_derived(cfg) else ''}"),
            ("steps", f"{total_steps:,} (warmup {resolved_warmup_steps(cfg.schedule, plan.schedule_steps)}, "
                      f"{describe_schedule(cfg, total_steps, plan.schedule_steps, peak_lr)}), "
                      f"{plan.total_micro_batches * cfg.micro_batch_size * seq_len * layout.dp_size:,} tokens"),
            *([("time", time_text(estimate, total_steps - state.step, total_steps))] if estimate else []),
            ("optimizer", f"{cfg.optim.name.value} lr {describe_lr(cfg)}{scaled}, {type(optimizer).__name__}"
                          f"{' (fused)' if optimizer.defaults.get('fused') else ''}"
                          f"{'; its step compiles during step 1 (once: ~30-40 s on CPU)' if compiles else ''}"),
            *([("compile", compile_text(context.compiling))] if shows_compile(context.compiling) else []),
            ("device", f"{device}, {runtime.precision.name.value}"
                       f"{' (auto)' if cfg.precision.name is Precision.auto else ''}, "
                       f"{threads_text(runtime.threads, layout.world_size, runtime.threads_reason)}, "
                       f"seed {runtime.seed}"
                       f"{' (drawn)' if cfg.seed is None else ''}{', deterministic' if cfg.deterministic else ''}"),
            ("data", f"{data.meta['train_tokens']:,} train / {data.meta['val_tokens']:,} val tokens, "
                     f"vocab {data.vocab_size}{_padded_vocab(cfg, plan.model_vocab_size, data.vocab_size)}, "
                     f"{cfg.data.tokenizer.value} tokens"),
            ("baseline", f"unigram entropy {data.unigram_entropy:.4f} nats/token: the loss to beat"),
            ("checkpoints", f"every {cfg.checkpoint.every_steps or '-'} steps / {cfg.checkpoint.every_minutes or '-'} "
                            f"min, keep {cfg.checkpoint.keep_last}{' + best' if cfg.checkpoint.keep_best else ''}"
                            f"{', sharded files (every rank its shards)' if module.sharded_files else ''}; "
                            f"non-finite: {cfg.checkpoint.on_nonfinite.value}"
                            + (f"; resumed at step {state.step}" if resumed else "")),
            ("check", f"{len(check.rows) - len(check.warnings) - len(check.failures)} of {len(check.rows)} pre-flight "
                      f"items pass" + ("" if check.warnings or check.failures else " (llmtrain check)")),
            *[(f"  {row.status.value.lower()}", f"{row.item}: {row.seen}" + (f" -> {row.fix}" if row.fix else ""))
              for row in check.failures + check.warnings],
        ],
    )


def describe_schedule(cfg: Config, total_steps: int, schedule_steps: int, peak_lr: float) -> str:
    """The banner's schedule: "cosine" over the whole run; "cosine over 200 of 300 steps: the last 100
    at the floor LR 0.0003" when it ends first; "cosine over 500 steps: the run ends at step 300, at
    LR 0.0021" when the run stops mid-schedule."""
    name = cfg.schedule.name.value
    if schedule_steps == total_steps:
        return name
    if schedule_steps < total_steps:
        held = held_lr_text(final_lr(peak_lr, schedule_steps, cfg.schedule), peak_lr)
        return (f"{name} over {schedule_steps:,} of {total_steps:,} steps: the last "
                f"{total_steps - schedule_steps:,} at {held}")
    last_lr = lr_at(total_steps - 1, peak_lr, schedule_steps, cfg.schedule)
    return f"{name} over {schedule_steps:,} steps: the run ends at step {total_steps:,}, at LR {last_lr:.3g}"


def shows_compile(choice: CompileChoice | None) -> bool:
    """The banner's compile row: when the blocks compile, a trial will measure, or a record decided."""
    return choice is not None and (choice.compile or choice.trial or choice.record is not None)


def compile_text(choice: CompileChoice) -> str:
    """'per block (auto: measured 1.12x faster compiled on this machine); step 1 compiles (~2.5 s last
    time)', or the trial to come, or a recorded no."""
    if choice.trial:
        return (f"{choice.why} (from step {WARM_STEPS + 1}, ~{2 * TIMED_STEPS} steps and a compile; the verdict "
                "is kept for the next run of this shape)")
    if not choice.compile:
        return choice.why
    took = (choice.record or {}).get("compile_s")
    cost = (f"~{took:.0f} s last time" if isinstance(took, (int, float))
            else "seconds from Inductor's cache, ~30 s cold on a CPU")
    return f"per block ({choice.why}); step 1 compiles ({cost})"


def threads_text(threads: int, world_size: int, reason: str = "") -> str:
    """The banner's CPU threads: "1 thread", "4 threads"; "... per process" when several processes
    each set their own; with threads=auto what was measured: "2 threads (auto: 2.0 of 2 cores free)"."""
    text = f"{threads} thread{'s' if threads != 1 else ''}" + (" per process" if world_size > 1 else "")
    return f"{text} ({reason})" if reason else text


def run_estimate(context: Context) -> ComputeEstimate | None:
    """The run's compute estimate per process: its FLOPs against the matmul rate measured at start-up
    (with the run's threads) times the assumed MFU; None when no rate was measured."""
    if context.runtime.matmul_flops is None:
        return None
    return estimate_compute(context.cfg, context.check.facts.shape, context.device, context.runtime.matmul_flops,
                            context.layout.world_size)


def time_text(estimate: ComputeEstimate, steps_left: int, total_steps: int) -> str:
    """The banner's time row: "~410 ms/step, ~6.8 min for 1,000 steps (estimate: 200 GFLOP/s
    measured x 33% assumed MFU)"; a resumed run's figure is for the steps it has left."""
    source = (f"(estimate: {estimate.matmul_flops / 1e9:,.0f} GFLOP/s measured x {estimate.assumed_mfu:.0%} "
              "assumed MFU)")
    if steps_left <= 0:
        return f"~{format_seconds(estimate.step_seconds)}/step; no step left of {total_steps:,} {source}"
    plural = "s" if steps_left != 1 else ""
    steps = (f"{total_steps:,} step{plural}" if steps_left == total_steps
             else f"the {steps_left:,} step{plural} left of {total_steps:,}")
    return (f"~{format_seconds(estimate.step_seconds)}/step, "
            f"~{format_seconds(estimate.step_seconds * steps_left)} for {steps} {source}")


def _padded_vocab(cfg: Config, model_vocab: int, data_vocab: int) -> str:
    """' (model 50304, padded to a multiple of 64)' when the model has ids the data never uses."""
    if model_vocab == data_vocab:
        return ""
    why = (f"padded to a multiple of {cfg.model.vocab_multiple}" if cfg.model.vocab_size is None
           else "model.vocab_size")
    return f" (model {model_vocab:,}, {why})"


def _engine(cfg: Config, device: torch.device) -> str:
    return f", {describe_layout(cfg, degrees_of(cfg))} over {'NCCL' if device.type == 'cuda' else 'gloo'}"


def describe_layout(cfg: Config, degrees: Degrees) -> str:
    """The device mesh in words, e.g. 'FSDP2 (...) x tensor parallel 2'."""
    parts = []
    if degrees.dp_shard > 1:
        parts.append("FSDP2 (parameters, gradients and optimizer state sharded)"
                     + (f" over {degrees.dp_shard} shards x {degrees.dp_replicate} replicas (HSDP)"
                        if degrees.dp_replicate > 1 else ""))
    elif degrees.dp_replicate > 1:
        parts.append("DDP + ZeRO-1 optimizer shards" if cfg.parallel.zero1 else "DDP")
    if degrees.tp > 1:
        parts.append(f"tensor parallel {degrees.tp}"
                     + (" with sequence parallel" if cfg.parallel.sequence_parallel else ""))
    if degrees.pp > 1:
        parts.append(f"pipeline parallel {degrees.pp} ({cfg.parallel.pp_schedule})")
    return " x ".join(parts) or "one process"


def describe_stages(stages: Sequence[SeqLenStage], accum: int, keep: SeqLenKeep) -> str:
    """E.g. '256 x 32 from step 0 -> 512 x 16 from 1000; 8,192 tokens/step throughout'."""
    shown = " -> ".join(f"{s.seq_len} x {s.micro_batch_size}{' from step' if i == 0 else ' from'} {s.start_step}"
                        for i, s in enumerate(stages))
    per_step = [s.seq_len * s.micro_batch_size * accum for s in stages]
    if keep is SeqLenKeep.tokens:
        return f"{shown} (length x micro-batch); {per_step[-1]:,} tokens/step throughout"
    return f"{shown} (length x micro-batch); tokens/step {' -> '.join(f'{n:,}' for n in per_step)}"
