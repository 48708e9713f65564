"""Cross-field validation of a typed `Config`: everything that can be refused before any work
starts. `validate` is the entry point; it runs one check function per config group, in a fixed
order, so that a config with several mistakes always names the same one first. It also fills in
the two values a config may leave null (the micro-batch size and the learning rate, by
`llmtrain.config.derived`), so everything downstream reads numbers."""

import difflib
import importlib.util
import math
import os
import re

from llmtrain.config.derived import (
    accumulation_steps,
    degrees_of,
    micro_batch_size_derived,
    resolve_lr,
    resolve_micro_batch_size,
    resolved_warmup_steps,
    schedule_steps,
    seq_len_of,
    seq_len_schedule,
    total_steps,
    world_size_of,
)
from llmtrain.config.eval_tasks import parse_task_specs  # standard library only: the config package stays torch-free
from llmtrain.config.finetune import torchao_installed, validate_finetune
from llmtrain.config.parallel_limits import PIPELINE_SCHEDULES, pipeline_problems, tensor_parallel_problems
from llmtrain.config.schema import (
    ALARM_NAMES,
    INIT_SCHEMES,
    LOW_BIT_OPTIMIZERS,
    MAPPING_KEYS,
    CheckpointConfig,
    CheckpointFormat,
    Config,
    DataConfig,
    DataSource,
    EvalConfig,
    HeadInit,
    LRScaling,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    PositionEncoding,
    Precision,
    PrecisionConfig,
    Sampling,
    ScheduleConfig,
    SeqLenKeep,
    TokenizerKind,
    WandbMode,
)
from llmtrain.config.threads import threads_error
from llmtrain.core.errors import ConfigError


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Cross-field checks: contradictions no single field's type can catch. Raises `ConfigError`
    with one paragraph naming the key, the value seen and what is valid.

    The order is part of the behaviour (the first mistake found is the one reported): counts come
    first because later checks divide by them, and the world size is settled before anything that
    depends on the micro-batch size."""
    _validate_counts(cfg)
    _validate_parallel(cfg)
    # The batch arithmetic below counts the processes that split the batch: the tensor-parallel
    # ranks of one data-parallel rank read the same micro-batches.
    world_size = max(1, world_size // (cfg.parallel.tp * cfg.parallel.pp)) if world_size else degrees_of(cfg).dp
    _resolve_pipeline_microbatches(cfg, world_size)
    resolve_micro_batch_size(cfg, world_size)
    _validate_pipeline(cfg, world_size)
    _validate_model(cfg.model)
    _validate_optim(cfg)
    _validate_schedule(cfg.schedule, cfg.global_batch_size)
    _validate_seq_len_values(cfg)  # before the run length: a token budget divides by the length
    _validate_run_length(cfg, world_size)
    total = total_steps(cfg, world_size)
    _validate_seq_len(cfg, total)
    _validate_data_amounts(cfg.data)
    # An optim key, checked here among the data checks where it has always been: moving it would
    # change which mistake a config with several is told about first.
    _validate_label_smoothing(cfg.optim)
    _validate_data_source(cfg.data)
    _validate_warmup(cfg.schedule, schedule_steps(cfg, world_size))
    _validate_device_and_seeds(cfg)
    _validate_precision(cfg.precision)
    _validate_checkpoint(cfg.checkpoint)
    _validate_monitor(cfg.monitor)
    _validate_sinks(cfg)
    _validate_resume_and_threads(cfg)
    _validate_eval(cfg.eval)
    degrees = degrees_of(cfg, world_size * cfg.parallel.tp * cfg.parallel.pp)
    validate_finetune(cfg, degrees.dp_shard, degrees.dp_replicate)


def validate_model(m: ModelConfig) -> None:
    """A model description on its own, as `validate` checks it: for one read from a file (a run's
    config.yaml, an export's model_config.json, a Hugging Face config.json) before it is built."""
    _model_counts(m)
    _validate_model(m)


def _model_counts(m: ModelConfig) -> None:
    for key, value in [("model.n_layer", m.n_layer), ("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
                       ("model.block_size", m.block_size)]:
        _require(value >= 1, f"'{key}' is {value}; it must be a positive integer.")


def _validate_counts(cfg: Config) -> None:
    """The sizes and intervals later checks divide or count by (model sizes included)."""
    _model_counts(cfg.model)
    for key, value in [
        ("micro_batch_size", cfg.micro_batch_size), ("global_batch_size", cfg.global_batch_size),
        ("eval_batches", cfg.eval_batches), ("log_interval", cfg.log_interval),
    ]:
        # micro_batch_size may still be null here: it is derived later, once the world size is known
        _require(value is None or value >= 1, f"'{key}' is {value}; it must be a positive integer.")
    _require(cfg.eval_interval >= 0,
             f"'eval_interval' is {cfg.eval_interval}; use a step count >= 1, or 0 to disable evaluation.")
    _require(cfg.timing_interval >= 0,
             f"'timing_interval' is {cfg.timing_interval}; use a step count >= 1, or 0 to time no step.")


def _validate_parallel(cfg: Config) -> None:
    p = cfg.parallel
    _require(p.nproc >= 1, f"'parallel.nproc' is {p.nproc}; it must be >= 1.")
    launched = int(os.environ.get("WORLD_SIZE") or 1)
    _require(launched == 1 or p.nproc in (1, launched),  # == launched: the ranks parallel.nproc started
             f"torchrun started {launched} processes and parallel.nproc is {p.nproc}: under torchrun leave "
             "parallel.nproc=1 (torchrun's --nproc_per_node sets the count).")
    for key in ("dp_replicate", "dp_shard"):
        value = getattr(p, key)
        _require(value >= 1 or value == -1, f"'parallel.{key}' is {value}; use a process count >= 1, or -1 for "
                 "the processes the other degrees leave.")
    _require(p.tp >= 1, f"'parallel.tp' is {p.tp}; use the number of processes each layer is split across "
             "(>= 1; -1 is only for a data-parallel degree).")
    _require(p.pp >= 1, f"'parallel.pp' is {p.pp}; use the number of pipeline stages the layers are split into "
             "(>= 1; -1 is only for a data-parallel degree).")
    _require(p.pp_schedule in PIPELINE_SCHEDULES, f"'parallel.pp_schedule' is '{p.pp_schedule}'; valid schedules: "
             f"{', '.join(PIPELINE_SCHEDULES)}.")
    _require(not (p.dp_replicate == -1 and p.dp_shard == -1),
             "'parallel.dp_replicate' and 'parallel.dp_shard' are both -1; at most one degree can take the "
             "processes the others leave: set the other to a count (e.g. parallel.dp_replicate=2 for 2 replicas).")
    world = world_size_of(cfg)
    given = p.pp * p.tp * max(p.dp_replicate, 1) * max(p.dp_shard, 1)
    layout = (f"tp={p.tp} x dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard}"
              + (f" x pp={p.pp}" if p.pp > 1 else ""))
    started = (f"torchrun started {world} processes" if launched > 1
               else f"this run has {world} process{'es' if world > 1 else ''} (parallel.nproc={world})")
    if given == 1 and world > 1 and -1 not in (p.dp_replicate, p.dp_shard):
        raise ConfigError(f"{started} but the layout is a single process ({layout}); add parallel=ddp "
                          "(or parallel=zero1, fsdp, tp, fsdp_tp) to train one model across them.")
    if -1 in (p.dp_replicate, p.dp_shard):
        _require(world % given == 0,
                 f"{started}, which the fixed degrees ({layout}, product {given}) do not divide; "
                 f"use a process count that is a multiple of {given}, e.g. parallel.nproc={given * 2}.")
    else:
        _require(given == world,
                 f"the layout {layout} needs {given} processes but {started}; "
                 + (f"add parallel.nproc={given} (llmtrain starts them) or launch with torchrun "
                    f"--nproc_per_node={given}." if world == 1 else
                    "make the product of the degrees equal the process count (-1 on dp_shard or dp_replicate takes "
                    "the rest)."))
    degrees = degrees_of(cfg, world)
    _require(not p.zero1 or (degrees.dp_shard == 1 and degrees.tp == 1),
             f"parallel.zero1 splits the optimizer state across replicas, but the layout is {layout}: with "
             "dp_shard > 1 FSDP2 shards the optimizer state already, and tensor parallel splits it with the weights; "
             "use parallel=zero1 (replicas only) or drop parallel.zero1.")
    _require(degrees.tp == 1 or degrees.dp_replicate == 1,
             f"tensor parallel (tp={degrees.tp}) with dp_replicate={degrees.dp_replicate} replicas is not supported: "
             "DDP does not take tensor-parallel weights; use parallel.dp_shard for the data-parallel dimension "
             "(parallel=fsdp_tp), or tp alone.")
    _require(not p.sequence_parallel or degrees.tp > 1,
             "parallel.sequence_parallel splits activations across the tensor-parallel processes, but tp is 1; "
             "set parallel.tp > 1 (parallel=tp or fsdp_tp) or drop parallel.sequence_parallel.")
    if degrees.tp > 1:
        # The vocabulary is checked here when the model sets it; a data-derived one once the data is
        # read (training/setup.py), still before the model is built.
        lengths = [*seq_len_schedule(cfg).values(), seq_len_of(cfg)]
        problems = tensor_parallel_problems(cfg.model, cfg.model.vocab_size, degrees.tp, p.sequence_parallel,
                                            lengths, optimizer=cfg.optim.name.value)
        _require(not problems, f"tensor parallel (tp={degrees.tp}) cannot split this run: {' '.join(problems)}")
    _require(cfg.checkpoint.format is not CheckpointFormat.sharded or (p.dp_shard != 1 and degrees.tp == 1),
             f"checkpoint.format is sharded but the layout is {layout}: only FSDP2 without tensor parallel "
             "(parallel=fsdp, hsdp) writes sharded files; use checkpoint.format=full or auto (sharded files under "
             "fsdp).")


def _resolve_pipeline_microbatches(cfg: Config, data_parallel: int) -> None:
    """parallel.pp_microbatches: the window's micro-batches are the pipeline's, so it sets
    micro_batch_size (each data-parallel rank's batch / it); an explicit micro_batch_size must agree."""
    p = cfg.parallel
    if p.pp_microbatches is None:
        return
    _require(p.pp_microbatches >= 1, f"'parallel.pp_microbatches' is {p.pp_microbatches}; use a count >= 1 (at "
             f"least parallel.pp={p.pp}), or null for the accumulation steps.")
    per_rank = cfg.global_batch_size // max(data_parallel, 1)
    _require(per_rank % p.pp_microbatches == 0,
             f"parallel.pp_microbatches={p.pp_microbatches} does not divide each data-parallel rank's batch of "
             f"{per_rank} sequences (global_batch_size={cfg.global_batch_size}); use a divisor of {per_rank} "
             f"({', '.join(str(d) for d in range(1, per_rank + 1) if per_rank % d == 0)}).")
    micro = per_rank // p.pp_microbatches
    _require(cfg.micro_batch_size is None or micro_batch_size_derived(cfg) or cfg.micro_batch_size == micro,
             f"parallel.pp_microbatches={p.pp_microbatches} means micro-batches of {micro} sequences, but "
             f"micro_batch_size is {cfg.micro_batch_size}; set one of them (or micro_batch_size={micro}).")
    cfg.micro_batch_size = micro


def _validate_pipeline(cfg: Config, data_parallel: int) -> None:
    p = cfg.parallel
    if p.pp == 1:
        return
    degrees = degrees_of(cfg, data_parallel * p.tp * p.pp)
    # The data-parallel dimension of a pipeline is FSDP2 (its shards, or replicas x shards: HSDP);
    # DDP replicas of the stages alone are not built.
    _require(degrees.dp_replicate == 1 or degrees.dp_shard > 1,
             f"pipeline parallel (pp={p.pp}) with dp_replicate={degrees.dp_replicate} DDP replicas (dp_shard=1) is not "
             f"built: shard the data-parallel dimension instead (parallel=fsdp_pp parallel.pp={p.pp} "
             f"parallel.nproc={degrees.world}, FSDP2 over dp_shard={degrees.dp_replicate}), or use the pipeline alone "
             f"(parallel=pp parallel.nproc={p.pp}).")
    _require(cfg.checkpoint.format is not CheckpointFormat.sharded,
             f"checkpoint.format is sharded but pipeline parallel (pp={p.pp}) writes its checkpoints whole (rank 0 "
             "gathers every stage); use checkpoint.format=full or auto.")
    scaling = cfg.precision.name is Precision.fp16 and cfg.precision.loss_scaling
    problems = pipeline_problems(cfg.model, p.pp, p.pp_schedule, accumulation_steps(cfg, data_parallel),
                                 tp=p.tp, fp16_loss_scaling=scaling)
    _require(not problems, f"pipeline parallel (pp={p.pp}) cannot run this config: {' '.join(problems)}")
    _require(not cfg.eval.tasks,
             f"eval.tasks ({', '.join(map(str, cfg.eval.tasks))}) score the model on one process, which pipeline "
             f"parallel (pp={p.pp}) splits; run them afterwards with `llmtrain eval RUN_DIR`, or drop eval.tasks.")


def _validate_model(m: ModelConfig) -> None:
    if m.n_embd % m.n_head:
        raise ConfigError(
            f"'model.n_embd' ({m.n_embd}) is not divisible by 'model.n_head' ({m.n_head}); "
            f"pick a head count that divides the width, e.g. model.n_head={_divisor_near(m.n_embd, m.n_head)}."
        )
    if m.n_kv_head is not None:
        _require(m.n_kv_head >= 1 and m.n_head % m.n_kv_head == 0,
                 f"'model.n_kv_head' is {m.n_kv_head}; it must divide model.n_head ({m.n_head}): each key/value head "
                 "serves the same number of query heads "
                 f"(e.g. model.n_kv_head={_divisor_near(m.n_head, max(1, m.n_kv_head))}, "
                 "or null for one per query head).")
    _require(m.intermediate_size is None or m.intermediate_size >= 1,
             f"'model.intermediate_size' is {m.intermediate_size}; use a positive MLP width or null (from mlp_ratio).")
    _require(0 < m.rope_theta < math.inf, f"'model.rope_theta' is {m.rope_theta}; it must be a finite number > 0 "
             "(typical: 10000, 500000).")
    _require(m.norm_eps is None or 0 < m.norm_eps < 1,
             f"'model.norm_eps' is {m.norm_eps}; use a small positive epsilon (1e-5, 1e-6) or null.")
    if m.position is PositionEncoding.rope:
        _require(
            (m.n_embd // m.n_head) % 2 == 0,
            f"RoPE needs an even head dimension; n_embd/n_head = {m.n_embd // m.n_head}.",
        )
    _require(0.0 <= m.dropout < 1.0, f"'model.dropout' is {m.dropout}; valid range is 0 <= dropout < 1.")
    _require(m.checkpoint_every >= 1,
             f"'model.checkpoint_every' is {m.checkpoint_every}; use a positive integer: 1 checkpoints every block, k "
             "the blocks whose index is a multiple of k (model.activation_checkpointing=full|op; none ignores it).")
    _require(
        m.init in INIT_SCHEMES,
        f"'model.init' is '{m.init}'; valid init schemes: {', '.join(INIT_SCHEMES)}.",
    )
    _require(
        m.tie_weights is False or m.head_init is HeadInit.plain,
        f"'model.head_init' is {m.head_init.value} but model.tie_weights=true shares the head with the embedding; "
        "use model.tie_weights=false for a zero or tiny head, or model.head_init=plain.",
    )
    _require(
        0 < m.mlp_ratio < math.inf and int(m.mlp_ratio * m.n_embd) >= 1,
        f"'model.mlp_ratio' is {m.mlp_ratio}; the MLP needs a positive width (typical: 4.0).",
    )
    _require(0 < m.init_std < math.inf, f"'model.init_std' is {m.init_std}; it must be a finite number > 0.")
    _require(m.vocab_size is None or m.vocab_size >= 1,
             f"'model.vocab_size' is {m.vocab_size}; use a positive size or null.")
    _require(m.vocab_multiple >= 1, f"'model.vocab_multiple' is {m.vocab_multiple}; use 1 (no padding) or a "
             "positive multiple, e.g. 64.")
    _require(m.sliding_window is None or m.sliding_window >= 1,
             f"'model.sliding_window' is {m.sliding_window}; use a positive token count (each token attends to "
             "itself and the sliding_window - 1 tokens before it, e.g. model.sliding_window=128), or null for full "
             "causal attention.")


def _divisor_near(n: int, k: int) -> int:
    """The divisor of `n` closest to `k`: the head count suggested for a width it does not divide."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # pairs (d, n // d): sqrt(n) trials, not n
    return min(small + [n // d for d in small], key=lambda d: (abs(d - k), d))


def _validate_optim(cfg: Config) -> None:
    """The optimizer's settings; a null optim.lr is filled in (for the model's width) once it passed."""
    o = cfg.optim
    _require(
        o.lr is None or (o.lr > 0 and math.isfinite(o.lr)),
        f"'optim.lr' is {o.lr}; the learning rate must be a finite number > 0 (typical AdamW values: 1e-4 to 3e-3), "
        "or null for the default of this optimizer and model width.",
    )
    resolve_lr(cfg)
    _require(0 <= o.momentum < 1, f"'optim.momentum' is {o.momentum}; valid range is [0, 1) (typical: 0.9).")
    _require(o.weight_decay >= 0, f"'optim.weight_decay' is {o.weight_decay}; it must be >= 0.")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1,
             f"'optim.beta1'/'optim.beta2' are {o.beta1}/{o.beta2}; both must be in [0, 1).")
    _require(o.eps > 0, f"'optim.eps' is {o.eps}; it must be > 0.")
    _require(
        not (o.clip_grad_norm is not None and o.clip_grad_value is not None),
        f"Both 'optim.clip_grad_norm' ({o.clip_grad_norm}) and 'optim.clip_grad_value' ({o.clip_grad_value}) "
        "are set; choose one, e.g. optim.clip_grad_value=null.",
    )
    for key, value in [("optim.clip_grad_norm", o.clip_grad_norm), ("optim.clip_grad_value", o.clip_grad_value)]:
        _require(value is None or value > 0, f"'{key}' is {value}; use a positive threshold or null to disable.")
    if o.name in LOW_BIT_OPTIMIZERS:
        _validate_low_bit(cfg)


def _validate_low_bit(cfg: Config) -> None:
    """torchao's 8-/4-bit AdamW: installed, and in a layout whose parameters it can step (plain
    tensors, or FSDP2's evenly sharded DTensors)."""
    name, p = cfg.optim.name.value, cfg.parallel
    _require(torchao_installed(),
             f"optim.name is {name}, which is torchao's low-bit AdamW, but the torchao package is not installed; "
             "pip install 'llmtrain[ao]' (or pip install torchao), or use optim=adamw.")
    _require(not cfg.optim.fused,
             f"optim.fused=true, but {name} has no fused kernel: torchao compiles its own step; set optim.fused=null "
             "(or false), or use optim=adamw for the fused kernel.")
    # Measured with torch 2.13 and torchao 0.18: under tensor parallel the first checkpoint fails (gathering
    # the quantized state needs aten.split, which torchao's state types lack); under pipeline parallel
    # training and saving work but a resume fails (loading the stages' state needs aten.clone).
    _require(p.tp == 1,
             f"optim.name is {name}, which llmtrain cannot run under tensor parallel (parallel.tp={p.tp}): gathering "
             "torchao's quantized optimizer state of split weights for a checkpoint fails; use optim=adamw, or shard "
             "with parallel=fsdp instead.")
    _require(p.pp == 1,
             f"optim.name is {name}, which llmtrain cannot run under pipeline parallel (parallel.pp={p.pp}): its "
             "checkpoints save, but torchao's quantized optimizer state cannot be loaded back into the stages, so the "
             "run could never resume; use optim=adamw, or shard with parallel=fsdp instead.")
    # FSDP2 gathering the quantized state whole for full files leaves unfinished collectives in it
    # (AsyncCollectiveTensor), which torch.load(weights_only=True) refuses: every checkpoint unreadable.
    _require(degrees_of(cfg).dp_shard == 1 or cfg.checkpoint.format is not CheckpointFormat.full,
             f"optim.name is {name} with checkpoint.format=full under FSDP2 (parallel.dp_shard>1): gathering "
             "torchao's quantized optimizer state into whole files writes checkpoints that cannot be loaded; use "
             "checkpoint.format=auto (each rank writes its own shards, which resume exactly), or optim=adamw.")


def _validate_schedule(s: ScheduleConfig, global_batch_size: int) -> None:
    _require(0 <= s.min_lr_ratio <= 1, f"'schedule.min_lr_ratio' is {s.min_lr_ratio}; valid range is [0, 1].")
    _require(0 <= s.warmup_fraction < 1, f"'schedule.warmup_fraction' is {s.warmup_fraction}; valid range is [0, 1).")
    _require(0 < s.decay_fraction <= 1, f"'schedule.decay_fraction' is {s.decay_fraction}; valid range is (0, 1].")
    if s.lr_scaling is not LRScaling.none:
        _require(
            s.reference_batch_size is not None and s.reference_batch_size >= 1,
            f"schedule.lr_scaling={s.lr_scaling.value} needs 'schedule.reference_batch_size', the global batch "
            f"(in sequences) optim.lr was tuned for, e.g. schedule.reference_batch_size={global_batch_size}.",
        )
    _require(s.warmup_steps is None or s.warmup_steps >= 0,
             f"'schedule.warmup_steps' is {s.warmup_steps}; it must be >= 0.")
    # Longer than the run is allowed: a run cut into pieces ends mid-decay on purpose.
    _require(s.total_steps is None or s.total_steps >= 1,
             f"'schedule.total_steps' is {s.total_steps}; use the schedule's length in optimizer steps (>= 1), or "
             "null for the run's length.")


def _validate_run_length(cfg: Config, world_size: int) -> None:
    """A budget (steps or tokens), and a global batch the micro-batches of all processes fill."""
    _require(
        cfg.max_steps is not None or cfg.max_tokens is not None,
        "Neither 'max_steps' nor 'max_tokens' is set; set one, e.g. max_steps=1000.",
    )
    _require(cfg.max_tokens is None or cfg.max_tokens >= 1, f"'max_tokens' is {cfg.max_tokens}; it must be >= 1.")
    _require(cfg.max_steps is None or cfg.max_steps >= 1, f"'max_steps' is {cfg.max_steps}; it must be >= 1.")
    per_pass = cfg.micro_batch_size * world_size
    _require(
        cfg.global_batch_size % per_pass == 0,
        f"'global_batch_size' ({cfg.global_batch_size}) is not divisible by micro_batch_size x world size "
        f"({cfg.micro_batch_size} x {world_size} = {per_pass}); valid global batch sizes are multiples of "
        f"{per_pass}, e.g. global_batch_size={max(per_pass, cfg.global_batch_size // per_pass * per_pass)}.",
    )


def _validate_seq_len_values(cfg: Config) -> None:
    """The lengths themselves (the schedule's pairs, or data.seq_len) are usable numbers."""
    _validate_schedule_values(cfg)
    seq_len = seq_len_of(cfg)
    _require(seq_len >= 1, f"'data.seq_len' is {seq_len}; it must be >= 1.")


def _validate_seq_len(cfg: Config, total: int) -> None:
    """The sequence length (the schedule's stages, then the length they end at) fits the model."""
    _validate_seq_len_schedule(cfg, total)
    seq_len = seq_len_of(cfg)
    _require(
        seq_len <= cfg.model.block_size,
        f"'data.seq_len' ({seq_len}) is longer than the model's context 'model.block_size' ({cfg.model.block_size}); "
        f"use data.seq_len<={cfg.model.block_size} or raise model.block_size.",
    )


def _schedule_text(cfg: Config) -> str:
    return f"'data.seq_len_schedule' is {[list(p) for p in cfg.data.seq_len_schedule]}"


def _validate_schedule_values(cfg: Config) -> None:
    """[step, length] pairs, one stage per step, one at step 0, every length in 1..block_size."""
    d = cfg.data
    if not d.seq_len_schedule:
        return
    where = _schedule_text(cfg)
    _require(all(len(pair) == 2 for pair in d.seq_len_schedule),
             f"{where}; give [step, seq_len] pairs, e.g. [[0,256],[1000,512],[3000,1024]].")
    schedule = seq_len_schedule(cfg)
    _require(len(schedule) == len(d.seq_len_schedule), f"{where}; each step may start one stage only.")
    _require(0 in schedule, f"{where}; it must say the length at step 0, e.g. [[0,{min(schedule.values())}],...].")
    _require(all(step >= 0 for step in schedule), f"{where}; steps must be >= 0.")
    for length in schedule.values():
        _require(1 <= length <= cfg.model.block_size,
                 f"{where}; every length must be in 1..model.block_size ({cfg.model.block_size}), not {length}.")


def _validate_seq_len_schedule(cfg: Config, total: int) -> None:
    """The schedule fits the run: data.seq_len agrees, every stage starts, the sampling allows it."""
    d = cfg.data
    if not d.seq_len_schedule:
        return
    where, schedule = _schedule_text(cfg), seq_len_schedule(cfg)
    final = seq_len_of(cfg)
    _require(d.seq_len is None or d.seq_len == final,
             f"{where}, whose last length is {final}, but 'data.seq_len' is {d.seq_len}; drop data.seq_len (the "
             f"schedule sets it) or make them equal.")
    late = max(schedule)
    _require(late < total, f"{where}, but the run has only {total} steps: the stage at step {late} never starts.")
    _require(d.sampling is Sampling.random and d.source is not DataSource.instruct and not d.overfit_batches,
             f"{where}; a sequence-length schedule needs data.sampling=random (an epoch's windows are cut at one "
             "length), plain text data (not data=instruct) and data.overfit_batches=0.")
    if d.seq_len_keep is SeqLenKeep.tokens:
        uneven = [length for length in schedule.values() if (cfg.micro_batch_size * final) % length]
        _require(not uneven,
                 f"{where} with data.seq_len_keep=tokens: a micro-batch holds micro_batch_size x {final} = "
                 f"{cfg.micro_batch_size * final} tokens, which length(s) {uneven} do not divide; use lengths that "
                 f"divide it (e.g. {final // 2}, {final // 4}) or data.seq_len_keep=batch.")


def _validate_data_amounts(d: DataConfig) -> None:
    """How much of the corpus is held out, cycled and read."""
    _require(0 < d.val_fraction < 1, f"'data.val_fraction' is {d.val_fraction}; valid range is (0, 1).")
    _require(d.overfit_batches >= 0,
             f"'data.overfit_batches' is {d.overfit_batches}; use 0 (off) or a batch count >= 1.")
    _require(d.max_bytes is None or d.max_bytes > 0, f"'data.max_bytes' is {d.max_bytes}; use a positive size or null.")


def _validate_label_smoothing(o: OptimConfig) -> None:
    _require(0 <= o.label_smoothing < 1,
             f"'optim.label_smoothing' is {o.label_smoothing}; valid range is [0, 1) (typical: 0.1).")


def _validate_data_source(d: DataConfig) -> None:
    """Where the text comes from and how it is tokenized."""
    _require(d.source is not DataSource.hf or bool(d.hf_name),
             "Missing required value 'data.hf_name': data=hf needs a dataset, e.g. "
             "data.hf_name=roneneldan/TinyStories, "
             "a folder written by save_to_disk, or data.hf_name=json data.path=docs.jsonl.")
    if d.source in (DataSource.text, DataSource.jsonl, DataSource.instruct):
        _require(
            d.path is not None,
            f"Missing required value 'data.path': data={d.source.value} needs your files, e.g. "
            f"data.path={'corpus/' if d.source is DataSource.text else 'docs.jsonl'}.",
        )
    _require(d.tokenizer is not TokenizerKind.bpe or d.bpe_sample_bytes >= 2**16,
             f"'data.bpe_sample_bytes' is {d.bpe_sample_bytes}; give at least 65536 "
             "(64 KiB of text to learn merges from; the default is 33554432, 32 MiB).")
    _require(d.tokenizer is not TokenizerKind.pretrained or bool(d.tokenizer_dir),
             "Missing required value 'data.tokenizer_dir': data.tokenizer=pretrained reads the tokenizer.json of a "
             "Hugging Face model folder, e.g. data.tokenizer_dir=./SmolLM-135M (model.init_from=FOLDER sets it).")
    _require(d.bpe_vocab_size >= 257,
             f"'data.bpe_vocab_size' is {d.bpe_vocab_size}; it must be >= 257 (256 bytes + end-of-text).")
    _require(d.text_field.strip() != "",
             "'data.text_field' is empty; name the JSON field that holds the text, e.g. text.")


def _validate_warmup(s: ScheduleConfig, total: int) -> None:
    """Warmup shorter than the schedule (`total` steps: schedule.total_steps, else the run's length);
    checked once the run's length in steps is known."""
    warmup = resolved_warmup_steps(s, total)
    source = (
        f"schedule.warmup_steps={s.warmup_steps}" if s.warmup_steps is not None
        else f"schedule.warmup_fraction={s.warmup_fraction} of {total} steps"
    )
    length, of, longer = (f"the run ({total} steps)", "the run", "") if s.total_steps is None else (
        f"the schedule (schedule.total_steps={total})", "the schedule", ", or a longer schedule.total_steps")
    _require(
        warmup < total or total == 1 and warmup <= 1,
        f"Warmup ({warmup} steps, from {source}) is not shorter than {length}; use schedule.warmup_steps<{total}, "
        f"typically 1-10% of {of} (e.g. schedule.warmup_steps={max(1, total // 20)}){longer}.",
    )


def _validate_device_and_seeds(cfg: Config) -> None:
    _require(
        re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", cfg.device) is not None,
        f"'device' is '{cfg.device}'; valid: auto, cpu, cuda, cuda:N, mps.",
    )
    for key, seed in (("seed", cfg.seed), ("data.seed", cfg.data.seed)):
        _require(seed is None or 0 <= seed < 2**32, f"'{key}' is {seed}; seeds must be in [0, 2**32).")


def _validate_precision(p: PrecisionConfig) -> None:
    _require(p.init_scale > 0 and math.isfinite(p.init_scale),
             f"'precision.init_scale' is {p.init_scale}; it must be a finite number > 0.")
    _require(p.growth_interval >= 1, f"'precision.growth_interval' is {p.growth_interval}; it must be >= 1.")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _require(c.every_steps is None or c.every_steps >= 1,
             f"'checkpoint.every_steps' is {c.every_steps}; use a step count >= 1 or null.")
    _require(
        c.every_minutes is None or c.every_minutes > 0,
        f"'checkpoint.every_minutes' is {c.every_minutes}; use minutes > 0 or null.",
    )
    _require(c.keep_last >= 1, f"'checkpoint.keep_last' is {c.keep_last}; keep at least 1 checkpoint.")
    _require(c.max_consecutive_skips >= 1,
             f"'checkpoint.max_consecutive_skips' is {c.max_consecutive_skips}; it must be >= 1.")
    _require(0 < c.rollback_lr_factor <= 1,
             f"'checkpoint.rollback_lr_factor' is {c.rollback_lr_factor}; valid range is (0, 1].")
    _require(c.max_rollbacks >= 0, f"'checkpoint.max_rollbacks' is {c.max_rollbacks}; it must be >= 0.")


def _validate_monitor(mon: MonitorConfig) -> None:
    for key in ("interval", "activation_interval", "patience", "trend_window", "activation_window",
                "activation_patience", "spike_window", "cooldown_checks"):
        _require(getattr(mon, key) >= 1, f"'monitor.{key}' is {getattr(mon, key)}; it must be >= 1.")
    _require(mon.trend_window >= 3, f"'monitor.trend_window' is {mon.trend_window}; a trend needs >= 3 checks.")
    _require(mon.max_repairs >= 0, f"'monitor.max_repairs' is {mon.max_repairs}; it must be >= 0 (0: none).")
    _require(mon.enabled or not mon.repair,
             "'monitor.repair' is true but the monitor is off (monitor.enabled=false, e.g. monitor=off): repairs "
             "follow its alarms. Turn the monitor on (monitor=default) or drop monitor.repair=true.")
    _require(0 < mon.reduce_lr_factor < 1,
             f"'monitor.reduce_lr_factor' is {mon.reduce_lr_factor}; valid range is (0, 1).")
    for name in mon.actions:
        _require(name in ALARM_NAMES, unknown_name_message("monitor.actions", name))


def unknown_name_message(mapping: str, name: str) -> str:
    """A name a mapping such as `monitor.actions` does not know (added with '+key=...')."""
    names = MAPPING_KEYS[mapping]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"'{mapping}' names an unknown alarm '{name}'; valid alarms: {', '.join(names)}.{hint}"


def _validate_sinks(cfg: Config) -> None:
    """The optional metric sinks need their packages (the extras) installed."""
    if cfg.tensorboard:
        _require(
            importlib.util.find_spec("tensorboard") is not None,
            "tensorboard=true, but the tensorboard package is not installed; pip install 'llmtrain[tensorboard]' "
            "(or pip install tensorboard), or set tensorboard=false.",
        )
    if cfg.wandb is not WandbMode.off:
        _require(
            importlib.util.find_spec("wandb") is not None,
            f"wandb={cfg.wandb.value}, but the wandb package is not installed; pip install 'llmtrain[wandb]' "
            "(or pip install wandb), or set wandb=off.",
        )


def _validate_resume_and_threads(cfg: Config) -> None:
    _require(cfg.resume.strip() != "", "'resume' is empty; use auto, never, or the path of a checkpoint or run dir.")
    problem = threads_error(cfg.threads)
    _require(problem is None, problem or "")


def _validate_eval(e: EvalConfig) -> None:
    """The entries' form only (no file is opened here): the files are read when a command starts."""
    parse_task_specs(e.tasks)
    _require(e.batch_size >= 1, f"'eval.batch_size' is {e.batch_size}; it must be >= 1.")
    _require(e.stride is None or e.stride >= 1, f"'eval.stride' is {e.stride}; use a token count >= 1, or null for "
             "non-overlapping windows.")
    _require(e.limit is None or e.limit >= 1, f"'eval.limit' is {e.limit}; use a count >= 1, or null for all.")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
