"""Building a run from its config: `build_run(cfg, ...) -> Run`, everything the step loop needs.

Each part has a builder of its own, called in this order (the order decides the RNG stream, and
which error a user sees first: everything that can fail on user input fails before any compute):

    eval tasks   eval.tasks' files read and checked (before the run dir is touched); tokenized with
                 the data's tokenizer once the data is prepared
    runtime      device, process group, seed, threads (auto: the free cores, measured by rank 0),
                 deterministic kernels, subnormals, precision
    data         prepared (rank 0 first), long enough for the longest stage; the pre-flight check;
                 the device's matmul rate (the banner's time estimate, the monitor's MFU)
    resume       which checkpoint (resume=auto|never|PATH), and whether it fits this config and data
    model        initialized (from torch's RNG, as the runtime seeded it; model.init_from on a
                 fresh start: the folder's weights), compiled per block, sharded (FSDP2) or
                 wrapped (DDP)
    optimizer    (+ ZeRO-1), and the views checkpoints read and write the state through
    samplers     the train batches (their own RNG) and the fixed validation batches
    state        restored from the checkpoint; the run is then accepted (the run dir is written)
    banner       what is about to be trained
    loop parts   the metrics sinks (+ the `start` record), the health watch, the checkpoint
                 saver, the evaluator, the sequence-length stages and the progress log

`llmtrain doctor` builds its bench with the same runtime, data, sampler and model builders.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml
from rich.console import Console
from rich.markup import escape
from torch.nn.parallel import DistributedDataParallel

from llmtrain.checkpoint.format import remove_stale_temps
from llmtrain.checkpoint.layout import Checkpoint
from llmtrain.checkpoint.policy import Checkpointer, RankAgreement, SavedObjects
from llmtrain.checkpoint.resume import (
    agreed_resume,
    check_resumable,
    check_same_tokenizer,
    restore,
    set_damaged_aside,
)
from llmtrain.config.derived import (
    accumulation_steps,
    effective_lr,
    model_vocab_size,
    schedule_steps,
    seq_len_of,
    seq_len_stages,
    total_micro_batches,
    total_steps,
)
from llmtrain.config.eval_tasks import VALIDATION, parse_task_specs
from llmtrain.config.schema import (
    CheckpointFormat,
    CompileMode,
    Config,
    ModelConfig,
    ParallelMode,
    Precision,
    Sampling,
    config_to_dict,
)
from llmtrain.config.validate import validate
from llmtrain.core import files
from llmtrain.core.atomic import write_atomically
from llmtrain.core.errors import ConfigError
from llmtrain.core.faults import Faults
from llmtrain.core.files import Kind
from llmtrain.data import EpochSampler, InstructionSampler, RandomWindowSampler, prepare_data
from llmtrain.data.cache import PreparedData
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.distributed.cores import CoreMeter
from llmtrain.distributed.layout import (
    Layout,
    all_reduce_sum,
    barrier,
    broadcast_from_main,
    local_world_size,
    resolve_device,
    resolve_threads,
    start_process_group,
)
from llmtrain.distributed.wrapping import (
    ConsolidatedOptimizerState,
    ShardedModelState,
    ShardedOptimizerState,
    shard_model,
    zero_redundancy,
)
from llmtrain.engine.optim import build_optimizer
from llmtrain.engine.precision import autocast_factory, build_grad_scaler, resolve_precision
from llmtrain.engine.schedule import lr_at
from llmtrain.engine.state import TrainResult, TrainState
from llmtrain.engine.step import Batch
from llmtrain.engine.timing import StepTimer
from llmtrain.evaluation.scoring import Scorer, random_states_kept
from llmtrain.evaluation.tasks import Task, TaskSource, read_tasks
from llmtrain.hf.folder import load_weights
from llmtrain.hf.init import apply_init_from, open_folder
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.metrics.writer import MetricsWriter, NullMetricsWriter
from llmtrain.model import GPT, uninitialized
from llmtrain.model_tensors import model_tensors
from llmtrain.monitor.diagnosis import run_facts
from llmtrain.monitor.probes import device_memory_mb, matmul_peak_flops
from llmtrain.monitor.watch import Monitor, NullMonitor
from llmtrain.preflight.check import CheckFailed, CheckReport, run_check
from llmtrain.preflight.render import check_command_line, render_refusal
from llmtrain.training.banner import print_banner, run_estimate
from llmtrain.training.eta import StepClock
from llmtrain.training.evaluator import Evaluator
from llmtrain.training.progress import Progress
from llmtrain.training.run import Model, Optimization, Run, Runtime, TrainSampler
from llmtrain.training.stages import SeqLenStages
from llmtrain.training.throughput import SlowdownWatch

ModelFactory = Callable[[ModelConfig, int], torch.nn.Module]


def build_run(cfg: Config, console: Dashboard | None, layout: Layout,
              on_accept: Callable[[Path], None] | None = None) -> Run:
    """Set up the run as this process's part of it (see the module docstring for the order)."""
    apply_init_from(cfg)  # model.init_from: already resolved by the CLI (idempotent); a Config built in code is here
    validate(cfg)
    if cfg.out_dir is None:
        raise ConfigError("'out_dir' is not set; give a run directory, e.g. out_dir=runs/first.")
    task_sources = read_training_tasks(cfg)  # the files' formats: before the run dir, the data and the model
    run_dir = Path(cfg.out_dir)
    if problems := files.layout_problems(run_dir):  # the CLI checked already; a direct train(cfg) is checked here
        raise ConfigError(f"out_dir={run_dir} cannot be this run's dir: {'; '.join(problems)}. Move it away, or give "
                          "a new run dir.")
    run_dir.mkdir(parents=True, exist_ok=True)
    runtime = build_runtime(cfg, layout)
    device = runtime.device
    planned_steps, seq_len, stages = total_steps(cfg), seq_len_of(cfg), seq_len_stages(cfg)
    sink = console or Dashboard(planned_steps, Console(quiet=True) if not layout.is_main else None)
    warn = console_warning(sink)

    data = build_data(cfg, layout, lambda msg: sink.print(f"[dim]{escape(msg)}[/]"), progress=layout.is_main)
    vocab_size = model_vocab_size(cfg, data.vocab_size)
    check = refuse_failed_check(cfg, data, sink)
    # With the run's threads set: the banner's time estimate, and the health monitor's MFU reference
    # (measured once): the fastest of 4 products, ~0.1 s on 2 CPU cores, steady within a few % there.
    runtime.matmul_flops = matmul_peak_flops(device, repeats=4)
    eval_tasks = encode_training_tasks(cfg, task_sources, data, max(stage.seq_len for stage in stages),
                                       lambda msg: sink.print(f"[dim]{escape(msg)}[/]"))
    config_dict = config_to_dict(cfg)
    checkpoint = choose_resume(cfg, run_dir, warn, device, layout, config_dict, data.tokenizer())
    model = build_model(cfg, vocab_size, runtime, layout, fresh_start=checkpoint is None)
    optim = build_optimization(cfg, model, layout, device)
    autocast = autocast_factory(runtime.precision, device.type)
    scaler = build_grad_scaler(runtime.precision, device.type)
    params = [p for p in model.model.parameters() if p.requires_grad]
    if checkpoint is not None and cfg.seed is None:
        # A drawn seed stays the run's seed on resume: the validation batches derive from it.
        runtime.seed = checkpoint.trainer.get("run_seed") or checkpoint.trainer["config"].get("seed") or runtime.seed
    # The sampler owns its RNG, so the data order is independent of init and dropout.
    data_seed = cfg.data.seed if cfg.data.seed is not None else runtime.seed
    train_batches = build_train_sampler(cfg, data, cfg.micro_batch_size, seq_len, data_seed, layout)
    val_batches = fixed_val_batches(cfg, data, seq_len, data_seed, device)
    state = TrainState()
    if checkpoint is not None:
        state = restore(checkpoint, config_dict, optim.model_state, optim.optimizer_state, scaler, train_batches, sink)
    # Only now, with any resume accepted, is the run dir touched: a refused command leaves it as it was.
    if layout.is_main:
        accept_run(run_dir, config_dict, data.tokenizer(), cfg.resume == "never" and checkpoint is None, warn,
                   on_accept)
    run = Run(cfg=cfg, layout=layout, run_dir=run_dir, sink=sink, warn=warn, runtime=runtime, data=data,
              vocab_size=vocab_size, check=check, config_dict=config_dict,
              resume_from=checkpoint.path if checkpoint is not None else None, model=model, optim=optim,
              autocast=autocast, scaler=scaler, params=params, train_batches=train_batches, val_batches=val_batches,
              state=state, total_steps=planned_steps, schedule_steps=schedule_steps(cfg),
              micro_total=total_micro_batches(cfg), accum=accumulation_steps(cfg), seq_len=seq_len, stage_plan=stages,
              tokens_per_step=cfg.global_batch_size * seq_len, peak_lr=effective_lr(cfg), faults=Faults.from_env(),
              eval_tasks=eval_tasks)
    print_banner(run)
    build_loop_parts(run, checkpoint)
    return run


def console_warning(sink: Dashboard) -> Callable[[str], None]:
    def warn(message: str) -> None:
        sink.print(f"[bold yellow]warning:[/] {message}")

    return warn


# ---- runtime -----------------------------------------------------------------------------------

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


def build_runtime(cfg: Config, layout: Layout, unseeded: Callable[[], int] = lambda: secrets.randbelow(2**31)) -> Runtime:
    """The device (one GPU per local rank), the process group, the seed (`unseeded()` when the
    config has none), threads, deterministic kernels, subnormal flushing and the precision."""
    device = resolve_device(cfg.device)
    if device.type == "cuda" and layout.distributed:  # one GPU per local rank
        device = torch.device("cuda", layout.local_rank)
        torch.cuda.set_device(device)
    start_process_group(layout, device)
    # seed=null: draw one, and log it, so even an unseeded run can be repeated (rank 0 draws for all).
    seed = broadcast_from_main(cfg.seed if cfg.seed is not None else unseeded(), layout)
    seed_everything(seed)
    threads = resolve_threads(cfg.threads, layout)  # threads=auto: the free cores, measured by rank 0
    torch.set_num_threads(threads.threads)
    use_deterministic_algorithms(device, cfg.deterministic)
    # Subnormal floats (< 1.2e-38) make x86 CPU arithmetic many times slower; a run that drifts
    # into them slowed 2.8x here. The switch is per thread and torch's pools copy it when they
    # start: `llmtrain train` sets it before any compute (cli/common.py flush_denormals_first); here it
    # reaches a fresh process (parallel.nproc ranks) and this thread. CPU only.
    torch.set_flush_denormal(cfg.flush_denormal)
    precision = dataclasses.replace(cfg.precision, name=resolve_precision(cfg.precision.name, device))
    return Runtime(device, seed, threads.threads, precision, threads.reason)


# ---- data --------------------------------------------------------------------------------------

def build_data(cfg: Config, layout: Layout, log: Callable[[str], None], progress: bool) -> PreparedData:
    """The prepared data (rank 0 prepares it once, the others then find it in the cache), long
    enough for one sequence of the longest stage (and of seq_len in the val split, if evaluated)."""
    if not layout.is_main:
        barrier(layout)
    data = prepare_data(cfg.data, log=log, progress=progress)
    if layout.is_main:
        barrier(layout)
    longest = max(stage.seq_len for stage in seq_len_stages(cfg))
    for split in ("train", "val") if cfg.eval_interval else ("train",):
        needed = longest if split == "train" else seq_len_of(cfg)
        if data.meta[f"{split}_tokens"] < needed + 1:
            raise ConfigError(
                f"The {split} split has {data.meta[f'{split}_tokens']} tokens, fewer than one sequence of "
                f"{needed} (+1 target); use more text (or a larger data.max_bytes), "
                "a shorter data.seq_len, or a larger data.val_fraction."
            )
    return data


def refuse_failed_check(cfg: Config, data: PreparedData, sink: Dashboard) -> CheckReport:
    """The pre-flight checklist (`llmtrain check`), now with the data's real size: FAIL refuses
    (unless allow_check_failures)."""
    check = run_check(cfg, measure_compute=False, data_meta=data.meta)
    if check.failures and not cfg.allow_check_failures:
        render_refusal(check, sink.console, check_command_line(*_command_line_of_this_run()))
        raise CheckFailed(check.refusal(), check)
    return check


def _command_line_of_this_run() -> tuple[list[str] | None, str | None]:
    """The overrides and --config-dir of the `llmtrain train` command that started this run, from
    Hydra's record of the job; (None, None) for a config built in code (no Hydra job)."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None, None
    if not HydraConfig.initialized():
        return None, None
    hydra = HydraConfig.get()
    extra = [s.path for s in hydra.runtime.config_sources if "command-line" in s.provider and s.schema == "file"]
    return list(hydra.overrides.task), extra[0] if extra else None


# ---- evaluation tasks --------------------------------------------------------------------------

def read_training_tasks(cfg: Config) -> list[TaskSource | None]:
    """eval.tasks read and checked (files, formats, labels, harness task names): no model, no
    tokenizer, nothing written, so a bad file is refused before the data is prepared. None holds
    the place of perplexity:validation, the run's own validation split: read once the data is."""
    if not cfg.eval.tasks:
        return []
    if not cfg.eval_interval:
        raise ConfigError(f"eval.tasks is set ({', '.join(cfg.eval.tasks)}) but eval_interval is 0, so the run never "
                          "evaluates; set eval_interval (e.g. eval_interval=100) to run the tasks at every evaluation, "
                          "or leave eval.tasks empty and run `llmtrain eval` on the run afterwards.")
    specs = parse_task_specs(cfg.eval.tasks)
    read = iter(read_tasks([spec for spec in specs if spec != VALIDATION], cfg.eval))
    return [None if spec == VALIDATION else next(read) for spec in specs]


def encode_training_tasks(cfg: Config, sources: list[TaskSource | None], data: PreparedData, window: int,
                          log: Callable[[str], None]) -> list[Task]:
    """The tasks tokenized once, with the run's tokenizer, for `window` tokens of context (the
    longest sequence the run trains on). The global RNGs are left as they were: the model is
    initialized from torch's next."""
    if not sources:
        return []
    tokenizer = data.tokenizer()
    eos_id = tokenizer.eos_id
    if eos_id is None:  # what precedes a document, and the context of an empty one
        raise ConfigError("eval.tasks needs the tokenizer's end-of-text token (it precedes every document scored), and "
                          "this run's tokenizer has none (a char tokenizer prepared by an older llmtrain); leave "
                          "eval.tasks empty, or prepare the data afresh.")
    with random_states_kept():
        sources = [source or read_tasks([VALIDATION], cfg.eval, data)[0] for source in sources]
        return [source.encode(tokenizer, window, eos_id, cfg.eval.truncate, log) for source in sources]


# ---- resume ------------------------------------------------------------------------------------

def choose_resume(cfg: Config, run_dir: Path, warn: Callable[[str], None], device: torch.device, layout: Layout,
                  config_dict: dict, tokenizer: Tokenizer) -> Checkpoint | None:
    """The checkpoint to resume from (agreed by the ranks), refused unless it fits the config and
    the data's tokenizer; None for a fresh start."""
    checkpoint = agreed_resume(cfg.resume, run_dir, warn, device, layout)
    if checkpoint is not None:
        check_resumable(checkpoint, config_dict)
        check_same_tokenizer(checkpoint, tokenizer)
    return checkpoint


# ---- model and optimizer -----------------------------------------------------------------------

def new_model(model_cfg: ModelConfig, vocab_size: int, device: torch.device, factory: ModelFactory = GPT) -> torch.nn.Module:
    """A freshly initialized model (from torch's RNG as seeded), on the device, in train mode."""
    model = factory(model_cfg, vocab_size).to(device)
    model.train()
    return model


def folder_model(model_cfg: ModelConfig, vocab_size: int, device: torch.device) -> torch.nn.Module:
    """The model of model.init_from, every tensor from the folder's safetensors (the random init,
    which they would overwrite, is skipped: apply_init_from checked that they fill the model)."""
    assert model_cfg.init_from is not None
    folder = open_folder(model_cfg.init_from)
    with uninitialized():
        model = new_model(model_cfg, vocab_size, device)
    load_weights(model, folder)
    return model


def build_model(cfg: Config, vocab_size: int, runtime: Runtime, layout: Layout, fresh_start: bool = True) -> Model:
    """The model, initialized (model.init_from on a fresh start: the folder's weights; a resume then
    restores the checkpoint's), compiled, sharded or wrapped."""
    if cfg.model.init_from is not None and fresh_start:
        # Before compile and sharding: FSDP2 splits the tensors load_weights fills by their names.
        model = folder_model(cfg.model, vocab_size, runtime.device)
    else:
        model = new_model(cfg.model, vocab_size, runtime.device)
    if cfg.compile is CompileMode.on or (cfg.compile is CompileMode.auto and runtime.device.type == "cuda"):
        for block in model.blocks:  # in place, per block: parameter names (and checkpoints) stay the same
            block.compile()
    sharded = cfg.parallel.mode is ParallelMode.fsdp and layout.distributed
    if sharded:  # FSDP2: parameters split across the ranks, gathered per block for its compute
        shard_model(model, {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(runtime.precision.name))
    # The forward/backward goes through DDP (gradients averaged over the ranks, once per window);
    # everything else (state dicts, evaluation, the monitor's hooks) uses the plain model inside.
    # FSDP2 shards the model in place: it is its own training module.
    device = runtime.device
    train_model = (DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
                   if layout.distributed and not sharded else model)
    return Model(model, train_model, sharded)


def build_optimization(cfg: Config, model: Model, layout: Layout, device: torch.device) -> Optimization:
    optimizer = build_optimizer(model.model, cfg.optim, device.type, fused_ok=not model.sharded)
    if cfg.parallel.mode is ParallelMode.zero1 and layout.distributed:
        optimizer = zero_redundancy(optimizer)
    sharded = model.sharded
    model_state = ShardedModelState(model.model) if sharded else model.model
    optimizer_state = (ShardedOptimizerState(model.model, optimizer) if sharded
                       else ConsolidatedOptimizerState(optimizer, layout) if hasattr(optimizer, "consolidate_state_dict")
                       else optimizer)
    return Optimization(optimizer, model_state, optimizer_state,
                        sharded_files=sharded and cfg.checkpoint.format is not CheckpointFormat.full)


# ---- samplers ----------------------------------------------------------------------------------

def build_train_sampler(cfg: Config, data: PreparedData, batch_size: int, seq_len: int, seed: int,
                        layout: Layout) -> TrainSampler:
    """The train split's batches as the config asks: whole instruction examples (prompt tokens
    masked out of the loss), epochs, or random windows; this rank's share of each window."""
    if data.meta.get("loss_mask"):  # instruction data: whole examples, prompt tokens masked out of the loss
        try:
            return InstructionSampler(data.tokens("train"), data.loss_mask("train"), data.offsets("train"),
                                      batch_size, seq_len, seed, layout.rank,
                                      layout.world_size, epoch_multiple=cfg.global_batch_size)
        except ValueError as err:
            raise ConfigError(f"data=instruct: {err}; use more examples or a smaller micro_batch_size.") from None
    if cfg.data.sampling is Sampling.epoch and not cfg.data.overfit_batches:
        try:
            return EpochSampler(data.tokens("train"), batch_size, seq_len, seed,
                                layout.rank, layout.world_size, epoch_multiple=cfg.global_batch_size)
        except ValueError as err:
            raise ConfigError(f"data.sampling=epoch: {err}; use more data, a shorter data.seq_len, a smaller "
                              "micro_batch_size, or data.sampling=random.") from None
    return RandomWindowSampler(data.tokens("train"), batch_size, seq_len, seed,
                               cfg.data.shuffle, cfg.data.overfit_batches, layout.rank, layout.world_size)


def fixed_val_batches(cfg: Config, data: PreparedData, seq_len: int, data_seed: int, device: torch.device) -> list[Batch]:
    """The eval_batches validation batches every evaluation of the run uses, on the device."""
    if not cfg.eval_interval:
        return []
    val_sampler = (
        InstructionSampler(data.tokens("val"), data.loss_mask("val"), data.offsets("val"),
                           min(cfg.micro_batch_size, len(data.offsets("val")) - 1), seq_len, data_seed + 1)
        if data.meta.get("loss_mask")
        else RandomWindowSampler(data.tokens("val"), cfg.micro_batch_size, seq_len, data_seed + 1)
    )
    return [tuple(t.to(device) for t in val_sampler.next_batch()) for _ in range(cfg.eval_batches)]


# ---- acceptance --------------------------------------------------------------------------------

def accept_run(run_dir: Path, config_dict: dict, tokenizer: Tokenizer, fresh_start: bool,
               warn: Callable[[str], None], on_accept: Callable[[Path], None] | None) -> None:
    """The run is accepted (any resume fits): tidy the run dir and rewrite its description
    (config.yaml, tokenizer.json; through on_accept the CLI's .hydra/ record and train.log). Each
    file whole or not at all: a SIGTERM here (still setting up) cannot leave half of one."""
    remove_stale_temps(run_dir)  # one writer per run dir: leftovers are from a process that died
    if fresh_start:
        set_damaged_aside(run_dir, warn)  # resume=never refused good ones: only damaged ones are left
    config_text = yaml.safe_dump(config_dict, sort_keys=False).encode()
    write_atomically(run_dir / files.CONFIG, config_text)
    tokenizer_text = json.dumps(tokenizer.to_dict(), ensure_ascii=False).encode()
    write_atomically(run_dir / files.TOKENIZER, tokenizer_text)
    if on_accept is not None:
        on_accept(run_dir)


# ---- the loop's parts --------------------------------------------------------------------------

def build_loop_parts(run: Run, checkpoint: Checkpoint | None) -> None:
    """The sinks (and the `start` record), then the watch, saver, evaluator, stages and progress."""
    cfg, layout, state = run.cfg, run.layout, run.state
    run.metrics = (MetricsWriter(run.run_dir, cfg.tensorboard, cfg.wandb.value, cfg.wandb_project, run.config_dict,
                               run.warn) if layout.is_main else NullMetricsWriter())
    run.flops_per_token = model_tensors(cfg.model, run.model.model.vocab_size).flops_per_token(run.seq_len)
    # Appending (never truncating) keeps earlier records (a resumed run continues the same file).
    run.metrics.write({"kind": Kind.START, "time": time.time(), "steps": run.total_steps,
                       "tokens_per_step": run.tokens_per_step,
                       "resumed_from": str(run.resume_from) if run.resume_from else None, "step": state.step,
                       "seed": run.runtime.seed, "check": {row.item: row.status.value for row in run.check.rows},
                       "unigram_entropy": run.data.unigram_entropy, "vocab_size": run.vocab_size,
                       "parameters": run.check.facts.parameters.record(),
                       "device": str(run.device), "device_memory_mb": device_memory_mb(run.device),
                       "world_size": layout.world_size, "local_world_size": local_world_size(),
                       "flops_per_token": run.flops_per_token, "precision": run.runtime.precision.name.value})
    run.result = TrainResult(run_dir=run.run_dir, steps=state.step, tokens=state.tokens,
                             unigram_entropy=run.data.unigram_entropy)
    run.faults.slow_backward(run.model.model, lambda: run.state.step)
    run.watch = build_watch(run, checkpoint)
    run.saver = build_saver(run)
    # The tasks score the plain model, as the val loss does; the window is the longest the run trains on.
    scorer = Scorer(run.model.model, max(stage.seq_len for stage in run.stage_plan), cfg.eval.batch_size,
                    run.autocast) if run.eval_tasks else None
    run.evaluator = Evaluator(cfg.eval_interval, run.model.model, run.val_batches, run.device, run.autocast, run.sink,
                              run.metrics, run.result, run.saver, run.eval_tasks, scorer, run.watch)
    run.stages = SeqLenStages(run.stage_plan, run.train_batches, run.sink, run.metrics, run.accum * layout.world_size)
    estimate = run_estimate(run)
    eta = StepClock(run.total_steps, estimate.step_seconds if estimate else None)
    meter = CoreMeter() if layout.is_main else None  # how busy the cores are, for the slowdown warning's words
    slowdown = (SlowdownWatch(run.warn, run.metrics, run.runtime.threads, meter,
                              sibling_cores=(local_world_size() - 1) * run.runtime.threads) if layout.is_main else None)
    run.progress = Progress(cfg.log_interval, StepTimer(cfg.timing_interval, run.device), run.sink,
                            run.metrics, run.result, run.flops_per_token, run.scaler, run.train_batches, run.stages,
                            eta, slowdown)


def build_watch(run: Run, checkpoint: Checkpoint | None) -> Monitor | NullMonitor:
    """The health monitor's side of the loop (NullMonitor with monitor.enabled=false), resumed with
    the checkpoint's monitor state (windows, counts, active alarms)."""
    cfg = run.cfg
    if not cfg.monitor.enabled:
        return NullMonitor()
    fp16_unscaled = run.runtime.precision.name is Precision.fp16 and run.scaler is None
    facts = run_facts(cfg, run.check.rows, peak_lr=run.peak_lr, total_steps=run.total_steps,
                      schedule_steps=run.schedule_steps,
                      schedule_floor=lr_at(run.schedule_steps, run.peak_lr, run.schedule_steps, cfg.schedule),
                      baseline=run.data.unigram_entropy, vocab_size=run.vocab_size, fp16_without_scaler=fp16_unscaled)
    watch = Monitor(cfg.monitor, run.model.model, run.run_dir, run.sink, run.metrics, run.total_steps,
                        fp16_unscaled, run.flops_per_token, write_events=run.layout.is_main,
                        world_size=run.layout.world_size, facts=facts, peak_flops=run.runtime.matmul_flops)
    watch.restart_interval(run.state.tokens)
    if checkpoint is not None:
        watch.restore(checkpoint.trainer.get("monitor"))
    return watch


def build_saver(run: Run) -> Checkpointer:
    layout, watch = run.layout, run.watch
    saved = SavedObjects(run.optim.model_state, run.optim.optimizer_state, run.scaler, run.train_batches,
                         extra_state=lambda: {"run_seed": run.runtime.seed, **watch.checkpoint_state()})
    ranks = RankAgreement(writer=layout.is_main, agree=lambda value: broadcast_from_main(value, layout),
                          vote=lambda values: all_reduce_sum(values, layout))
    return Checkpointer(run.cfg.checkpoint, run.run_dir, saved, run.config_dict, run.metrics, run.warn, ranks,
                            shard_layout=(layout.rank, layout.world_size) if run.optim.sharded_files else None,
                            resumed_at=run.state.step if run.resume_from else None)
