"""The train loop. Read it top to bottom:

    set up (seed, threads, device, data, model, optimizer, precision), resume from a checkpoint
    for each optimizer step:
        gather the accumulation window's micro-batches and count their real tokens
        forward -> masked loss SUM / tokens in the window -> backward   (per micro-batch)
        unscale (fp16) -> clip -> finite? -> optimizer step -> zero grad (LR from the schedule)
        not finite: the update is never applied; skip, roll back or stop (checkpoint.on_nonfinite)
        every log_interval: metrics.jsonl and the console
        every eval_interval: eval mode on fixed validation batches -> back to train mode
        checkpoint when due, or when SIGTERM / Ctrl-C asked to stop (then exit 75)
    save the final checkpoint and weights into the run dir

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

import contextlib
import dataclasses
import json
import math
import os
import random
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from rich.console import Console
from rich.markup import escape
from torch.nn.parallel import DistributedDataParallel

from llmtrain.check import CheckFailed, run_check
from llmtrain.check import render as render_check
from llmtrain.checkpoint import (
    SHAPE_KEYS,
    Checkpoint,
    CheckpointError,
    CheckpointPolicy,
    TrainState,
    config_changes,
    describe_write_error,
    find_good_checkpoint,
    load_checkpoint,
    newest_good_checkpoint,
    remove_stale_temps,
    restore_rng,
    resume_checkpoint,
    resume_point,
    set_damaged_aside,
    tensor_bytes,
    write_atomically,
)
from llmtrain.config import (
    CheckpointFormat,
    CompileMode,
    Config,
    ConfigError,
    MonitorAction,
    NonFinitePolicy,
    ParallelMode,
    Precision,
    Sampling,
    SeqLenKeep,
    SeqLenStage,
    accumulation_steps,
    config_to_dict,
    describe_lr,
    effective_lr,
    micro_batch_size_derived,
    model_vocab_size,
    resolved_warmup_steps,
    seq_len_of,
    seq_len_stages,
    stage_at,
    total_micro_batches,
    total_steps,
    validate,
)
from llmtrain.data import EpochSampler, InstructionSampler, RandomWindowSampler, prepare_data
from llmtrain.data.sampler import IGNORE_INDEX, EpochOrder
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import HealthStop, Interrupted, NonFiniteStop, RunStopped, SaveFailed, UserError
from llmtrain.health import HealthWatch
from llmtrain.interrupts import StopRequest, hold_in_cpp
from llmtrain.model import GPT, flops_per_token, param_count
from llmtrain.monitor import Alarm
from llmtrain.optim import build_optimizer, clip_gradients
from llmtrain.parallel import (
    ConsolidatedOptimizerState,
    Layout,
    ShardedModelState,
    ShardedOptimizerState,
    all_reduce_sum,
    barrier,
    broadcast_from_main,
    default_threads,
    end_process_group,
    layout_from_env,
    local_world_size,
    resolve_device,
    shard_model,
    start_process_group,
    zero_redundancy,
)
from llmtrain.precision import autocast_factory, build_grad_scaler, resolve_precision
from llmtrain.probes import cuda_memory_mb, device_memory_mb, peak_rss_mb
from llmtrain.schedule import lr_at
from llmtrain.sinks import ConsoleSink, MetricsSink, NullSink
from llmtrain.timing import StepTimer

Batch = tuple[torch.Tensor, torch.Tensor]


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


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed cross-entropy over real tokens; targets equal to IGNORE_INDEX (prompt tokens,
    padding) count for nothing."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum",
        label_smoothing=label_smoothing,
    )


def count_tokens(batches: Iterable[Batch]) -> int:
    """Real (non-ignored) target tokens in a window, counted on the host before the batches move."""
    return int(sum(int((y != IGNORE_INDEX).sum()) for _, y in batches))


@contextlib.contextmanager
def deferred_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """No gradient communication inside (DDP's no_sync; FSDP2 holds its reduce-scatter)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def accumulate_gradients(
    model: torch.nn.Module,
    batches: list[Batch],
    device: torch.device,
    autocast: Callable[[], ContextManager],
    scaler: torch.amp.GradScaler | None = None,
    label_smoothing: float = 0.0,
    n_tokens: int | None = None,
    world_size: int = 1,
    timer: StepTimer | None = None,
) -> torch.Tensor:
    """Forward/backward over one accumulation window; returns the window's mean loss (a tensor).

    The loss is summed over real tokens and divided by `n_tokens`, the window's tokens over all
    ranks (default: this window's). Under DDP, which averages the ranks' gradients, each rank's
    loss is also multiplied by `world_size`, and gradients are synchronized once, on the window's
    last micro-batch (no_sync before): the result is the gradient one process would compute.
    `timer` (on sampled steps) times the copies to the device, each forward and each backward."""
    n_tokens = max(1, n_tokens if n_tokens is not None else count_tokens(batches))
    lap = timer.lap if timer is not None else lambda phase: None
    window_loss = torch.zeros((), device=device)
    for i, (x, y) in enumerate(batches):
        if device.type == "cuda":  # page-locked: the copy runs asynchronously (nanoGPT does the same)
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        lap("data")
        defer_sync = world_size > 1 and i < len(batches) - 1
        with deferred_gradient_sync(model) if defer_sync else contextlib.nullcontext():
            with autocast():
                loss = loss_sum(model(x), y, label_smoothing) / n_tokens
                if world_size > 1:
                    loss = loss * world_size
            lap("forward")
            (scaler.scale(loss) if scaler is not None else loss).backward()
        lap("backward")
        window_loss += loss.detach()
    return window_loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Batch], device: torch.device, autocast: Callable[[], ContextManager]) -> float:
    """Mean loss per real token over fixed batches, in eval mode (dropout off); restores train mode."""
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float32 if device.type == "mps" else torch.float64)
    for x, y in batches:
        with autocast():
            total += loss_sum(model(x.to(device)), y.to(device)).to(total.dtype)
    model.train()
    return total.item() / max(1, count_tokens(batches))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def use_deterministic_algorithms(device: torch.device, on: bool) -> None:
    """Deterministic kernels only (an op without one raises instead of varying), or the default.
    Set on every run: the switch is process-wide, and an in-process sweep must not inherit it."""
    if on and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS reductions
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(on)


def train(cfg: Config, console: ConsoleSink | None = None,
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
            result = _train(cfg, console, layout, on_accept)
        barrier(layout)  # no rank tears the group down while another still talks to it (FSDP2 aborts)
        return result
    except RunStopped:
        barrier(layout)  # a stop (signal, non-finite, health) is decided on every rank at the same step
        raise
    finally:
        end_process_group()


def _train(cfg: Config, console: ConsoleSink | None, layout: Layout,
           on_accept: Callable[[Path], None] | None = None) -> TrainResult:
    # ---- set-up: everything that can fail on user input fails here, before any compute --------
    validate(cfg)
    if cfg.out_dir is None:
        raise ConfigError("'out_dir' is not set; give a run directory, e.g. out_dir=runs/first.")
    run_dir = Path(cfg.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    if device.type == "cuda" and layout.distributed:  # one GPU per local rank
        device = torch.device("cuda", layout.local_rank)
        torch.cuda.set_device(device)
    start_process_group(layout, device)
    # seed=null: draw one, and log it, so even an unseeded run can be repeated (rank 0 draws for all).
    run_seed = broadcast_from_main(cfg.seed if cfg.seed is not None else secrets.randbelow(2**31), layout)
    seed_everything(run_seed)
    threads = cfg.threads or default_threads()
    torch.set_num_threads(threads)
    use_deterministic_algorithms(device, cfg.deterministic)
    # Subnormal floats (< 1.2e-38) make x86 CPU arithmetic many times slower; a run that drifts
    # into them slowed 2.8x here. The switch is per thread and torch's pools copy it when they
    # start: `llmtrain train` sets it before any compute (cli.flush_denormals_first); here it
    # reaches a fresh process (parallel.nproc ranks) and this thread. CPU only.
    torch.set_flush_denormal(cfg.flush_denormal)
    precision = dataclasses.replace(cfg.precision, name=resolve_precision(cfg.precision.name, device))

    steps_total = total_steps(cfg)
    micro_total = total_micro_batches(cfg)
    accum = accumulation_steps(cfg)
    seq_len = seq_len_of(cfg)
    stages = seq_len_stages(cfg)
    sink = console or ConsoleSink(steps_total, Console(quiet=True) if not layout.is_main else None)

    def warn(message: str) -> None:
        sink.print(f"[bold yellow]warning:[/] {message}")

    if not layout.is_main:
        barrier(layout)  # rank 0 prepares the data (once), the others then find it in the cache
    data = prepare_data(cfg.data, log=lambda msg: sink.print(f"[dim]{escape(msg)}[/]"), progress=layout.is_main)
    if layout.is_main:
        barrier(layout)
    longest = max(stage.seq_len for stage in stages)
    for split in ("train", "val") if cfg.eval_interval else ("train",):
        needed = longest if split == "train" else seq_len
        if data.meta[f"{split}_tokens"] < needed + 1:
            raise ConfigError(
                f"The {split} split has {data.meta[f'{split}_tokens']} tokens, fewer than one sequence of "
                f"{needed} (+1 target); use more text (or a larger data.max_bytes), "
                "a shorter data.seq_len, or a larger data.val_fraction."
            )
    vocab_size = model_vocab_size(cfg, data.vocab_size)
    # The pre-flight checklist (`llmtrain check`), now with the data's real size: FAIL refuses.
    check = run_check(cfg, measure_compute=False, data_meta=data.meta)
    if check.failures and not cfg.allow_check_failures:
        render_check(check, sink.console, estimates=True)
        raise CheckFailed(check.refusal(), check)
    config_dict = config_to_dict(cfg)
    checkpoint = agreed_resume(cfg.resume, run_dir, warn, device, layout)
    if checkpoint is not None:
        check_resumable(checkpoint, config_dict)
        check_same_tokenizer(checkpoint, data.tokenizer())

    model = GPT(cfg.model, vocab_size).to(device)
    model.train()
    if cfg.compile is CompileMode.on or (cfg.compile is CompileMode.auto and device.type == "cuda"):
        for block in model.blocks:  # in place, per block: parameter names (and checkpoints) stay the same
            block.compile()
    sharded = cfg.parallel.mode is ParallelMode.fsdp and layout.distributed
    if sharded:  # FSDP2: parameters split across the ranks, gathered per block for its compute
        shard_model(model, {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(precision.name))
    # The forward/backward goes through DDP (gradients averaged over the ranks, once per window);
    # everything else (state dicts, evaluation, the monitor's hooks) uses the plain model inside.
    # FSDP2 shards the model in place: it is its own training module.
    train_model = (DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
                   if layout.distributed and not sharded else model)
    optimizer = build_optimizer(model, cfg.optim, device.type, fused_ok=not sharded)
    if cfg.parallel.mode is ParallelMode.zero1 and layout.distributed:
        optimizer = zero_redundancy(optimizer)
    # How checkpoints read and write the full state: plainly, or gathered from the ranks' shards;
    # or, sharded files, each rank writing and reading its own shards.
    sharded_files = sharded and cfg.checkpoint.format is not CheckpointFormat.full
    model_state = ShardedModelState(model) if sharded else model
    optimizer_state = (ShardedOptimizerState(model, optimizer) if sharded
                       else ConsolidatedOptimizerState(optimizer, layout) if hasattr(optimizer, "consolidate_state_dict")
                       else optimizer)
    autocast = autocast_factory(precision, device.type)
    scaler = build_grad_scaler(precision, device.type)
    params = [p for p in model.parameters() if p.requires_grad]

    if checkpoint is not None and cfg.seed is None:
        # A drawn seed stays the run's seed on resume: the validation batches derive from it.
        run_seed = checkpoint.trainer.get("run_seed") or checkpoint.trainer["config"].get("seed") or run_seed
    # The sampler owns its RNG, so the data order is independent of init and dropout.
    data_seed = cfg.data.seed if cfg.data.seed is not None else run_seed
    train_batches: RandomWindowSampler | EpochSampler | InstructionSampler
    if data.meta.get("loss_mask"):  # instruction data: whole examples, prompt tokens masked out of the loss
        try:
            train_batches = InstructionSampler(data.tokens("train"), data.loss_mask("train"), data.offsets("train"),
                                               cfg.micro_batch_size, seq_len, data_seed, layout.rank,
                                               layout.world_size, epoch_multiple=cfg.global_batch_size)
        except ValueError as err:
            raise ConfigError(f"data=instruct: {err}; use more examples or a smaller micro_batch_size.") from None
    elif cfg.data.sampling is Sampling.epoch and not cfg.data.overfit_batches:
        try:
            train_batches = EpochSampler(data.tokens("train"), cfg.micro_batch_size, seq_len, data_seed,
                                         layout.rank, layout.world_size, epoch_multiple=cfg.global_batch_size)
        except ValueError as err:
            raise ConfigError(f"data.sampling=epoch: {err}; use more data, a shorter data.seq_len, a smaller "
                              "micro_batch_size, or data.sampling=random.") from None
    else:
        train_batches = RandomWindowSampler(data.tokens("train"), cfg.micro_batch_size, seq_len, data_seed,
                                            cfg.data.shuffle, cfg.data.overfit_batches, layout.rank, layout.world_size)
    val_batches = []
    if cfg.eval_interval:
        val_sampler = (
            InstructionSampler(data.tokens("val"), data.loss_mask("val"), data.offsets("val"),
                               min(cfg.micro_batch_size, len(data.offsets("val")) - 1), seq_len, data_seed + 1)
            if data.meta.get("loss_mask")
            else RandomWindowSampler(data.tokens("val"), cfg.micro_batch_size, seq_len, data_seed + 1)
        )
        val_batches = [tuple(t.to(device) for t in val_sampler.next_batch()) for _ in range(cfg.eval_batches)]

    state = TrainState()
    if checkpoint is not None:
        state = restore(checkpoint, config_dict, model_state, optimizer_state, scaler, train_batches, sink)
    resume_from = checkpoint.path if checkpoint is not None else None
    # Only now, with any resume accepted, is the run dir touched: a refused command leaves it as it was.
    if layout.is_main:
        accept_run(run_dir, config_dict, data.tokenizer(), cfg.resume == "never" and checkpoint is None, warn,
                   on_accept)

    tokens_per_step = cfg.global_batch_size * seq_len
    peak_lr = effective_lr(cfg)
    scaled = "" if peak_lr == cfg.optim.lr else (
        f" -> {peak_lr:g} ({cfg.schedule.lr_scaling.value} scaling from batch {cfg.schedule.reference_batch_size} "
        f"to {cfg.global_batch_size})")
    sink.banner(
        f"llmtrain: {cfg.model.name} on {cfg.data.source.value} -> {run_dir}",
        [
            ("parameters", f"{param_count(model):,} ({param_count(model, exclude_positions=True):,} without positions)"),
            ("batch", f"{cfg.global_batch_size} sequences x {seq_len} tokens = {tokens_per_step:,} tokens/step"),
            *([("seq_len stages", describe_stages(stages, accum * layout.world_size, cfg.data.seq_len_keep))]
              if len(stages) > 1 else []),
            ("accumulation", f"{accum} micro-batch{'es' if accum > 1 else ''} of {cfg.micro_batch_size} per process "
                             f"(world size {layout.world_size}{_engine(cfg, device) if layout.distributed else ''})"
                             f"{' (derived: micro_batch_size not set)' if micro_batch_size_derived(cfg) else ''}"),
            ("steps", f"{steps_total:,} (warmup {resolved_warmup_steps(cfg.schedule, steps_total)}, {cfg.schedule.name.value}), "
                      f"{micro_total * cfg.micro_batch_size * seq_len * layout.world_size:,} tokens"),
            ("optimizer", f"{cfg.optim.name.value} lr {describe_lr(cfg)}{scaled}, {type(optimizer).__name__}"
                          f"{' (fused)' if optimizer.defaults.get('fused') else ''}"),
            ("device", f"{device}, {precision.name.value}{' (auto)' if cfg.precision.name is Precision.auto else ''}, "
                       f"{threads_text(threads, layout.world_size)}, seed {run_seed}{' (drawn)' if cfg.seed is None else ''}"
                       f"{', deterministic' if cfg.deterministic else ''}"),
            ("data", f"{data.meta['train_tokens']:,} train / {data.meta['val_tokens']:,} val tokens, "
                     f"vocab {data.vocab_size}{_padded_vocab(cfg, vocab_size, data.vocab_size)}, "
                     f"{cfg.data.tokenizer.value} tokens"),
            ("baseline", f"unigram entropy {data.unigram_entropy:.4f} nats/token: the loss to beat"),
            ("checkpoints", f"every {cfg.checkpoint.every_steps or '-'} steps / {cfg.checkpoint.every_minutes or '-'} min, "
                            f"keep {cfg.checkpoint.keep_last}{' + best' if cfg.checkpoint.keep_best else ''}"
                            f"{', sharded files (every rank its shards)' if sharded_files else ''}; non-finite: {cfg.checkpoint.on_nonfinite.value}"
                            + (f"; resumed at step {state.step}" if resume_from else "")),
            ("check", f"{len(check.rows) - len(check.warnings) - len(check.failures)} of {len(check.rows)} pre-flight "
                      f"items pass" + ("" if check.warnings or check.failures else " (llmtrain check)")),
            *[(f"  {row.status.value.lower()}", f"{row.item}: {row.seen}" + (f" -> {row.fix}" if row.fix else ""))
              for row in check.failures + check.warnings],
        ],
    )

    # ---- the loop ------------------------------------------------------------------------------
    metrics = (MetricsSink(run_dir, cfg.tensorboard, cfg.wandb.value, cfg.wandb_project, config_dict, warn) if layout.is_main
               else NullSink())
    flops_token = flops_per_token(model, seq_len)
    # Appending (never truncating) keeps earlier records (a resumed run continues the same file).
    metrics.write({"kind": "start", "time": time.time(), "steps": steps_total, "tokens_per_step": tokens_per_step,
                   "resumed_from": str(resume_from) if resume_from else None, "step": state.step, "seed": run_seed,
                   "check": {row.item: row.status.value for row in check.rows}, "device": str(device),
                   "device_memory_mb": device_memory_mb(device), "world_size": layout.world_size,
                   "local_world_size": local_world_size(),
                   "flops_per_token": flops_token, "precision": precision.name.value})
    result = TrainResult(run_dir=run_dir, steps=state.step, tokens=state.tokens, unigram_entropy=data.unigram_entropy)
    # Test-only hook: poison the loss at these steps, each listed occurrence once ("6,6": twice).
    nan_steps = [int(s) for s in os.environ.get("LLMTRAIN_TEST_NAN_AT_STEPS", "").split(",") if s]
    # Test-only hook: "RANK:STEP" makes that rank fail at that step (a crashed DDP worker).
    crash_rank, _, crash_step = os.environ.get("LLMTRAIN_TEST_CRASH_RANK_AT", "").partition(":")
    slow_backward_for_tests(model, lambda: state.step)
    fp16_unscaled = precision.name is Precision.fp16 and scaler is None
    watch = (HealthWatch(cfg.monitor, model, run_dir, sink, metrics, steps_total, fp16_unscaled, flops_token,
                         write_events=layout.is_main, world_size=layout.world_size) if cfg.monitor.enabled else None)
    if watch is not None:
        watch.restart_interval(state.tokens)
        if checkpoint is not None and checkpoint.trainer.get("monitor"):
            watch.monitor.load_state_dict(checkpoint.trainer["monitor"])  # windows, counts, active alarms
    saver = CheckpointPolicy(cfg.checkpoint, run_dir, model_state, optimizer_state, scaler, train_batches, config_dict,
                             metrics, warn,
                             extra_state=lambda: {"run_seed": run_seed,
                                                  **({"monitor": watch.monitor.state_dict()} if watch else {})},
                             writer=layout.is_main, agree=lambda value: broadcast_from_main(value, layout),
                             shard_layout=(layout.rank, layout.world_size) if sharded_files else None)
    saver.last_saved_step = state.step if resume_from else None
    timer = StepTimer(cfg.timing_interval, device)
    sink.start()
    sink.advance(state.step)
    start = last_log_time = time.perf_counter()
    start_tokens = last_log_tokens = state.tokens
    try:
        with StopRequest.shared().looping() as stop:
            while state.step < steps_total:
                step = state.step
                if crash_rank and int(crash_rank) == layout.rank and step + 1 == int(crash_step):
                    raise RuntimeError(f"test crash of rank {layout.rank} at step {step + 1}")
                stage = stage_at(stages, step)
                if len(stages) > 1:
                    if (stage.micro_batch_size, stage.seq_len) != (train_batches.batch_size, train_batches.seq_len):
                        train_batches.reshape(stage.micro_batch_size, stage.seq_len)  # also on resume, silently
                    if step == stage.start_step:
                        stage_tokens = stage.micro_batch_size * stage.seq_len * accum * layout.world_size
                        if step:  # the first stage is in the banner
                            sink.print(f"sequence length {stage.seq_len}, micro-batch {stage.micro_batch_size} from "
                                       f"step {step + 1} on ({stage_tokens:,} tokens/step)")
                        metrics.write({"kind": "seq_len", "step": step, "seq_len": stage.seq_len,
                                       "micro_batch_size": stage.micro_batch_size, "tokens_per_step": stage_tokens})
                timer.start(step + 1)  # every timing_interval-th step: where its time goes, for the report
                fetch_start = time.perf_counter()
                window = [train_batches.next_batch() for _ in range(min(accum, micro_total - step * accum))]
                timer.lap("data")
                # real targets over all ranks (instruction padding and prompts do not count)
                window_tokens = int(all_reduce_sum([count_tokens(window)], layout)[0])
                lr_schedule = lr_at(step, peak_lr, steps_total, cfg.schedule)
                lr = lr_schedule * state.lr_scale
                for group in optimizer.param_groups:
                    group["lr"] = lr
                if watch is not None:
                    watch.data_seconds += time.perf_counter() - fetch_start
                    watch.before_forward(step + 1)
                timer.lap("other")

                loss = accumulate_gradients(train_model, window, device, autocast, scaler, cfg.optim.label_smoothing,
                                            n_tokens=window_tokens, world_size=layout.world_size, timer=timer)
                if layout.distributed:  # each rank's share -> the window's loss, the same on every rank
                    torch.distributed.all_reduce(loss)
                    loss /= layout.world_size
                if watch is not None:
                    watch.after_forward()
                if scaler is not None:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                grad_norm = clip_gradients(params, cfg.optim)
                if step + 1 in nan_steps:
                    nan_steps.remove(step + 1)
                    loss, grad_norm = loss * math.nan, grad_norm * math.nan
                # The step's one host sync: a NaN/Inf loss or gradient must never reach the weights.
                # (Under fp16 an inf gradient is the loss scaler's business: it skips and rescales.)
                finite = bool(torch.isfinite(loss) if scaler is not None else torch.isfinite(loss) & torch.isfinite(grad_norm))
                skip_update = False
                if finite and watch is not None and watch.is_check(step + 1):
                    alarms = watch.check(step + 1, loss, grad_norm, optimizer.param_groups[0]["lr"], lr_schedule,
                                         state.tokens + window_tokens,
                                         scaler.get_scale() if scaler is not None else None)
                    alarms = broadcast_from_main(alarms, layout)  # every rank acts on rank 0's verdicts
                    verdicts = [act_on_alarm(alarm, cfg, state, watch, saver, warn, model_state, optimizer_state, scaler)
                                for alarm in alarms]
                    if "rolled_back" in verdicts:  # the run goes on from the checkpoint's step
                        watch.after_step(applied=False)
                        watch.restart_interval(state.tokens)
                        optimizer.zero_grad(set_to_none=True)
                        sink.advance(state.step)
                        continue
                    skip_update = "skip" in verdicts
                elif watch is not None:
                    watch.probe = None  # a sampled step that was not checked: its activations are not reported later
                finite = finite and not skip_update
                timer.lap("other")
                if finite:
                    if scaler is not None:
                        scaler.step(optimizer)  # skips the step if the gradients overflowed
                        scaler.update()
                    else:
                        optimizer.step()
                    state.consecutive_skips = 0
                if watch is not None:
                    watch.after_step(applied=finite)
                optimizer.zero_grad(set_to_none=True)
                timer.lap("optimizer")
                state.step += 1
                state.tokens += window_tokens
                if not finite and not skip_update:
                    state = handle_nonfinite(cfg, state, loss, grad_norm, saver, metrics, warn, model_state, optimizer_state,
                                             scaler)
                    if state.step == step:  # rolled back: the loop goes on from the checkpoint's step
                        if watch is not None:
                            watch.restart_interval(state.tokens)
                        sink.advance(state.step)
                        continue

                result.steps, result.tokens = state.step, state.tokens
                sink.advance(state.step)
                last_step = state.step == steps_total
                if finite and (state.step % cfg.log_interval == 0 or last_step):  # a skip has its own record
                    now = time.perf_counter()
                    record = {
                        "kind": "train",
                        "step": state.step,
                        "tokens": state.tokens,
                        "loss": loss.item(),
                        "lr": lr,
                        "grad_norm": grad_norm.item(),
                        "tokens_per_s": (state.tokens - last_log_tokens) / max(now - last_log_time, 1e-9),
                        "elapsed_s": now - start,
                    }
                    record["flops_per_s"] = record["tokens_per_s"] * flops_token
                    if scaler is not None:
                        record["loss_scale"] = scaler.get_scale()
                    if isinstance(train_batches, EpochOrder):
                        record["epoch"] = train_batches.epochs_done
                    if len(stages) > 1:
                        record["seq_len"] = stage.seq_len
                    last_log_time, last_log_tokens = now, state.tokens
                    result.train_losses[state.step] = record["loss"]
                    metrics.write(record)
                    sink.log_train(record)
                timing = timer.finish(state.step)
                if timing is not None:
                    metrics.write(timing)
                stop.step_finished()  # its duration: the first signal's message says how long a step takes
                stopping = stop.requested(state.step)
                saving = saver.due(state.step) or stopping or (last_step and cfg.checkpoint.final)
                if layout.distributed:  # signals and the clock differ per rank: stop and save together
                    stop_votes, save_votes = all_reduce_sum([float(stopping), float(saving)], layout)
                    stopping, saving = stop_votes > 0, save_votes > 0
                if cfg.eval_interval and (state.step % cfg.eval_interval == 0 or last_step or saving):
                    val_loss = evaluate(model, val_batches, device, autocast)
                    record = {"kind": "eval", "step": state.step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
                    result.val_losses[state.step] = val_loss
                    metrics.write(record)
                    sink.log_eval(record)
                    saver.last_val = (state.step, val_loss)
                    # tokens/s measures training, not evaluation: restart its clock and count here.
                    last_log_time, last_log_tokens = time.perf_counter(), state.tokens
                if saving:
                    path = saver.save(state)
                    last_log_time = time.perf_counter()  # tokens/s measures training, not saving
                    if stopping:
                        saved = f"checkpoint saved to {path}" if path else "its checkpoint could NOT be saved (see above)"
                        raise Interrupted(f"stopped by {stop.signal_name or 'a signal to another rank'} after step "
                                          f"{state.step}; {saved}",
                                          checkpoint=path, run_dir=run_dir)
        # Before the sinks close (a save records its outcome in metrics.jsonl; this one, after
        # the loop, once raised on a closed file): the final save failed in the loop, or a
        # resumed run had no step left to take.
        if cfg.checkpoint.final and saver.last_saved_step != state.step:
            saver.save(state)
    finally:
        # The run's peaks, also when it stops or fails: the report's memory verdict reads them.
        metrics.write({"kind": "end", "step": state.step, "tokens": state.tokens, "peak_rss_mb": peak_rss_mb(),
                       **cuda_memory_mb(device)})
        sink.stop()
        if watch is not None:
            watch.close()
        metrics.close()

    # ---- the end: the final weights on their own, for `sample` and `export` --------------------
    weights = model_state.state_dict()  # every rank: under FSDP2 this gathers the shards on rank 0
    if layout.is_main:
        save_final_weights(weights, run_dir, state.step)
        # The peaks again, now that the final save and (FSDP2) the gather of the weights are done
        # (metrics is closed: this record goes to metrics.jsonl alone).
        metrics.write({"kind": "end", "step": state.step, "tokens": state.tokens, "peak_rss_mb": peak_rss_mb(),
                       **cuda_memory_mb(device)})
    elapsed = time.perf_counter() - start
    trained = state.tokens - start_tokens
    summary = f"[bold]done[/]: step {state.step}, {trained:,} tokens in {elapsed:.1f}s ({trained / max(elapsed, 1e-9):,.0f} tok/s)"
    if result.val_losses and data.unigram_entropy > 0:
        below = 1 - result.final_val_loss / data.unigram_entropy
        summary += (
            f"; final val loss {result.final_val_loss:.4f} is {abs(below):.0%} {'below' if below >= 0 else 'ABOVE'} "
            f"the unigram entropy {data.unigram_entropy:.4f}"
        )
    if state.skipped_steps or state.rollbacks or state.alarm_skipped_steps:
        summary += (f"; {state.skipped_steps} non-finite step(s) skipped, {state.alarm_skipped_steps} skipped by "
                    f"alarms, {state.rollbacks} rollback(s)")
    sink.print(f"{summary}. Weights: {run_dir / 'model.pt'}")
    return result


def slow_backward_for_tests(model: torch.nn.Module, current_step: Callable[[], int]) -> None:
    """Test-only hook, LLMTRAIN_TEST_SLOW_BACKWARD="STEP:SECONDS": every backward pass from that step
    on is held in C++ for SECONDS (a slow step: the main thread runs no bytecode meanwhile, so
    Python signal handlers wait)."""
    slow_from, _, slow_seconds = os.environ.get("LLMTRAIN_TEST_SLOW_BACKWARD", "").partition(":")
    if slow_from:
        next(model.parameters()).register_hook(
            lambda grad: hold_in_cpp(float(slow_seconds)) if current_step() + 1 >= int(slow_from) else None)


def accept_run(run_dir: Path, config_dict: dict, tokenizer: Tokenizer, fresh_start: bool,
               warn: Callable[[str], None], on_accept: Callable[[Path], None] | None) -> None:
    """The run is accepted (any resume fits): tidy the run dir and rewrite its description
    (config.yaml, tokenizer.json; through on_accept the CLI's .hydra/ record and train.log). Each
    file whole or not at all: a SIGTERM here (still setting up) cannot leave half of one."""
    remove_stale_temps(run_dir)  # one writer per run dir: leftovers are from a process that died
    if fresh_start:
        set_damaged_aside(run_dir, warn)  # resume=never refused good ones: only damaged ones are left
    config_text = yaml.safe_dump(config_dict, sort_keys=False).encode()
    write_atomically(run_dir / "config.yaml", lambda fh: fh.write(config_text))
    tokenizer_text = json.dumps(tokenizer.to_dict(), ensure_ascii=False).encode()
    write_atomically(run_dir / "tokenizer.json", lambda fh: fh.write(tokenizer_text))
    if on_accept is not None:
        on_accept(run_dir)


def threads_text(threads: int, world_size: int) -> str:
    """The banner's CPU threads: "1 thread", "4 threads"; "... per process" when several processes
    each set their own."""
    text = f"{threads} thread{'s' if threads != 1 else ''}"
    return text + " per process" if world_size > 1 else text


def handle_nonfinite(
    cfg: Config, state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor, saver: CheckpointPolicy,
    metrics: MetricsSink, warn: Callable[[str], None], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
) -> TrainState:
    """The update of this step was not applied. Skip it, roll back, or stop, as configured."""
    policy = cfg.checkpoint
    state.skipped_steps += 1
    state.consecutive_skips += 1
    action, why = policy.on_nonfinite, ""
    if action is NonFinitePolicy.skip and state.consecutive_skips >= policy.max_consecutive_skips:
        action, why = NonFinitePolicy.rollback, f"{state.consecutive_skips} non-finite steps in a row"
    target = None
    if action is NonFinitePolicy.rollback:
        if state.rollbacks >= policy.max_rollbacks:
            action, why = NonFinitePolicy.stop, f"it recurred after {state.rollbacks} rollback(s) (checkpoint.max_rollbacks)"
        else:
            target = agreed_good_checkpoint(saver, warn)
            if target is None:
                action, why = NonFinitePolicy.stop, "there is no checkpoint to roll back to yet"
    record = {"kind": "nonfinite", "step": state.step, "loss": loss.item(), "grad_norm": grad_norm.item(),
              "action": action.value, "consecutive": state.consecutive_skips, "skipped_total": state.skipped_steps}
    metrics.write(record)
    warn(f"non-finite loss/gradient at step {state.step} (loss {record['loss']}, grad norm {record['grad_norm']}): "
         f"the update was not applied; action: {action.value}{f' ({why})' if why else ''}")
    if action is NonFinitePolicy.stop:
        path = saver.save(state)  # the weights are still the last good ones
        saved = f"checkpoint: {path}" if path else "its checkpoint could NOT be saved (see above)"
        raise NonFiniteStop(
            f"non-finite loss or gradient at step {state.step}{f': {why}' if why else ''}. Nothing non-finite reached "
            f"the weights; {saved}. Likely causes: LR too high (optim.lr={cfg.optim.lr:g}), missing warmup, "
            "no gradient clipping, fp16 without loss scaling, or bad data. Check the grad_norm history in metrics.jsonl.",
            checkpoint=path, run_dir=saver.run_dir,
        )
    if action is NonFinitePolicy.rollback:
        return roll_back(target, state, policy.rollback_lr_factor, model, optimizer, scaler, metrics)
    return state


def agreed_good_checkpoint(saver: CheckpointPolicy, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies and reads, as rank 0 finds it, on every rank: one rank
    hashes the files, and all ranks roll back to the same step even if a file looks different from
    another node. Read, not just hashed: roll_back must not meet a file it cannot load."""
    return saver.agree(find_good_checkpoint(saver.run_dir, warn, readable=True) if saver.writer else None)


def agreed_resume(resume: str, run_dir: Path, warn: Callable[[str], None], device: torch.device,
                  layout: Layout) -> Checkpoint | None:
    """The checkpoint `resume=` names, chosen and verified by rank 0 and read by every rank: one
    rank hashes the files, and all resume from the same step. A refusal is raised on every rank."""
    if not layout.distributed:
        return resume_checkpoint(resume, run_dir, warn, device)
    found, chosen, refusal = None, None, None
    if layout.is_main:
        try:
            found = resume_checkpoint(resume, run_dir, warn, device)
            chosen = found.path if found is not None else None
        except UserError as err:
            refusal = str(err)
    chosen, refusal = broadcast_from_main((chosen, refusal), layout)
    if refusal is not None:
        raise ConfigError(refusal)
    if layout.is_main or chosen is None:
        return found
    return load_checkpoint(chosen, device, verify_files=False)


def roll_back(
    target: Path, state: TrainState, lr_factor: float, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None, metrics: MetricsSink,
) -> TrainState:
    """Reload weights, optimizer, scaler and RNG from a checkpoint; the data sampler is NOT rewound,
    so the windows since the checkpoint (the bad one included) are skipped."""
    checkpoint = load_checkpoint(target, next(model.parameters()).device, verify_files=False)  # verified: agreed_good_checkpoint
    checkpoint.load_into(model, optimizer)
    if scaler is not None and checkpoint.scaler is not None:
        scaler.load_state_dict(checkpoint.scaler)
    restore_rng(checkpoint.rng, checkpoint.trainer["rng"])
    restored = checkpoint.state
    restored.rollbacks = state.rollbacks + 1
    restored.lr_scale = state.lr_scale * lr_factor
    restored.skipped_steps = state.skipped_steps
    restored.alarm_skipped_steps = state.alarm_skipped_steps
    restored.consecutive_skips = 0
    metrics.write({"kind": "rollback", "step": state.step, "to_step": restored.step, "path": str(target),
                   "lr_scale": restored.lr_scale, "rollbacks": restored.rollbacks})
    return restored


def act_on_alarm(
    alarm: Alarm, cfg: Config, state: TrainState, watch: HealthWatch, saver: CheckpointPolicy,
    warn: Callable[[str], None], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
) -> str:
    """Carry out an alarm's configured action: "apply" (the update goes ahead), "skip" (this step's
    update is dropped) or "rolled_back" (`state` now holds the checkpoint's step and counters)."""
    action = MonitorAction(alarm.action)
    if action is MonitorAction.reduce_lr:
        state.lr_scale *= cfg.monitor.reduce_lr_factor
        watch.action_taken(alarm, f"LR scale now {state.lr_scale:g} (x{cfg.monitor.reduce_lr_factor:g})")
    elif action is MonitorAction.skip_step:
        state.alarm_skipped_steps += 1
        watch.action_taken(alarm, "this step's update was not applied")
        return "skip"
    elif action is MonitorAction.rollback:
        target = agreed_good_checkpoint(saver, warn)
        if target is None or state.rollbacks >= cfg.checkpoint.max_rollbacks:
            why = "no checkpoint to roll back to" if target is None else "checkpoint.max_rollbacks reached"
            action, alarm.action = MonitorAction.stop, f"stop ({why})"
        else:
            restored = roll_back(target, state, cfg.checkpoint.rollback_lr_factor, model, optimizer, scaler, watch.metrics)
            state.__dict__.update(dataclasses.asdict(restored))
            monitor_state = json.loads((target / "trainer_state.json").read_text()).get("monitor")
            if monitor_state:  # the monitor goes back too: a recurring pattern is raised again
                watch.monitor.load_state_dict(monitor_state)
            watch.action_taken(alarm, f"rolled back to step {restored.step} ({target})")
            return "rolled_back"
    if action is MonitorAction.stop:
        watch.after_step(applied=False)  # the check step's health record, before the run ends
        # Not saved as active: a resumed run that still shows the pattern raises (and stops) again.
        watch.monitor.active.discard(alarm.name)
        path = saver.save(state)
        watch.action_taken(alarm, f"stopped; checkpoint {path}")
        raise HealthStop(f"health alarm: {alarm.explain()}\nCheckpoint: {path}", checkpoint=path, run_dir=saver.run_dir)
    return "apply"


def check_resumable(checkpoint: Checkpoint, config_dict: dict) -> None:
    """Refuse config changes that make the saved state meaningless (shapes, data, optimizer kind)."""
    refused = [c for c in config_changes(checkpoint.trainer["config"], config_dict) if c[0] in SHAPE_KEYS]
    if refused:
        listed = "; ".join(f"{k}: {old} -> {new}" for k, old, new in refused)
        raise ConfigError(
            f"Cannot resume from {checkpoint.path}: {listed}. These change the model's shapes, its data or its "
            "optimizer, so the saved state does not fit. Undo the change, or start a new run dir (hydra.run.dir=...)."
        )


def check_same_tokenizer(checkpoint: Checkpoint, tokenizer: Tokenizer) -> None:
    """The data must speak the run's token ids: the same settings can still give another tokenizer
    (a changed corpus retrains BPE or changes a char vocabulary; other GPT-2 files; a BPE sample)."""
    saved = checkpoint.path.parent.parent / "tokenizer.json"  # <run dir>/checkpoints/step_N
    if not saved.is_file():
        return
    try:
        recorded = json.loads(saved.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"Cannot resume from {checkpoint.path}: the run's {saved} cannot be read ({err}), so it is "
                          "unknown which token ids the model was trained on; restore that file, or start a new run "
                          "dir (hydra.run.dir=...).") from None
    if recorded != tokenizer.to_dict():
        raise ConfigError(
            f"Cannot resume from {checkpoint.path}: the data's tokenizer is not the one this run was trained with "
            f"({saved}), so every token id would mean something else to the model. The corpus or a tokenizer setting "
            "changed since: restore them, or start a new run dir (hydra.run.dir=...)."
        )


def restore(
    checkpoint: Checkpoint, config_dict: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None, sampler: RandomWindowSampler | EpochSampler | InstructionSampler,
    sink: ConsoleSink,
) -> TrainState:
    """Load a checkpoint into the freshly built objects and report what came back and what changed."""
    changes = config_changes(checkpoint.trainer["config"], config_dict)
    try:
        checkpoint.load_into(model, optimizer)  # an FSDP2 run reads just its shards of a sharded checkpoint
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(f"Cannot resume from {checkpoint.path}: its state does not fit this model/optimizer ({err}).") from None
    try:  # checked when loaded, but a forged value can still be of the wrong kind for its object
        if scaler is not None and checkpoint.scaler is not None:
            scaler.load_state_dict(checkpoint.scaler)
        sampler.load_state_dict(checkpoint.trainer["sampler"])
        restore_rng(checkpoint.rng, checkpoint.trainer["rng"])
    except Exception as err:  # noqa: BLE001 - any malformed state: a damaged checkpoint, not a crash
        raise CheckpointError(f"{checkpoint.path}: its loss-scaler, data-position or RNG state cannot be restored "
                              f"({type(err).__name__}: {str(err)[:200]}); resume from another checkpoint "
                              "(resume=<folder>) or train into another run dir (hydra.run.dir=...).") from None
    state = checkpoint.state
    sink.print(
        f"[bold green]resumed[/] from {checkpoint.path}: step {state.step}, {state.tokens:,} tokens, "
        f"model + optimizer{' + loss scaler' if checkpoint.scaler else ''} + data position + RNG states"
        + (f", best val loss {state.best_val_loss:.4f} (step {state.best_step})" if state.best_val_loss is not None else "")
    )
    for key, old, new in changes:
        sink.print(f"[bold yellow]config changed since the checkpoint:[/] {key}: {old} -> {new}")
    return state


def _padded_vocab(cfg: Config, model_vocab: int, data_vocab: int) -> str:
    """' (model 50304, padded to a multiple of 64)' when the model has ids the data never uses."""
    if model_vocab == data_vocab:
        return ""
    why = (f"padded to a multiple of {cfg.model.vocab_multiple}" if cfg.model.vocab_size is None
           else "model.vocab_size")
    return f" (model {model_vocab:,}, {why})"


def _engine(cfg: Config, device: torch.device) -> str:
    name = {ParallelMode.ddp: "DDP", ParallelMode.zero1: "DDP + ZeRO-1 optimizer shards",
            ParallelMode.fsdp: "FSDP2 (parameters, gradients and optimizer state sharded)"}[cfg.parallel.mode]
    return f", {name} over {'NCCL' if device.type == 'cuda' else 'gloo'}"


def describe_stages(stages: list[SeqLenStage], accum: int, keep: SeqLenKeep) -> str:
    """E.g. '256 x 32 from step 0 -> 512 x 16 from 1000; 8,192 tokens/step throughout'."""
    shown = " -> ".join(f"{s.seq_len} x {s.micro_batch_size}{' from step' if i == 0 else ' from'} {s.start_step}"
                        for i, s in enumerate(stages))
    per_step = [s.seq_len * s.micro_batch_size * accum for s in stages]
    if keep is SeqLenKeep.tokens:
        return f"{shown} (length x micro-batch); {per_step[-1]:,} tokens/step throughout"
    return f"{shown} (length x micro-batch); tokens/step {' -> '.join(f'{n:,}' for n in per_step)}"


def save_weights(weights: dict, path: Path) -> None:
    """Write the unwrapped model's state dict atomically (temp file, fsync, rename); a failed write
    raises its OSError and leaves no temp file, and an existing `path` as it was."""
    write_atomically(path, lambda fh: torch.save(weights, fh))


def save_final_weights(weights: dict, run_dir: Path, step: int) -> None:
    """model.pt, for `sample` and `export`. When it cannot be written (a full disk), SaveFailed
    names the newest good checkpoint instead: the same command, rerun, resumes from it (at the
    last step it only writes model.pt)."""
    path = run_dir / "model.pt"
    try:
        save_weights(weights, path)
    except OSError as err:
        newest = newest_good_checkpoint(run_dir)
        why = describe_write_error(err, run_dir, tensor_bytes(weights), subject="model.pt")
        raise SaveFailed(f"the final weights could not be written to {path}: {why}. {resume_point(newest, step)}",
                         checkpoint=newest, run_dir=run_dir) from None
