"""Quantities derived from a typed `Config` rather than set in it: the world size, the
micro-batch size and the learning rate a null leaves to derive (`resolve_*`, filled in by
`validate`), accumulation, total steps and the LR schedule's length, the sequence-length stages, the LR's sane
range and its batch-scaled value, warmup in steps, the model's vocabulary size. One function each, so every
module (the loop, `check`, `estimate`, the banner, the doctor) derives them the same way."""

import math
import os
from dataclasses import dataclass

from llmtrain.config.finetune import LORA_ADAM_LR, is_lora
from llmtrain.config.schema import (
    Config,
    DataConfig,
    LRScaling,
    ModelConfig,
    OptimizerName,
    ScheduleConfig,
    SeqLenKeep,
    TokenizerKind,
)
from llmtrain.core.errors import ConfigError


def seq_len_schedule(cfg: Config) -> dict[int, int]:
    """data.seq_len_schedule as {start step: length}, in step order ({} without a schedule)."""
    return dict(sorted((int(pair[0]), int(pair[1])) for pair in cfg.data.seq_len_schedule if len(pair) == 2))


def seq_len_of(cfg: Config) -> int:
    """The run's sequence length: the schedule's last, else data.seq_len, else the model's context."""
    if schedule := seq_len_schedule(cfg):
        return list(schedule.values())[-1]
    return cfg.data.seq_len if cfg.data.seq_len is not None else cfg.model.block_size


def tokens_per_step(cfg: Config) -> int:
    """The tokens one optimizer step sees: the global batch x the run's sequence length."""
    return cfg.global_batch_size * seq_len_of(cfg)


@dataclass(frozen=True)
class SeqLenStage:
    """From `start_step` on, sequences of `seq_len` tokens, `micro_batch_size` of them per pass."""

    start_step: int
    seq_len: int
    micro_batch_size: int


def seq_len_stages(cfg: Config) -> list[SeqLenStage]:
    """The run's (start step, sequence length, micro-batch size) stages; one without a schedule.
    Keeping tokens, a stage at 1/k of the final length draws k times the sequences per micro-batch:
    the same tokens per micro-batch (about the same activation memory), the same accumulation."""
    final = seq_len_of(cfg)
    if not cfg.data.seq_len_schedule:
        return [SeqLenStage(0, final, cfg.micro_batch_size)]
    keep_tokens = cfg.data.seq_len_keep is SeqLenKeep.tokens
    return [SeqLenStage(step, length, cfg.micro_batch_size * final // length if keep_tokens else cfg.micro_batch_size)
            for step, length in seq_len_schedule(cfg).items()]


def stage_at(stages: list[SeqLenStage], step: int) -> SeqLenStage:
    """The stage in force at `step` (the last one started by then)."""
    return [stage for stage in stages if stage.start_step <= step][-1]


def world_size_of(cfg: Config) -> int:
    """Processes in the run: torchrun's WORLD_SIZE when it launched us, else parallel.nproc."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return cfg.parallel.nproc


@dataclass(frozen=True)
class Degrees:
    """The device mesh's shape, outermost first: pipeline stages x replicas x shards x tensor-parallel
    ranks (the tensor-parallel ranks of one data-parallel rank are consecutive, so they share a node
    when one is possible; the pipeline stages are the outermost, so they may span nodes). A rank's
    share of the batch: distributed/layout.py's Layout.dp_rank."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        """Processes that split the global batch (the tp ranks and pipeline stages of one read the same)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def degrees_of(cfg: Config, world_size: int | None = None) -> Degrees:
    """parallel's degrees with a -1 filled in from the world size (validate has checked that it divides)."""
    p = cfg.parallel
    world = world_size or world_size_of(cfg)
    known = max(1, p.tp) * max(1, p.pp) * max(1, p.dp_replicate) * max(1, p.dp_shard)
    rest = max(1, world // known)
    return Degrees(dp_replicate=rest if p.dp_replicate == -1 else p.dp_replicate,
                   dp_shard=rest if p.dp_shard == -1 else p.dp_shard, tp=p.tp, pp=p.pp)


def data_parallel_size_of(cfg: Config) -> int:
    """Processes that split the global batch: the world size over the tensor and pipeline degrees."""
    return degrees_of(cfg).dp


# micro_batch_size=null takes the largest divisor of the per-process batch up to this: a default run
# (global 16, one process) keeps its historical micro-batch of 16, accumulation 1.
DERIVED_MICRO_BATCH_MAX = 16


# The value derived for a Config's micro_batch_size; an attribute, not a schema field, so that it is
# neither a key a user can set nor a value written to the run dir's config.yaml.
_MICRO_DERIVED = "_micro_batch_size_derived"


def resolve_micro_batch_size(cfg: Config, world_size: int) -> None:
    """Fill in a null `micro_batch_size`, in place, for `world_size` processes (called by `validate`,
    so everything downstream reads a number). An explicit value is kept and checked strictly; a
    derived one is derived again when the same config is validated for another world size."""
    if cfg.micro_batch_size is not None and not micro_batch_size_derived(cfg):
        return
    if cfg.global_batch_size % world_size:
        raise ConfigError(
            f"'global_batch_size' ({cfg.global_batch_size}) is not divisible by the world size "
            f"({world_size} processes), "
            f"so the processes cannot share it evenly; valid global batch sizes are multiples of {world_size}, e.g. "
            f"global_batch_size={max(world_size, cfg.global_batch_size // world_size * world_size)}."
        )
    cfg.micro_batch_size = derived_micro_batch_size(cfg.global_batch_size, world_size)
    setattr(cfg, _MICRO_DERIVED, cfg.micro_batch_size)


def derived_micro_batch_size(global_batch_size: int, world_size: int) -> int:
    """The micro-batch a null `micro_batch_size` means: the largest divisor of each process's share
    of the global batch not above DERIVED_MICRO_BATCH_MAX (so accumulation makes up the rest)."""
    per_process = max(global_batch_size // world_size, 1)
    return max(n for n in range(1, min(per_process, DERIVED_MICRO_BATCH_MAX) + 1) if per_process % n == 0)


def micro_batch_size_of(cfg: Config, world_size: int | None = None) -> int:
    """The micro-batch size of a config, also of one not validated yet (null: the derived value)."""
    if cfg.micro_batch_size is not None:
        return cfg.micro_batch_size
    return derived_micro_batch_size(cfg.global_batch_size, world_size or data_parallel_size_of(cfg))


def micro_batch_size_derived(cfg: Config) -> bool:
    """Whether `cfg.micro_batch_size` is the derived value (null in the config); a value assigned
    after validation is explicit, as one from the command line is."""
    derived = getattr(cfg, _MICRO_DERIVED, None)
    return derived is not None and derived == cfg.micro_batch_size


def accumulation_steps(cfg: Config, world_size: int | None = None) -> int:
    """Micro-batches per optimizer step on each process: global / (micro x world)."""
    world_size = world_size or data_parallel_size_of(cfg)
    return cfg.global_batch_size // (micro_batch_size_of(cfg, world_size) * world_size)


def total_micro_batches(cfg: Config, world_size: int | None = None) -> int:
    """Micro-batches per process over the whole run; a max_tokens budget may end mid-window."""
    world_size = world_size or data_parallel_size_of(cfg)
    if cfg.max_tokens is not None:
        per_micro = micro_batch_size_of(cfg, world_size) * world_size * seq_len_of(cfg)
        return -(-cfg.max_tokens // per_micro)
    assert cfg.max_steps is not None
    return cfg.max_steps * accumulation_steps(cfg, world_size)


def total_steps(cfg: Config, world_size: int | None = None) -> int:
    """Optimizer steps in the run: those a max_tokens budget takes when it is set (the last may be
    partial), else max_steps."""
    world_size = world_size or data_parallel_size_of(cfg)
    accum = accumulation_steps(cfg, world_size)
    return -(-total_micro_batches(cfg, world_size) // accum) if accum else 0


def schedule_steps(cfg: Config, world_size: int | None = None) -> int:
    """The LR schedule's length in optimizer steps: schedule.total_steps, else the run's length.
    Warmup and decay fractions are fractions of it; past its end `lr_at` holds the final LR (the
    floor), so a schedule shorter than the run leaves the last steps at the floor (or at 0)."""
    if cfg.schedule.total_steps is not None:
        return cfg.schedule.total_steps
    return total_steps(cfg, world_size)


# Adam-family peak LR at width 128: tuned on the default data with gpt_tiny (1e-3 learns ~15% slower).
# Wider models take it times 128 / n_embd (muP's rule for Adam on hidden matrices): 5e-4 at 768,
# next to GPT-2 small's 6e-4. SGD and Adafactor have no width rule here: one value each.
ADAM_LR_AT_WIDTH_128 = 3e-3


FIXED_DEFAULT_LR = {OptimizerName.sgd: 0.1, OptimizerName.adafactor: 1e-2}


# The LR an OptimConfig's null lr was filled in with: an attribute, not a schema field, so it is no
# key a user can set; on the OptimConfig, so dataclasses.replace of the Config keeps it.
_LR_DEFAULT = "_lr_default"


def default_lr(name: OptimizerName, n_embd: int) -> float:
    """The peak LR `optim.lr=null` means: for Adam-family optimizers it follows the model's width."""
    if name in FIXED_DEFAULT_LR:
        return FIXED_DEFAULT_LR[name]
    # Exactly 3e-3 at 128 (the default run is unchanged), 1/width above it (5e-4 at 768). Narrower
    # models keep 3e-3: it was measured at 128, and a larger LR for toy widths was not.
    return ADAM_LR_AT_WIDTH_128 * min(1.0, 128 / n_embd)


def run_default_lr(cfg: Config) -> float:
    """optim.lr=null's LR for this run: LoRA adapters' own (config/finetune.py LORA_ADAM_LR, for the
    Adam family; SGD and Adafactor keep their fixed defaults), else `default_lr` for the width."""
    if is_lora(cfg) and cfg.optim.name not in FIXED_DEFAULT_LR:
        return LORA_ADAM_LR
    return default_lr(cfg.optim.name, cfg.model.n_embd)


def run_lr_range(cfg: Config) -> tuple[float, float]:
    """`sane_lr_range` around this run's default (LoRA's adapters: around LORA_ADAM_LR)."""
    if is_lora(cfg) and cfg.optim.name not in FIXED_DEFAULT_LR:
        return LORA_ADAM_LR / 30, LORA_ADAM_LR * 3
    return sane_lr_range(cfg.optim.name, cfg.model.n_embd)


# The init's healthy band of fan-in x weight variance: above INIT_GAIN_HIGH signals grow layer by
# layer, below INIT_GAIN_LOW they vanish (std 0.02 at width 128 gives 0.05). The pre-flight check
# warns outside it and the monitor's diagnosis blames the init there.
INIT_GAIN_LOW = 0.005
INIT_GAIN_HIGH = 2.5


def init_gain(m: ModelConfig) -> float:
    """Fan-in x weight variance of the init: a layer's output variance on unit-variance inputs
    (far above 1 explodes layer by layer, far below vanishes). The pre-flight check and the health
    monitor's diagnosis judge the init by it."""
    if m.init == "normal_0.02":
        return m.n_embd * m.init_std**2
    return 2.0 if m.init == "kaiming" else 2 * m.n_embd / (m.n_embd + 4 * m.n_embd)


def sane_lr_range(name: OptimizerName, n_embd: int) -> tuple[float, float]:
    """(low, high) peak LRs the pre-flight check passes; `default_lr` lies inside, so the default
    never warns and the check's suggested fix is the default."""
    if name is OptimizerName.sgd:
        return 1e-3, 0.5
    if name is OptimizerName.adafactor:
        return 1e-4, 3e-2
    center = default_lr(name, n_embd)
    return center / 30, center * 3


def resolve_lr(cfg: Config) -> None:
    """Fill in a null `optim.lr`, in place, with `default_lr` for the optimizer and width (called by
    `validate`, so everything downstream reads a number). A defaulted LR follows the model again
    when the config is validated after a change of width or optimizer; an explicit one is kept."""
    if cfg.optim.lr is not None and not lr_defaulted(cfg):
        return
    cfg.optim.lr = run_default_lr(cfg)
    setattr(cfg.optim, _LR_DEFAULT, cfg.optim.lr)


def lr_defaulted(cfg: Config) -> bool:
    """Whether `cfg.optim.lr` is the default it was filled in with (null in the config), not a value
    set before or since (an assignment after validation wins, as an explicit value does)."""
    filled = getattr(cfg.optim, _LR_DEFAULT, None)
    return filled is not None and cfg.optim.lr == filled


def describe_lr(cfg: Config) -> str:
    """'0.0005 (default for adamw at width 768; set optim.lr to choose)', or the set value."""
    lr = f"{cfg.optim.lr:g}"
    if not lr_defaulted(cfg):
        return lr
    if is_lora(cfg) and cfg.optim.name not in FIXED_DEFAULT_LR:
        return f"{lr} (default for LoRA adapters with {cfg.optim.name.value}; set optim.lr to choose)"
    width = f" at width {cfg.model.n_embd}" if cfg.optim.name not in FIXED_DEFAULT_LR else ""
    return f"{lr} (default for {cfg.optim.name.value}{width}; set optim.lr to choose)"


# The vocabulary a tokenizer fixes before any data is read (None: it depends on the corpus).
KNOWN_VOCAB = {TokenizerKind.byte: 256, TokenizerKind.gpt2: 50257}


def expected_data_vocab(d: DataConfig) -> int | None:
    """The data's vocabulary before it is prepared: exact for byte and gpt2, at most
    data.bpe_vocab_size for bpe, unknown (None) for char."""
    if d.tokenizer is TokenizerKind.bpe:
        return d.bpe_vocab_size
    return KNOWN_VOCAB.get(d.tokenizer)


def model_vocab_size(cfg: Config, data_vocab: int) -> int:
    """The vocabulary the model is built with for data of `data_vocab` ids: `model.vocab_size` when
    set, else the data's padded up to a multiple of `model.vocab_multiple` (padding ids are never
    targets). Train, check, estimate and the doctor size the model here; sample and export read the
    size from the saved weights, which hold this number."""
    m = cfg.model
    if m.vocab_size is None:
        return -(-data_vocab // m.vocab_multiple) * m.vocab_multiple
    if m.vocab_size < data_vocab:  # the data's ids would index past the embedding table
        raise ConfigError(vocab_too_small(cfg, data_vocab))
    return m.vocab_size


def vocab_too_small(cfg: Config, data_vocab: int) -> str:
    """The error text for a model.vocab_size the data's ids do not fit in."""
    return (
        f"'model.vocab_size' ({cfg.model.vocab_size}) is smaller than the data's vocabulary ({data_vocab} tokens, "
        f"{cfg.data.tokenizer.value} tokenizer); use model.vocab_size>={data_vocab} or model.vocab_size=null."
    )


def effective_lr(cfg: Config) -> float:
    """The peak LR the run uses: optim.lr, scaled with the global batch when schedule.lr_scaling asks
    (seed 003 §3: linear, batch xk -> lr xk; sqrt, lr x sqrt(k))."""
    s = cfg.schedule
    lr = cfg.optim.lr if cfg.optim.lr is not None else run_default_lr(cfg)
    if s.lr_scaling is LRScaling.none or s.reference_batch_size is None:
        return lr
    ratio = cfg.global_batch_size / s.reference_batch_size
    return lr * (ratio if s.lr_scaling is LRScaling.linear else math.sqrt(ratio))


def resolved_warmup_steps(schedule: ScheduleConfig, total: int) -> int:
    """Warmup in steps: schedule.warmup_steps, else warmup_fraction of a schedule of `total` steps
    (`schedule_steps`: the run's length unless schedule.total_steps sets another)."""
    if schedule.warmup_steps is not None:
        return schedule.warmup_steps
    return int(round(schedule.warmup_fraction * total))


# The default LRs are set for batches of about REFERENCE_BATCH_TOKENS tokens; a smaller batch's
# gradient is noisier, and the LR it bears falls about with the root of its size (seed 003 §3's
# sqrt scaling, the rule for Adam-like optimizers).
REFERENCE_BATCH_TOKENS = 4096


def batch_scaled_lr(default_lr: float, tokens_per_step: int) -> float:
    """The default LR scaled down to a batch of `tokens_per_step` by the root of its size (never up)."""
    return default_lr * math.sqrt(min(1.0, tokens_per_step / REFERENCE_BATCH_TOKENS))
