"""Building a run from its config: `build_run(cfg, ...) -> Run`, everything the step loop needs.

Each part has a builder of its own, called in this order (the order decides the RNG stream, and
which error a user sees first: everything that can fail on user input fails before any compute):

    eval tasks   eval.tasks' files read and checked (before the run dir is touched); tokenized with
                 the data's tokenizer once the data is prepared
    runtime      device, process group, seed, threads (auto: the free cores, measured by rank 0),
                 deterministic kernels, subnormals, precision
    data         prepared (rank 0 first), long enough for the longest stage; the plan (plan.py:
                 every derived number, the data's vocabulary included); the pre-flight check; the
                 device's matmul rate (the banner's time estimate, the monitor's MFU)
    resume       which checkpoint (training/resume.py: resume=auto|never|PATH), and whether it
                 fits this config and data
    model        initialized (from torch's RNG, as the runtime seeded it; model.init_from on a
                 fresh start: the folder's weights), compiled per block, sharded (FSDP2) or
                 wrapped (DDP)
    train module the model, the optimizer (+ ZeRO-1), the views checkpoints read and write the
                 state through, the trainable parameters and the precision object
    batches      the train sampler (its own RNG) and the fixed validation batches
    state        restored from the checkpoint; the run is then accepted (the run dir is written)
    banner       what is about to be trained, from the context, the plan and the train module
    loop parts   loop_parts.py: the metrics writer (+ the `start` record), the monitor, the
                 checkpointer, the recovery, the evaluator, the sequence-length stages and the
                 progress log

`llmtrain doctor` builds its bench with the same runtime, data, sampler and model builders."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from rich.console import Console
from rich.markup import escape
from torch.nn.parallel import DistributedDataParallel

from llmtrain.checkpoint.write import remove_stale_temps
from llmtrain.config.derived import degrees_of, seq_len_of, seq_len_stages, total_steps
from llmtrain.config.eval_tasks import VALIDATION, parse_task_specs
from llmtrain.config.finetune import FinetuneConfig, adapter_checkpoints, is_lora, quantized_base
from llmtrain.config.hydra import command_line_of_this_run
from llmtrain.config.parallel_limits import tensor_parallel_problems
from llmtrain.config.schema import (
    CheckpointFormat,
    Config,
    ModelConfig,
    Sampling,
    config_to_dict,
)
from llmtrain.config.validate import validate
from llmtrain.core import files
from llmtrain.core.atomic import write_atomically
from llmtrain.core.errors import ConfigError
from llmtrain.core.faults import Faults
from llmtrain.data import EpochSampler, InstructionSampler, RandomWindowSampler, prepare_data
from llmtrain.data.cache import PreparedData
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.distributed.layout import (
    Layout,
    barrier,
    broadcast_from_main,
    resolve_device,
    resolve_threads,
    start_process_group,
)
from llmtrain.distributed.mesh import build_mesh, data_shard_mesh
from llmtrain.distributed.wrapping import (
    ConsolidatedOptimizerState,
    ShardedAdapterState,
    ShardedModelState,
    ShardedOptimizerState,
    shard_model,
    zero_redundancy,
)
from llmtrain.engine.compiling import compile_blocks as compile_model_blocks
from llmtrain.engine.optim import build_optimizer
from llmtrain.engine.precision import NumericPrecision, autocast_dtype, build_precision, matmul_dtype, resolve_precision
from llmtrain.engine.repairs import KNOBS, apply_repairs
from llmtrain.engine.state import TrainState
from llmtrain.engine.step import Batch
from llmtrain.evaluation.scoring import random_states_kept
from llmtrain.evaluation.tasks import Task, TaskSource, read_tasks
from llmtrain.hf.folder import load_weights
from llmtrain.hf.init import apply_init_from, open_folder
from llmtrain.hf.lora_base import run_base
from llmtrain.lora import AdapterState, adapter_shapes, apply_lora
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.model import GPT, uninitialized
from llmtrain.monitor.probes import matmul_peak_flops
from llmtrain.preflight.check import CheckFailed, CheckReport, run_check
from llmtrain.preflight.compute import estimate_compute
from llmtrain.preflight.render import check_command_line, render_refusal
from llmtrain.qlora import quantized_names, store_nf4, to_device_but_nf4
from llmtrain.training.banner import print_banner
from llmtrain.training.compile_trial import CompileChoice, choose_compile
from llmtrain.training.loop_parts import build_loop_parts
from llmtrain.training.parts import Batches, Context, Model, Runtime, Sampler, TrainModule
from llmtrain.training.plan import Plan, build_plan
from llmtrain.training.resume import choose_resume, restore, set_damaged_aside
from llmtrain.training.run import Run

ModelFactory = Callable[[ModelConfig, int], torch.nn.Module]


def build_run(cfg: Config, console: Dashboard | None, layout: Layout,
              on_accept: Callable[[Path], None] | None = None) -> Run:
    """Set up the run as this process's part of it (see the module docstring for the order)."""
    apply_init_from(cfg)  # model.init_from: already resolved by the CLI (idempotent); a Config built in code is here
    validate(cfg)
    # Which share of the batch this rank reads: the tp ranks and pipeline stages of one data-parallel
    # rank read the same.
    degrees = degrees_of(cfg, layout.world_size)
    layout = dataclasses.replace(layout, tp=degrees.tp, pp=degrees.pp)
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
    dashboard = console or Dashboard(total_steps(cfg), Console(quiet=True) if not layout.is_main else None)
    warn = console_warning(dashboard)

    def log(message: str) -> None:
        dashboard.print(f"[dim]{escape(message)}[/]")

    data = build_data(cfg, layout, log, progress=layout.is_main)
    plan = build_plan(cfg, data.vocab_size)
    if (tp := layout.tp) > 1 and (problems := tensor_parallel_problems(cfg.model, plan.model_vocab_size, tp, False,
                                                                         None)):
        raise ConfigError(f"tensor parallel (tp={tp}) cannot split this run: {' '.join(problems)}")
    check = refuse_failed_check(cfg, data, dashboard)
    # With the run's threads set: the banner's time estimate, and the health monitor's MFU reference
    # (measured once, in the dtype the run's matmuls use): the fastest of 4 products, ~0.1 s on 2 CPU
    # cores, steady within a few % there.
    runtime = dataclasses.replace(runtime, matmul_flops=matmul_peak_flops(
        device, matmul_dtype(runtime.precision.name), repeats=4))
    eval_tasks = encode_training_tasks(cfg, task_sources, data, plan.longest_seq_len, log)
    config_dict = config_to_dict(cfg)
    # Adapter-only checkpoints: the base folder's identity, hashed once here (never at a save).
    lora_base = run_base(cfg)
    checkpoint = choose_resume(cfg, run_dir, warn, device, layout, config_dict, data.tokenizer(), lora_base)
    compiling = choose_run_compile(cfg, plan, runtime, layout, check, steps_left=plan.total_steps - (
        checkpoint.state.step if checkpoint is not None else 0))
    model = build_model(cfg, plan.model_vocab_size, runtime, layout, fresh_start=checkpoint is None,
                        compile_blocks=compiling.compile)
    module = build_train_module(cfg, model, runtime, layout)
    if checkpoint is not None and cfg.seed is None:
        # A drawn seed stays the run's seed on resume: the validation batches derive from it.
        seed = checkpoint.trainer.get("run_seed") or checkpoint.trainer["config"].get("seed") or runtime.seed
        runtime = dataclasses.replace(runtime, seed=seed)
    batches = build_batches(cfg, data, plan, runtime.seed, layout, device)
    state = TrainState()
    if checkpoint is not None:
        state = restore(checkpoint, config_dict, module, batches.train, dashboard)
        resume_repairs(state, cfg, module, dashboard)
    # Only now, with any resume accepted, is the run dir touched: a refused command leaves it as it was.
    if layout.is_main:
        accept_run(run_dir, config_dict, data.tokenizer(), cfg.resume == "never" and checkpoint is None, warn,
                   on_accept)
        record_base(run_dir, lora_base)
    context = Context(cfg=cfg, config_dict=config_dict, layout=layout, run_dir=run_dir, runtime=runtime, data=data,
                      check=check, resume_from=checkpoint.path if checkpoint is not None else None,
                      dashboard=dashboard, warn=warn, faults=Faults.from_env(), lora_base=lora_base,
                      compiling=compiling)
    print_banner(context, plan, module, state)
    loop = build_loop_parts(context, plan, module, batches, state, checkpoint, eval_tasks)
    run = Run(context=context, plan=plan, module=module, batches=batches, loop=loop, state=state)
    context.faults.slow_backward(module.model, lambda: run.state.step)
    return run


def record_base(run_dir: Path, lora_base: dict | None) -> None:
    """A LoRA run on a folder's weights: the run dir's lora_base.json names the base its model.pt's
    adapters need (runs/artifacts.py reads it); any other run has none (an earlier one's removed)."""
    path = run_dir / files.LORA_BASE
    if lora_base is None:
        path.unlink(missing_ok=True)
        return
    write_atomically(path, lambda fh: fh.write(json.dumps(lora_base, indent=2).encode()))


def resume_repairs(state: TrainState, cfg: Config, module: TrainModule, dashboard: Dashboard) -> None:
    """The repairs the run made before it was stopped (monitor.repair), kept by its checkpoint: the
    resumed run goes on with them, whatever the command line says of those settings."""
    if not state.repairs:
        return
    apply_repairs(state.repairs, cfg, module.optimizer)
    made = ", ".join(f"{key}={value:g}" for key, value in state.repairs.items() if key in KNOBS)
    dashboard.print(escape(f"resumed with the {state.repairs_made} repair(s) this run made: {made}"))


def console_warning(dashboard: Dashboard) -> Callable[[str], None]:
    def warn(message: str) -> None:
        dashboard.print(f"[bold yellow]warning:[/] {message}")

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


def build_runtime(cfg: Config, layout: Layout,
                  unseeded: Callable[[], int] = lambda: secrets.randbelow(2**31)) -> Runtime:
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


def refuse_failed_check(cfg: Config, data: PreparedData, dashboard: Dashboard) -> CheckReport:
    """The pre-flight checklist (`llmtrain check`), now with the data's real size: FAIL refuses
    (unless allow_check_failures)."""
    check = run_check(cfg, measure_compute=False, data_meta=data.meta)
    if check.failures and not cfg.allow_check_failures:
        render_refusal(check, dashboard.console, check_command_line(*command_line_of_this_run()))
        raise CheckFailed(check.refusal(), check)
    return check


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


# ---- model and optimizer -----------------------------------------------------------------------

def new_model(model_cfg: ModelConfig, vocab_size: int, device: torch.device,
              factory: ModelFactory = GPT) -> torch.nn.Module:
    """A freshly initialized model (from torch's RNG as seeded), on the device, in train mode."""
    model = factory(model_cfg, vocab_size).to(device)
    model.train()
    return model


def folder_model(model_cfg: ModelConfig, vocab_size: int, device: torch.device,
                 qlora: FinetuneConfig | None = None) -> torch.nn.Module:
    """The model of model.init_from, every tensor from the folder's safetensors (the random init,
    which they would overwrite, is skipped: apply_init_from checked that they fill the model).

    With `qlora` (finetune=qlora's settings) the weights it stores in 4 bits are quantized on the
    device as they are read: the model is built on the host, where its unwritten tensors take no
    memory, and the rest moves to the device after. The full-precision base never exists whole (on
    a GPU it would have to fit there first: 28 GB for a 7B model, against ~3.6 GB in NF4)."""
    assert model_cfg.init_from is not None
    folder = open_folder(model_cfg.init_from)
    if qlora is None:
        with uninitialized():
            model = new_model(model_cfg, vocab_size, device)
        load_weights(model, folder)
        return model
    with uninitialized():
        model = new_model(model_cfg, vocab_size, torch.device("cpu"))
    names = set(quantized_names([*model.state_dict(), *adapter_shapes(model_cfg, qlora, vocab_size)]))

    def quantize(name: str, value: torch.Tensor) -> bool:
        if name in names:
            store_nf4(model, name, value.to(device))
        return name in names

    load_weights(model, folder, store=quantize)
    to_device_but_nf4(model, device)
    return model


def choose_run_compile(cfg: Config, plan: Plan, runtime: Runtime, layout: Layout, check: CheckReport,
                       steps_left: int) -> CompileChoice:
    """compile on, off, or auto's choice (training/compile_trial.py), from the banner's time estimate."""
    degrees = degrees_of(cfg, layout.world_size)
    estimate = (estimate_compute(cfg, check.facts.shape, runtime.device, runtime.matmul_flops, layout.world_size)
                if runtime.matmul_flops is not None else None)
    return choose_compile(cfg, runtime.device, runtime.threads, plan.seq_len,
                          alone=layout.world_size == 1 and degrees.tp == 1 and degrees.pp == 1
                          and len(plan.seq_len_stages) == 1,
                          estimated_run_s=estimate.step_seconds * steps_left if estimate is not None else None)


def build_model(cfg: Config, vocab_size: int, runtime: Runtime, layout: Layout, fresh_start: bool = True,
                compile_blocks: bool = False) -> Model:
    """The model, initialized (model.init_from on a fresh start: the folder's weights; a resume then
    restores the checkpoint's), compiled, then split over the run's device mesh: tensor parallel
    first (each layer over the tp ranks), then FSDP2 over the data-parallel shards, or DDP."""
    if cfg.model.init_from is not None and (fresh_start or adapter_checkpoints(cfg)):
        # Before compile and sharding: FSDP2 and tensor parallel split the tensors load_weights fills
        # by their names. A LoRA run's checkpoints hold its adapters alone: a resume loads the base
        # from the folder too (choose_resume checked that it is the same).
        model = folder_model(cfg.model, vocab_size, runtime.device, cfg.finetune if quantized_base(cfg) else None)
    else:
        model = new_model(cfg.model, vocab_size, runtime.device)
    if is_lora(cfg):
        # After the folder's weights, before compiling and wrapping: DDP registers only the adapters'
        # gradients; a resume restores base and adapters from the checkpoint.
        apply_lora(model, cfg.finetune)
    if compile_blocks:  # in place, per block: parameter names (and checkpoints) stay the same
        compile_model_blocks(model)
    degrees = degrees_of(cfg, layout.world_size)
    mesh = build_mesh(degrees, runtime.device)
    if mesh is not None and degrees.tp > 1:
        from llmtrain.distributed.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], cfg.parallel.sequence_parallel)
    # Pipeline parallel: the stages are copied out of the whole model, then sharded (pipeline_train_module).
    if mesh is not None and degrees.dp_shard > 1 and degrees.pp == 1:  # FSDP2: split, gathered per block
        shard_model(model, compute_dtype(runtime), data_shard_mesh(mesh, degrees))
    # The forward/backward goes through DDP (gradients averaged over the replicas, once per window);
    # everything else (state dicts, evaluation, the monitor's hooks) uses the plain model inside.
    # FSDP2 and tensor parallel split the model in place: it is its own training module.
    split = mesh is not None and degrees.pp == 1 and (degrees.dp_shard > 1 or degrees.tp > 1)
    device = runtime.device
    replicas = mesh is not None and not split and degrees.dp_replicate > 1 and degrees.pp == 1
    train_model = (DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
                   if replicas else model)
    return Model(model, train_model, sharded=split, tensor_parallel=mesh is not None and degrees.tp > 1, mesh=mesh)


def compute_dtype(runtime: Runtime) -> torch.dtype | None:
    """FSDP2's compute copies' type: bf16/fp16 from the precision group (None: the parameters')."""
    return autocast_dtype(runtime.precision.name)


def build_train_module(cfg: Config, model: Model, runtime: Runtime, layout: Layout) -> TrainModule:
    """The model with its optimizer (+ ZeRO-1), the views checkpoints read and write their state
    through, the trainable parameters and the precision (autocast, fp16's loss scaler)."""
    device = runtime.device
    precision = build_precision(runtime.precision, device.type)
    if layout.pp > 1:
        return pipeline_train_module(cfg, model, runtime, layout, precision)
    optimizer = build_optimizer(model.model, cfg.optim, device.type, fused_ok=not model.sharded)
    if cfg.parallel.zero1 and layout.distributed:
        optimizer = zero_redundancy(optimizer)
    if model.tensor_parallel:  # the fused q/k/v rows are regrouped per rank: the views restore today's layout
        from llmtrain.distributed.tensor_parallel import TensorParallelModelState, TensorParallelOptimizerState

        model_state: Any = TensorParallelModelState(model.model)
        optimizer_state: Any = TensorParallelOptimizerState(model.model, optimizer)
    elif model.sharded:
        # A LoRA run on a folder's weights: its adapters alone, gathered whole (the folder holds the rest).
        model_state = ShardedAdapterState(model.model) if adapter_checkpoints(cfg) else ShardedModelState(model.model)
        optimizer_state = ShardedOptimizerState(model.model, optimizer)
    else:
        # A LoRA run on a folder's weights saves (and restores) its adapters alone.
        model_state = AdapterState(model.model) if adapter_checkpoints(cfg) else model.model
        optimizer_state = (ConsolidatedOptimizerState(optimizer, layout)
                           if hasattr(optimizer, "consolidate_state_dict") else optimizer)
    # Sharded files (each rank its own shards) only under FSDP2 alone: validate refuses the rest. A
    # LoRA run's files are whole: its trainable state (adapters, their moments) is a small fraction
    # of the model's, and whole files move between layouts as they are.
    sharded_files = (model.sharded and not model.tensor_parallel and not is_lora(cfg)
                     and cfg.checkpoint.format is not CheckpointFormat.full)
    return TrainModule(model=model.model, train_model=model.train_model, optimizer=optimizer,
                       model_state=model_state, optimizer_state=optimizer_state, sharded_files=sharded_files,
                       params=[p for p in model.model.parameters() if p.requires_grad], precision=precision)


def pipeline_train_module(cfg: Config, model: Model, runtime: Runtime, layout: Layout,
                          precision: NumericPrecision) -> TrainModule:
    """Pipeline parallel: this process's stages (copies of the initialized model's pieces, under its
    parameter names), FSDP2-sharded over the data-parallel sub-mesh when there is one, and an
    optimizer over them; the window's forward/backward, clipping and evaluation run through the
    pipeline's schedule, checkpoints through its views (whole, on rank 0)."""
    from llmtrain.distributed.pipeline import Pipeline

    degrees, mesh = degrees_of(cfg, layout.world_size), model.mesh
    data_mesh = data_shard_mesh(mesh, degrees) if degrees.dp_shard > 1 else None
    # Every pipeline's global ranks, in stage order (the tied-weight groups are made for all of them).
    pipelines = mesh.mesh.reshape(degrees.pp, -1).T.tolist()
    pipeline = Pipeline(model.model, cfg.parallel.pp_schedule, group=mesh["pp"].get_group(), pipelines=pipelines,
                        device=runtime.device, label_smoothing=cfg.optim.label_smoothing, autocast=precision.autocast,
                        data_mesh=data_mesh, param_dtype=compute_dtype(runtime))
    optimizer = build_optimizer(pipeline.module, cfg.optim, runtime.device.type, fused_ok=data_mesh is None)
    return TrainModule(model=pipeline.module, train_model=pipeline.module, optimizer=optimizer,
                       model_state=pipeline.model_state(), optimizer_state=pipeline.optimizer_state(optimizer),
                       sharded_files=False, params=pipeline.parameters(), precision=precision, pipeline=pipeline)


# ---- samplers ----------------------------------------------------------------------------------

def build_batches(cfg: Config, data: PreparedData, plan: Plan, seed: int, layout: Layout,
                  device: torch.device) -> Batches:
    """The train sampler and the validation batches, both from data.seed (else the run's `seed`)."""
    # The sampler owns its RNG, so the data order is independent of init and dropout.
    data_seed = cfg.data.seed if cfg.data.seed is not None else seed
    return Batches(train=build_train_sampler(cfg, data, cfg.micro_batch_size, plan.seq_len, data_seed, layout),
                   val=fixed_val_batches(cfg, data, plan.seq_len, data_seed, device))


def build_train_sampler(cfg: Config, data: PreparedData, batch_size: int, seq_len: int, seed: int,
                        layout: Layout) -> Sampler:
    """The train split's batches as the config asks: whole instruction examples (prompt tokens
    masked out of the loss), epochs, or random windows; this rank's share of each window."""
    if data.meta.get("loss_mask"):  # instruction data: whole examples, prompt tokens masked out of the loss
        try:
            return InstructionSampler(data.tokens("train"), data.loss_mask("train"), data.offsets("train"),
                                      batch_size, seq_len, seed, layout.dp_rank,
                                      layout.dp_size, epoch_multiple=cfg.global_batch_size)
        except ValueError as err:
            raise ConfigError(f"data=instruct: {err}; use more examples or a smaller micro_batch_size.") from None
    if cfg.data.sampling is Sampling.epoch and not cfg.data.overfit_batches:
        try:
            return EpochSampler(data.tokens("train"), batch_size, seq_len, seed,
                                layout.dp_rank, layout.dp_size, epoch_multiple=cfg.global_batch_size)
        except ValueError as err:
            raise ConfigError(f"data.sampling=epoch: {err}; use more data, a shorter data.seq_len, a smaller "
                              "micro_batch_size, or data.sampling=random.") from None
    return RandomWindowSampler(data.tokens("train"), batch_size, seq_len, seed,
                               cfg.data.shuffle, cfg.data.overfit_batches, layout.dp_rank, layout.dp_size)


def fixed_val_batches(cfg: Config, data: PreparedData, seq_len: int, data_seed: int,
                      device: torch.device) -> list[Batch]:
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
