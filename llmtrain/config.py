"""Typed configuration: one dataclass per config group, registered in Hydra's ConfigStore.

Hydra composes the YAML files in `conf/` on top of these schemas, so a typo, a wrong type or an
unknown choice fails during composition. `to_config` turns the composed OmegaConf node into plain
dataclass objects (nothing downstream imports omegaconf) and runs the cross-field checks that no
single field can express. Every user mistake surfaces as `ConfigError`: one paragraph naming the
key, the bad value and what would be valid.

Each field carries a one-line doc in `metadata["help"]`; `llmtrain train --help` and
`docs/configuration.md` are written from it.
"""

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from llmtrain.errors import ConfigError

__all__ = ["Config", "ConfigError", "to_config", "validate"]


def _f(default: Any, doc: str) -> Any:
    """A dataclass field with a one-line doc."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        # A fresh copy per instance: a shared default would leak one config's edits into all others.
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": doc})
    return field(default=default, metadata={"help": doc})


class NormPosition(str, Enum):
    pre = "pre"
    post = "post"


class PositionEncoding(str, Enum):
    learned = "learned"
    rope = "rope"


class NormKind(str, Enum):
    layernorm = "layernorm"
    rmsnorm = "rmsnorm"


class MlpKind(str, Enum):
    gelu = "gelu"
    swiglu = "swiglu"


# A plain string field (OmegaConf matches enums by member name, and "normal_0.02" is no name).
INIT_SCHEMES = ("normal_0.02", "xavier", "kaiming")


class ResidualInit(str, Enum):
    scaled = "scaled"
    zero = "zero"
    plain = "plain"


class HeadInit(str, Enum):
    plain = "plain"
    zero = "zero"
    tiny = "tiny"


class OptimizerName(str, Enum):
    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"
    adafactor = "adafactor"


class ScheduleName(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"
    wsd = "wsd"


class LRScaling(str, Enum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class TokenizerKind(str, Enum):
    byte = "byte"
    char = "char"
    bpe = "bpe"
    gpt2 = "gpt2"


class DataSource(str, Enum):
    python_stdlib = "python_stdlib"
    text = "text"
    jsonl = "jsonl"
    instruct = "instruct"
    hf = "hf"


class Sampling(str, Enum):
    random = "random"
    epoch = "epoch"


class SeqLenKeep(str, Enum):
    tokens = "tokens"
    batch = "batch"


class DecodeErrors(str, Enum):
    replace = "replace"
    skip = "skip"


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    auto = "auto"


class CompileMode(str, Enum):
    off = "off"
    on = "on"
    auto = "auto"


class NonFinitePolicy(str, Enum):
    stop = "stop"
    skip = "skip"
    rollback = "rollback"


class SaveErrorPolicy(str, Enum):
    warn = "warn"
    stop = "stop"


class CheckpointFormat(str, Enum):
    auto = "auto"  # sharded under parallel=fsdp, full otherwise
    full = "full"
    sharded = "sharded"


class MonitorAction(str, Enum):
    warn = "warn"
    reduce_lr = "reduce_lr"
    skip_step = "skip_step"
    rollback = "rollback"
    stop = "stop"


ALARM_NAMES = (
    "grad_norm_high", "grad_norm_low", "grad_norm_low_early_layers", "param_norm_jump", "param_norm_decrease",
    "lr_zero", "lr_exploding", "activation_mean_drift", "activation_variance_growing",
    "activation_variance_shrinking", "memory_leak", "loss_spike", "fp16_no_scaler",
)


class WandbMode(str, Enum):
    off = "off"
    offline = "offline"
    online = "online"


class ParallelMode(str, Enum):
    single = "single"
    ddp = "ddp"
    zero1 = "zero1"
    fsdp = "fsdp"


@dataclass
class ModelConfig:
    name: str = _f("gpt_tiny", "Label of this model shape, shown in the banner.")
    n_layer: int = _f(4, "Number of transformer blocks.")
    n_head: int = _f(4, "Attention heads per block; must divide n_embd.")
    n_embd: int = _f(128, "Width of the residual stream.")
    block_size: int = _f(256, "Context length: the longest sequence the model accepts.")
    vocab_size: int | None = _f(
        None, "Vocabulary size; null takes the data's vocabulary, padded up to a multiple of vocab_multiple.")
    vocab_multiple: int = _f(
        1, "vocab_size=null: pad the data's vocabulary up to a multiple of this (64 suits GPU matmuls); the padding "
        "ids are never targets and never sampled.")
    dropout: float = _f(0.0, "Dropout probability on attention, MLP and embedding outputs.")
    bias: bool = _f(True, "Biases in linear layers and LayerNorm.")
    tie_weights: bool = _f(True, "Share the token embedding with the LM head.")
    norm_position: NormPosition = _f(NormPosition.pre, "pre (pre-LN, stable) or post (original Transformer).")
    position: PositionEncoding = _f(PositionEncoding.learned, "learned absolute positions or rope.")
    norm: NormKind = _f(NormKind.layernorm, "layernorm or rmsnorm.")
    mlp: MlpKind = _f(MlpKind.gelu, "gelu (4x MLP) or swiglu (gated, 8/3x hidden).")
    mlp_ratio: float = _f(4.0, "MLP hidden width as a multiple of n_embd (swiglu uses 2/3 of it).")
    activation_checkpointing: bool = _f(False, "Recompute each block in backward to save memory.")
    init: str = _f("normal_0.02", "Weight init: normal_0.02, xavier or kaiming.")
    init_std: float = _f(0.02, "Standard deviation of the normal init.")
    residual_init: ResidualInit = _f(
        ResidualInit.scaled,
        "Residual output projections: scaled (std/sqrt(2*n_layer)), zero, or plain.",
    )
    head_init: HeadInit = _f(HeadInit.plain, "LM head when untied: plain, zero, or tiny (std 1e-4).")


@dataclass
class OptimConfig:
    name: OptimizerName = _f(OptimizerName.adamw, "adamw, adam, sgd or adafactor.")
    lr: float | None = _f(
        None, "Peak learning rate (after warmup); null takes the default for this optimizer and model width "
        "(adam/adamw: 3e-3 x min(1, 128 / n_embd), sgd 0.1, adafactor 1e-2).")
    weight_decay: float = _f(0.1, "Weight decay on matrices, never on biases or norms (decoupled for adamw, L2 for adam/sgd).")
    decay_embeddings: bool = _f(True, "Apply weight decay to embedding tables too (and to a head tied to them).")
    beta1: float = _f(0.9, "Adam beta1, first-moment decay (adam, adamw).")
    beta2: float = _f(0.95, "Adam beta2, second-moment decay (adam, adamw).")
    eps: float = _f(1e-8, "Adam epsilon (adam, adamw).")
    momentum: float = _f(0.9, "SGD momentum.")
    nesterov: bool = _f(False, "SGD Nesterov momentum.")
    fused: bool | None = _f(None, "Fused kernel (adam, adamw); null uses it where torch supports it.")
    clip_grad_norm: float | None = _f(1.0, "Clip the global gradient norm to this; null disables.")
    clip_grad_value: float | None = _f(None, "Clip each gradient element to +-value; excludes clip_grad_norm.")
    label_smoothing: float = _f(0.0, "Label smoothing of the training loss (0 = off; evaluation always reports the plain loss).")


@dataclass
class ScheduleConfig:
    name: ScheduleName = _f(ScheduleName.cosine, "cosine, linear, constant or wsd (warmup-stable-decay).")
    warmup_steps: int | None = _f(None, "Linear warmup length in steps; overrides warmup_fraction.")
    warmup_fraction: float = _f(0.05, "Warmup length as a fraction of the run (used when warmup_steps is null).")
    min_lr_ratio: float = _f(0.1, "Floor of the decay as a fraction of the peak LR.")
    decay_fraction: float = _f(0.2, "wsd only: fraction of the run spent in the final decay.")
    lr_scaling: LRScaling = _f(
        LRScaling.none, "Scale optim.lr with the global batch: none, linear (batch xk -> lr xk) or sqrt (lr x sqrt k)."
    )
    reference_batch_size: int | None = _f(None, "lr_scaling: the global batch (sequences) optim.lr was tuned for.")


@dataclass
class DataConfig:
    source: DataSource = _f(
        DataSource.python_stdlib, "python_stdlib (embedded, no download), text (your files), jsonl (a text field per "
        "line), instruct (prompt/response or chat JSON lines, loss on responses only) or hf (a Hugging Face dataset)."
    )
    path: str | None = _f(None, "text/jsonl: a file, a folder (its .txt/.md or .jsonl files, recursively) or a glob; "
                             "hf: the data files of a builder (data.hf_name=json/csv/parquet/text).")
    text_field: str = _f("text", "jsonl and hf: the field (column) that holds each document's text.")
    hf_name: str | None = _f(
        None, "hf: a Hugging Face dataset: a Hub name (downloaded once when online, then cached), a folder written by "
        "Dataset.save_to_disk, or a builder (json, csv, parquet, text) reading data.path. Needs llmtrain[hf].")
    hf_config: str | None = _f(None, "hf: the dataset's configuration (subset) name, if it has several.")
    hf_split: str = _f("train", "hf: the split to read (llmtrain makes its own train/validation split from it).")
    prompt_field: str = _f("prompt", "instruct: the field with the prompt (its tokens are not trained on).")
    response_field: str = _f("response", "instruct: the field with the response (the tokens trained on).")
    messages_field: str = _f("messages", "instruct: the field with chat messages [{role, content}]; only assistant turns train.")
    decode_errors: DecodeErrors = _f(
        DecodeErrors.replace, "Bytes that are not UTF-8: replace them (U+FFFD) or skip the documents that have them."
    )
    tokenizer: TokenizerKind = _f(
        TokenizerKind.byte, "byte (vocab 256), char (vocabulary from the corpus), bpe (byte-level BPE trained on it) or "
        "gpt2 (GPT-2's BPE through tiktoken, vocab 50257; its files must be on this machine, see data.gpt2_dir)."
    )
    bpe_vocab_size: int = _f(4096, "bpe only: the vocabulary size to train (>= 257: the 256 bytes + end-of-text).")
    gpt2_dir: str | None = _f(
        None, "gpt2 only: a folder holding GPT-2's vocab.bpe and encoder.json; null looks in tiktoken's cache "
        "(TIKTOKEN_CACHE_DIR) for the files `tiktoken.get_encoding('gpt2')` downloaded.")
    bpe_sample_bytes: int = _f(
        32 * 2**20, "bpe only: train the tokenizer on at most this many bytes of the train split, spread over its "
        "documents (training, unlike encoding, gains little from more text); the whole split is then encoded.")
    seq_len: int | None = _f(None, "Tokens per training sequence; null uses model.block_size.")
    seq_len_schedule: list[list[int]] = _f(
        [], "Sequence-length schedule as [step, seq_len] pairs, e.g. [[0,256],[1000,512],[3000,1024]] (short sequences "
        "early train faster); starts at step 0; its last length is the run's seq_len. []: data.seq_len throughout.")
    seq_len_keep: SeqLenKeep = _f(
        SeqLenKeep.tokens, "With a schedule: tokens (tokens per step constant: a stage at half the length draws twice "
        "the sequences per micro-batch) or batch (sequences per step constant: fewer tokens per step early).")
    val_fraction: float = _f(0.05, "Share held out for validation: whole documents (several files, JSON lines, stdlib) or a single file's tail.")
    max_bytes: int | None = _f(None, "Read at most this many bytes of the corpus; null reads all.")
    cache_dir: str | None = _f(None, "Where prepared tokens go; null uses $LLMTRAIN_CACHE or ~/.cache/llmtrain.")
    seed: int | None = _f(None, "Seed of the batch sampler; null derives it from the run seed.")
    sampling: Sampling = _f(
        Sampling.random, "random (windows at random offsets) or epoch (each window once per epoch, new order each epoch)."
    )
    shuffle: bool = _f(True, "random sampling: false reads consecutive windows in corpus order (debugging only).")
    overfit_batches: int = _f(0, "Debugging: cycle through the first N micro-batches forever (the overfit check); 0 = off.")


@dataclass
class PrecisionConfig:
    name: Precision = _f(
        Precision.fp32, "fp32, bf16 (autocast), fp16 (autocast + dynamic loss scaling), or auto (bf16/fp16 on CUDA, else fp32)."
    )
    loss_scaling: bool = _f(True, "fp16 only: dynamic loss scaling (GradScaler); off lets small gradients underflow.")
    init_scale: float = _f(2.0**16, "fp16 only: initial loss scale.")
    growth_interval: int = _f(2000, "fp16 only: steps without overflow before the scale doubles.")


@dataclass
class ParallelConfig:
    mode: ParallelMode = _f(ParallelMode.single, "single (one process), ddp (DistributedDataParallel: a full model "
                            "copy per process, gradients averaged; launch with torchrun or parallel.nproc), zero1 (ddp with "
                            "the optimizer state split across the processes: ZeroRedundancyOptimizer) or fsdp (FSDP2: "
                            "parameters, gradients and optimizer state split; fully_shard per block, then the root).")
    nproc: int = _f(1, "ddp: processes to start on this machine (llmtrain starts them: one run dir); leave 1 under "
                    "torchrun, which starts them itself.")


@dataclass
class CheckpointConfig:
    every_steps: int | None = _f(250, "Save a checkpoint every this many optimizer steps; null disables.")
    every_minutes: float | None = _f(30.0, "Also save when this many minutes passed since the last save; null disables.")
    keep_last: int = _f(2, "Keep the newest k checkpoints (older ones are deleted).")
    keep_best: bool = _f(True, "Also keep the checkpoint with the best validation loss.")
    final: bool = _f(True, "Save a checkpoint at the end of the run.")
    on_save_error: SaveErrorPolicy = _f(SaveErrorPolicy.warn, "A failed save (disk full, permissions): warn and go on, or stop.")
    format: CheckpointFormat = _f(
        CheckpointFormat.auto, "full (rank 0 writes whole tensors) or sharded (parallel=fsdp: every rank writes its "
        "shards, torch.distributed.checkpoint); auto: sharded under fsdp. Either resumes in any mode and world size."
    )
    on_nonfinite: NonFinitePolicy = _f(
        NonFinitePolicy.skip, "NaN/Inf loss or gradient: stop, skip the update, or rollback to the last checkpoint."
    )
    max_consecutive_skips: int = _f(3, "skip: after this many non-finite steps in a row, escalate to rollback.")
    rollback_lr_factor: float = _f(1.0, "rollback: multiply the LR by this after each rollback (e.g. 0.5).")
    max_rollbacks: int = _f(2, "rollback: stop (with a checkpoint) when a rollback would exceed this count.")


@dataclass
class MonitorConfig:
    enabled: bool = _f(True, "Watch the run's health (the health bands of docs/monitoring.md) and raise alarms.")
    interval: int = _f(10, "Check every this many optimizer steps (a few host syncs per check).")
    activation_interval: int = _f(100, "Sample block-output activations every this many steps (hooks only then).")
    warmup_checks: int = _f(5, "Checks before the memory-leak trend is watched (allocator warm-up).")
    patience: int = _f(3, "Consecutive checks outside a band before an alarm (grad norm, LR).")
    grad_norm_high: float = _f(100.0, "Alarm when the gradient norm stays above this.")
    grad_norm_low: float = _f(1e-3, "Alarm when the gradient norm stays below this.")
    early_layer_ratio: float = _f(1e-3, "Alarm when the first block's grad norm / the largest block's stays below this.")
    param_jump: float = _f(0.5, "Alarm when the parameter norm changes by more than this fraction between checks.")
    param_decrease: float = _f(0.05, "Alarm when the parameter norm falls by more than this fraction over a trend window.")
    trend_window: int = _f(20, "Checks in a trend window (parameter norm, memory).")
    lr_explode_factor: float = _f(10.0, "Alarm when the applied LR exceeds the schedule's by this factor.")
    activation_mean_max: float = _f(1.0, "Alarm when a block's output mean stays beyond +-this.")
    activation_var_factor: float = _f(10.0, "Alarm when a block's output variance grows or shrinks by this factor.")
    activation_window: int = _f(5, "Activation samples in the variance trend window.")
    activation_patience: int = _f(2, "Consecutive activation samples with a drifting mean before an alarm.")
    memory_leak_mb: float = _f(256.0, "Alarm when memory rises by more than this (MB) over a trend window.")
    spike_z: float = _f(6.0, "Alarm when the loss's robust z-score over the spike window exceeds this.")
    spike_window: int = _f(50, "Checks in the loss-spike window.")
    reduce_lr_factor: float = _f(0.5, "reduce_lr: multiply the LR by this.")
    cooldown_checks: int = _f(10, "reduce_lr: checks before another reduction.")
    actions: dict[str, MonitorAction] = _f(
        {"grad_norm_high": MonitorAction.reduce_lr}, "Action per alarm (warn, reduce_lr, skip_step, rollback, stop); unlisted: warn."
    )


@dataclass
class Config:
    model: ModelConfig = _f(ModelConfig(), "Model shape and initialization.")
    optim: OptimConfig = _f(OptimConfig(), "Optimizer and gradient clipping.")
    schedule: ScheduleConfig = _f(ScheduleConfig(), "Learning-rate schedule.")
    data: DataConfig = _f(DataConfig(), "Training data and its preparation.")
    precision: PrecisionConfig = _f(PrecisionConfig(), "Numeric precision.")
    parallel: ParallelConfig = _f(ParallelConfig(), "Process layout.")
    checkpoint: CheckpointConfig = _f(CheckpointConfig(), "Checkpoint policy, retention and non-finite handling.")
    monitor: MonitorConfig = _f(MonitorConfig(), "Health monitor: bands, windows and actions.")
    tensorboard: bool = _f(False, "Also write every metric as TensorBoard scalars to RUN_DIR/tensorboard (extra: tensorboard).")
    wandb: WandbMode = _f(WandbMode.off, "Weights & Biases: off, offline (files in RUN_DIR/wandb, no network) or online (extra: wandb).")
    wandb_project: str = _f("llmtrain", "W&B project name.")
    resume: str = _f("auto", "auto (newest good checkpoint of the run dir), never, or a checkpoint/run dir path.")
    seed: int | None = _f(1337, "Global seed: model init, dropout and (by default) data order; null draws one (logged).")
    deterministic: bool = _f(False, "Deterministic algorithms only (torch.use_deterministic_algorithms): bitwise repeatable, maybe slower.")
    flush_denormal: bool = _f(
        True, "CPU: flush subnormal floats (< 1.2e-38) to zero; subnormal arithmetic can make steps several times slower."
    )
    compile: CompileMode = _f(CompileMode.off, "torch.compile each block: off, on, or auto (CUDA only; on CPU it costs ~30 s, gains nothing).")
    allow_check_failures: bool = _f(False, "Train even when the pre-flight check (llmtrain check) reports FAIL rows.")
    max_steps: int | None = _f(1000, "Optimizer steps to run (ignored when max_tokens is set).")
    max_tokens: int | None = _f(None, "Train on this many tokens instead; the last step may be partial.")
    micro_batch_size: int | None = _f(
        None, "Sequences per forward/backward pass; null derives it: the largest divisor of global_batch_size / "
        "world size up to 16 (the global batch is kept; set it to have exactly that micro-batch).")
    global_batch_size: int = _f(16, "Sequences per optimizer step; accumulation = global / (micro x world).")
    eval_interval: int = _f(100, "Evaluate every this many steps (and at the end); 0 disables.")
    eval_batches: int = _f(10, "Fixed validation batches per evaluation.")
    log_interval: int = _f(10, "Write metrics.jsonl and the console line every this many steps.")
    timing_interval: int = _f(
        50, "Time the phases (data, forward, backward, optimizer, other) of every this-many-th step for the report; "
        "on CUDA those steps synchronize at each phase. 0 disables."
    )
    report: bool = _f(True, "Write report.md and report.html (the post-run review) into the run dir when train ends.")
    out_dir: str | None = _f(None, "Run directory; null uses Hydra's run dir.")
    device: str = _f("auto", "auto, cpu, cuda, cuda:N or mps.")
    threads: int | None = _f(None, "CPU threads per process; null = usable cores / local processes.")


def _group_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(field_type(f.type)))


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (called by the CLI only).

    One root node: its fields are the groups' dataclasses, so every group option is validated
    against its schema when Hydra merges it into that field.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="llmtrain_schema", node=Config)


# --------------------------------------------------------------------------------------------
# OmegaConf -> dataclasses, with errors a user can act on
# --------------------------------------------------------------------------------------------


def _enum_names(tp: Any) -> list[str] | None:
    return [m.value for m in tp] if isinstance(tp, type) and issubclass(tp, Enum) else None


def schema_fields(schema: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(schema)}


def field_type(tp: Any) -> Any:
    """The concrete type of a field: Optional[X] -> X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return args[0] if is_union and len(args) == 1 else tp


# The config groups: the fields of Config that are sections (one conf/<group>/ folder each).
GROUPS: tuple[str, ...] = _group_names()


# Mappings of the schema whose keys are names from a fixed list (the schema types them only as str).
MAPPING_KEYS: dict[str, tuple[str, ...]] = {"monitor.actions": ALARM_NAMES}


def _mapping_key_message(full_key: str, mapping: str) -> str:
    """An unknown key inside a name-keyed mapping (`monitor.actions.<alarm>`): a typo gets the close
    match and the valid names; a valid name not yet in the mapping needs Hydra's '+' to be added."""
    leaf = full_key[len(mapping) + 1:]
    names = MAPPING_KEYS[mapping]
    adding = f"a name not yet in '{mapping}' is added with '+': '+{mapping}.<name>=...'"
    if leaf in names:
        return (f"Unknown config key '{full_key}': '{leaf}' is a valid name, but '{mapping}' has no entry for it yet, "
                f"and Hydra adds a key only with '+': use '+{full_key}=...'.")
    close = difflib.get_close_matches(leaf, names, n=1)
    hint = f" Did you mean '{mapping}.{close[0]}'?" if close else ""
    return f"Unknown config key '{full_key}'.{hint} Valid names under '{mapping}': {', '.join(names)} ({adding})."


def unknown_name_message(mapping: str, name: str) -> str:
    """A name a mapping such as `monitor.actions` does not know (added with '+key=...')."""
    names = MAPPING_KEYS[mapping]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"'{mapping}' names an unknown alarm '{name}'; valid alarms: {', '.join(names)}.{hint}"


def unknown_key_message(full_key: str) -> str:
    """'Unknown config key' with the valid keys of its parent section and a close match."""
    parent, _, leaf = full_key.rpartition(".")
    if parent in MAPPING_KEYS:
        return _mapping_key_message(full_key, parent)
    found = _schema_for_key(full_key)
    fields = list(schema_fields(found[0])) if found else []
    # `n_layer=4` meant `model.n_layer=4`: an exact key of a group beats a fuzzy top-level match.
    nested = [] if parent else [f"{g}.{leaf}" for g in GROUPS if leaf in schema_fields(field_type(schema_fields(Config)[g].type))]
    close = nested or [f"{parent + '.' if parent else ''}{c}" for c in difflib.get_close_matches(leaf, fields, n=1)]
    hint = f" Did you mean '{close[0]}'?" if close else ""
    where = f"under '{parent}'" if parent else "at the top level"
    valid = f" Valid keys {where}: {', '.join(fields)}." if fields else ""
    return f"Unknown config key '{full_key}'.{hint}{valid}"


def _check_unknown_keys(node: Any, schema: type, prefix: str) -> None:
    """`+key=value` can add keys the schema doesn't know; refuse them by name."""
    from omegaconf import DictConfig, OmegaConf

    fields = schema_fields(schema)
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(unknown_key_message(full))
        sub_schema = field_type(fields[key].type)
        if dataclasses.is_dataclass(sub_schema) and not OmegaConf.is_missing(node, key) and isinstance(node[key], DictConfig):
            _check_unknown_keys(node[key], sub_schema, f"{full}.")


def describe_omegaconf_error(err: Exception) -> str:
    """Turn an OmegaConf/Hydra error into one paragraph naming the key and what is valid."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, ValidationError

    key = getattr(err, "full_key", None) or ""
    msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    if isinstance(err, MissingMandatoryValue):
        return f"Missing required value '{key}': set it on the command line, e.g. {key}=<value>."
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key:
        return unknown_key_message(key)
    if isinstance(err, ValidationError):
        described = _value_type_message(key, getattr(err, "value", None), _key_type(key))
        return described or f"Bad value{f' for {key!r}' if key else ''}: {msg.rstrip('.')}."
    return msg


def _key_type(full_key: str) -> tuple[Any, bool, Any] | None:
    """(concrete type, accepts null, schema default) of a scalar key, including a mapping's values
    (`monitor.actions.<alarm>`); None for keys it cannot place (list items, unknown keys)."""
    parent, _, leaf = full_key.rpartition(".")
    if parent in MAPPING_KEYS:
        found = _schema_for_key(parent)
        if found is None:
            return None
        value_type = typing.get_args(schema_fields(found[0])[found[1]].type)[-1]
        return value_type, False, None
    found = _schema_for_key(full_key)
    fld = schema_fields(found[0]).get(found[1]) if found else None
    if fld is None:
        return None
    optional = type(None) in typing.get_args(fld.type)
    default = fld.default if fld.default is not dataclasses.MISSING else None
    return field_type(fld.type), optional, default.value if isinstance(default, Enum) else default


def _shown(value: Any) -> str:
    """A value as the user wrote it: strings quoted, YAML's spelling for booleans and null."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return f"'{value}'" if isinstance(value, str) else str(value)


def _value_type_message(key: str, value: Any, typed: tuple[Any, bool, Any] | None) -> str | None:
    """'<key>' is <the value seen>; what this key takes (the valid names of an enum, with a close
    match), with an example. None where the key's type is not a scalar this knows how to explain."""
    if key.endswith("]"):  # an item of a list, `data.seq_len_schedule[0]`: say it of the list
        base, _, index = key[:-1].partition("[")
        typed = _key_type(base)
        if typed is None or typing.get_origin(typed[0]) is not list:
            return None
        return (f"'{base}' has {_shown(value)} at index {index}; expected a list in brackets, of "
                f"{_list_items(typed[0])}, e.g. {base}={_LIST_EXAMPLES.get(base, '[]')}.")
    if typed is None:
        return None
    tp, optional, default = typed
    seen = f"'{key}' is {_shown(value)}"
    or_null = " or null" if optional else ""
    example = f", e.g. {key}={_shown(default).strip(chr(39))}" if default is not None else ""
    names = _enum_names(tp)
    if names:
        close = difflib.get_close_matches(str(value), names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"{seen}; valid: {', '.join(names)}{or_null}.{hint}"
    if tp is bool:
        return f"{seen}; expected a boolean: true or false{or_null}."
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            # `max_steps=1e3` parses as the float 1000.0, which an integer key refuses
            return (f"{seen}, a float (written with a decimal point or an exponent); expected an integer{or_null}: "
                    f"write it as {key}={int(value)}.")
        return f"{seen}; expected an integer (a whole number){or_null}{example}."
    if tp is float:
        return f"{seen}; expected a number (e.g. 0.5 or 3e-4){or_null}{example}."
    if tp is str:
        return f"{seen}; expected a string (a single value, not a list or mapping){or_null}{example}."
    if typing.get_origin(tp) is list:
        return f"{seen}; expected a list in brackets, of {_list_items(tp)}{or_null}, e.g. {key}={_LIST_EXAMPLES.get(key, '[]')}."
    if typing.get_origin(tp) is dict:
        return f"{seen}; expected a mapping of names to values; set one entry at a time: '+{key}.<name>=<value>'."
    return None


_LIST_EXAMPLES = {"data.seq_len_schedule": "[[0,128],[1000,256]]"}


def _list_items(tp: Any) -> str:
    """What the items of a list type are, in words: `list[list[int]]` -> 'lists of integers'."""
    return "lists of integers" if typing.get_origin(typing.get_args(tp)[0]) is list else "integers"


def _schema_for_key(full_key: str) -> tuple[type, str] | None:
    parts = full_key.split(".")
    schema: type = Config
    for part in parts[:-1]:
        fld = schema_fields(schema).get(part)
        sub = field_type(fld.type) if fld else None
        if not (isinstance(sub, type) and dataclasses.is_dataclass(sub)):
            return None
        schema = sub
    return schema, parts[-1]


def to_config(node: Any) -> Config:
    """Convert a composed OmegaConf node into a validated `Config`; raises `ConfigError`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        _check_unknown_keys(node, Config, "")
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), node))
    except OmegaConfBaseException as err:
        raise ConfigError(describe_omegaconf_error(err)) from None
    assert isinstance(cfg, Config)
    validate(cfg)
    return cfg


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Cross-field checks: contradictions no single field's type can catch."""
    m, o, s, d = cfg.model, cfg.optim, cfg.schedule, cfg.data
    for key, value in [
        ("model.n_layer", m.n_layer), ("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
        ("model.block_size", m.block_size), ("micro_batch_size", cfg.micro_batch_size),
        ("global_batch_size", cfg.global_batch_size), ("eval_batches", cfg.eval_batches),
        ("log_interval", cfg.log_interval),
    ]:
        # micro_batch_size may still be null here: it is derived below, once the world size is known
        _require(value is None or value >= 1, f"'{key}' is {value}; it must be a positive integer.")
    _require(cfg.eval_interval >= 0, f"'eval_interval' is {cfg.eval_interval}; use a step count >= 1, or 0 to disable evaluation.")
    _require(cfg.timing_interval >= 0,
             f"'timing_interval' is {cfg.timing_interval}; use a step count >= 1, or 0 to time no step.")
    _validate_parallel(cfg)
    world_size = world_size or world_size_of(cfg)
    resolve_micro_batch_size(cfg, world_size)
    if m.n_embd % m.n_head:
        raise ConfigError(
            f"'model.n_embd' ({m.n_embd}) is not divisible by 'model.n_head' ({m.n_head}); "
            f"pick a head count that divides the width, e.g. model.n_head={_divisor_near(m.n_embd, m.n_head)}."
        )
    if m.position is PositionEncoding.rope:
        _require(
            (m.n_embd // m.n_head) % 2 == 0,
            f"RoPE needs an even head dimension; n_embd/n_head = {m.n_embd // m.n_head}.",
        )
    _require(0.0 <= m.dropout < 1.0, f"'model.dropout' is {m.dropout}; valid range is 0 <= dropout < 1.")
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
        m.mlp_ratio > 0 and int(m.mlp_ratio * m.n_embd) >= 1,
        f"'model.mlp_ratio' is {m.mlp_ratio}; the MLP needs a positive width (typical: 4.0).",
    )
    _require(m.init_std > 0, f"'model.init_std' is {m.init_std}; it must be > 0.")
    _require(m.vocab_size is None or m.vocab_size >= 1, f"'model.vocab_size' is {m.vocab_size}; use a positive size or null.")
    _require(m.vocab_multiple >= 1, f"'model.vocab_multiple' is {m.vocab_multiple}; use 1 (no padding) or a "
             "positive multiple, e.g. 64.")
    _require(
        o.lr is None or (o.lr > 0 and math.isfinite(o.lr)),
        f"'optim.lr' is {o.lr}; the learning rate must be a finite number > 0 (typical AdamW values: 1e-4 to 3e-3), "
        "or null for the default of this optimizer and model width.",
    )
    resolve_lr(cfg)
    _require(0 <= o.momentum < 1, f"'optim.momentum' is {o.momentum}; valid range is [0, 1) (typical: 0.9).")
    _require(o.weight_decay >= 0, f"'optim.weight_decay' is {o.weight_decay}; it must be >= 0.")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, f"'optim.beta1'/'optim.beta2' are {o.beta1}/{o.beta2}; both must be in [0, 1).")
    _require(o.eps > 0, f"'optim.eps' is {o.eps}; it must be > 0.")
    _require(
        not (o.clip_grad_norm is not None and o.clip_grad_value is not None),
        f"Both 'optim.clip_grad_norm' ({o.clip_grad_norm}) and 'optim.clip_grad_value' ({o.clip_grad_value}) "
        "are set; choose one, e.g. optim.clip_grad_value=null.",
    )
    for key, value in [("optim.clip_grad_norm", o.clip_grad_norm), ("optim.clip_grad_value", o.clip_grad_value)]:
        _require(value is None or value > 0, f"'{key}' is {value}; use a positive threshold or null to disable.")
    _require(0 <= s.min_lr_ratio <= 1, f"'schedule.min_lr_ratio' is {s.min_lr_ratio}; valid range is [0, 1].")
    _require(0 <= s.warmup_fraction < 1, f"'schedule.warmup_fraction' is {s.warmup_fraction}; valid range is [0, 1).")
    _require(0 < s.decay_fraction <= 1, f"'schedule.decay_fraction' is {s.decay_fraction}; valid range is (0, 1].")
    if s.lr_scaling is not LRScaling.none:
        _require(
            s.reference_batch_size is not None and s.reference_batch_size >= 1,
            f"schedule.lr_scaling={s.lr_scaling.value} needs 'schedule.reference_batch_size', the global batch "
            f"(in sequences) optim.lr was tuned for, e.g. schedule.reference_batch_size={cfg.global_batch_size}.",
        )
    _require(s.warmup_steps is None or s.warmup_steps >= 0, f"'schedule.warmup_steps' is {s.warmup_steps}; it must be >= 0.")

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
    _validate_seq_len_schedule(cfg, total_steps(cfg, world_size))
    seq_len = seq_len_of(cfg)
    _require(seq_len >= 1, f"'data.seq_len' is {seq_len}; it must be >= 1.")
    _require(
        seq_len <= m.block_size,
        f"'data.seq_len' ({seq_len}) is longer than the model's context 'model.block_size' ({m.block_size}); "
        f"use data.seq_len<={m.block_size} or raise model.block_size.",
    )
    _require(0 < d.val_fraction < 1, f"'data.val_fraction' is {d.val_fraction}; valid range is (0, 1).")
    _require(d.overfit_batches >= 0, f"'data.overfit_batches' is {d.overfit_batches}; use 0 (off) or a batch count >= 1.")
    _require(d.max_bytes is None or d.max_bytes > 0, f"'data.max_bytes' is {d.max_bytes}; use a positive size or null.")
    _require(0 <= o.label_smoothing < 1, f"'optim.label_smoothing' is {o.label_smoothing}; valid range is [0, 1) (typical: 0.1).")
    _require(d.source is not DataSource.hf or bool(d.hf_name),
             "Missing required value 'data.hf_name': data=hf needs a dataset, e.g. data.hf_name=roneneldan/TinyStories, "
             "a folder written by save_to_disk, or data.hf_name=json data.path=docs.jsonl.")
    if d.source in (DataSource.text, DataSource.jsonl, DataSource.instruct):
        _require(
            d.path is not None,
            f"Missing required value 'data.path': data={d.source.value} needs your files, e.g. "
            f"data.path={'corpus/' if d.source is DataSource.text else 'docs.jsonl'}.",
        )
    _require(d.tokenizer is not TokenizerKind.bpe or d.bpe_sample_bytes >= 2**16, f"'data.bpe_sample_bytes' is {d.bpe_sample_bytes}; give at least 65536 "
             "(64 KiB of text to learn merges from; the default is 33554432, 32 MiB).")
    _require(d.bpe_vocab_size >= 257, f"'data.bpe_vocab_size' is {d.bpe_vocab_size}; it must be >= 257 (256 bytes + end-of-text).")
    _require(d.text_field.strip() != "", "'data.text_field' is empty; name the JSON field that holds the text, e.g. text.")
    total = total_steps(cfg, world_size)
    warmup = resolved_warmup_steps(cfg.schedule, total)
    source = (
        f"schedule.warmup_steps={s.warmup_steps}" if s.warmup_steps is not None
        else f"schedule.warmup_fraction={s.warmup_fraction} of {total} steps"
    )
    _require(
        warmup < total or total == 1 and warmup <= 1,
        f"Warmup ({warmup} steps, from {source}) is not shorter than the run ({total} steps); "
        f"use schedule.warmup_steps<{total}, typically 1-10% of the run (e.g. schedule.warmup_steps={max(1, total // 20)}).",
    )
    _require(
        re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", cfg.device) is not None,
        f"'device' is '{cfg.device}'; valid: auto, cpu, cuda, cuda:N, mps.",
    )
    for key, seed in (("seed", cfg.seed), ("data.seed", d.seed)):
        _require(seed is None or 0 <= seed < 2**32, f"'{key}' is {seed}; seeds must be in [0, 2**32).")
    p = cfg.precision
    _require(p.init_scale > 0 and math.isfinite(p.init_scale), f"'precision.init_scale' is {p.init_scale}; it must be a finite number > 0.")
    _require(p.growth_interval >= 1, f"'precision.growth_interval' is {p.growth_interval}; it must be >= 1.")
    c = cfg.checkpoint
    _require(c.every_steps is None or c.every_steps >= 1, f"'checkpoint.every_steps' is {c.every_steps}; use a step count >= 1 or null.")
    _require(
        c.every_minutes is None or c.every_minutes > 0,
        f"'checkpoint.every_minutes' is {c.every_minutes}; use minutes > 0 or null.",
    )
    _require(c.keep_last >= 1, f"'checkpoint.keep_last' is {c.keep_last}; keep at least 1 checkpoint.")
    _require(c.max_consecutive_skips >= 1, f"'checkpoint.max_consecutive_skips' is {c.max_consecutive_skips}; it must be >= 1.")
    _require(0 < c.rollback_lr_factor <= 1, f"'checkpoint.rollback_lr_factor' is {c.rollback_lr_factor}; valid range is (0, 1].")
    _require(c.max_rollbacks >= 0, f"'checkpoint.max_rollbacks' is {c.max_rollbacks}; it must be >= 0.")
    mon = cfg.monitor
    for key in ("interval", "activation_interval", "patience", "trend_window", "activation_window",
                "activation_patience", "spike_window", "cooldown_checks"):
        _require(getattr(mon, key) >= 1, f"'monitor.{key}' is {getattr(mon, key)}; it must be >= 1.")
    _require(mon.trend_window >= 3, f"'monitor.trend_window' is {mon.trend_window}; a trend needs >= 3 checks.")
    _require(0 < mon.reduce_lr_factor < 1, f"'monitor.reduce_lr_factor' is {mon.reduce_lr_factor}; valid range is (0, 1).")
    for name in mon.actions:
        _require(name in ALARM_NAMES, unknown_name_message("monitor.actions", name))
    if cfg.tensorboard:
        import importlib.util

        _require(
            importlib.util.find_spec("tensorboard") is not None,
            "tensorboard=true, but the tensorboard package is not installed; pip install 'llmtrain[tensorboard]' "
            "(or pip install tensorboard), or set tensorboard=false.",
        )
    if cfg.wandb is not WandbMode.off:
        import importlib.util

        _require(
            importlib.util.find_spec("wandb") is not None,
            f"wandb={cfg.wandb.value}, but the wandb package is not installed; pip install 'llmtrain[wandb]' "
            "(or pip install wandb), or set wandb=off.",
        )
    _require(cfg.resume.strip() != "", "'resume' is empty; use auto, never, or the path of a checkpoint or run dir.")
    _require(cfg.threads is None or cfg.threads >= 1, f"'threads' is {cfg.threads}; use a positive count or null.")


def _validate_parallel(cfg: Config) -> None:
    p = cfg.parallel
    _require(p.nproc >= 1, f"'parallel.nproc' is {p.nproc}; it must be >= 1.")
    launched = int(os.environ.get("WORLD_SIZE") or 1)
    _require(p.mode is not ParallelMode.single or (p.nproc == 1 and launched == 1),
             f"parallel.mode is single but {'parallel.nproc is ' + str(p.nproc) if p.nproc > 1 else f'torchrun started {launched} processes'}; "
             "add parallel=ddp (or parallel=zero1 or parallel=fsdp) to train one model across them.")
    _require(cfg.checkpoint.format is not CheckpointFormat.sharded or p.mode is ParallelMode.fsdp,
             f"checkpoint.format is sharded but parallel.mode is {p.mode.value}: only parallel=fsdp shards the model "
             "and optimizer across the ranks; use checkpoint.format=full or auto (sharded files under fsdp).")
    _require(launched == 1 or p.nproc in (1, launched),  # == launched: the ranks parallel.nproc started
             f"torchrun started {launched} processes and parallel.nproc is {p.nproc}: under torchrun leave "
             "parallel.nproc=1 (torchrun's --nproc_per_node sets the count).")


def _validate_seq_len_schedule(cfg: Config, total: int) -> None:
    d = cfg.data
    if not d.seq_len_schedule:
        return
    where = f"'data.seq_len_schedule' is {[list(p) for p in d.seq_len_schedule]}"
    _require(all(len(pair) == 2 for pair in d.seq_len_schedule),
             f"{where}; give [step, seq_len] pairs, e.g. [[0,256],[1000,512],[3000,1024]].")
    schedule = seq_len_schedule(cfg)
    _require(len(schedule) == len(d.seq_len_schedule), f"{where}; each step may start one stage only.")
    _require(0 in schedule, f"{where}; it must say the length at step 0, e.g. [[0,{min(schedule.values())}],...].")
    _require(all(step >= 0 for step in schedule), f"{where}; steps must be >= 0.")
    for length in schedule.values():
        _require(1 <= length <= cfg.model.block_size,
                 f"{where}; every length must be in 1..model.block_size ({cfg.model.block_size}), not {length}.")
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


def _divisor_near(n: int, k: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - k))


def seq_len_schedule(cfg: Config) -> dict[int, int]:
    """data.seq_len_schedule as {start step: length}, in step order ({} without a schedule)."""
    return dict(sorted((int(pair[0]), int(pair[1])) for pair in cfg.data.seq_len_schedule if len(pair) == 2))


def seq_len_of(cfg: Config) -> int:
    """The run's sequence length: the schedule's last, else data.seq_len, else the model's context."""
    if schedule := seq_len_schedule(cfg):
        return list(schedule.values())[-1]
    return cfg.data.seq_len if cfg.data.seq_len is not None else cfg.model.block_size


@dataclass(frozen=True)
class SeqLenStage:
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
    return [stage for stage in stages if stage.start_step <= step][-1]


def world_size_of(cfg: Config) -> int:
    """Processes in the run: torchrun's WORLD_SIZE when it launched us, else parallel.nproc for ddp."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return cfg.parallel.nproc if cfg.parallel.mode is not ParallelMode.single else 1


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
    _require(
        cfg.global_batch_size % world_size == 0,
        f"'global_batch_size' ({cfg.global_batch_size}) is not divisible by the world size ({world_size} processes), "
        f"so the processes cannot share it evenly; valid global batch sizes are multiples of {world_size}, e.g. "
        f"global_batch_size={max(world_size, cfg.global_batch_size // world_size * world_size)}.",
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
    return derived_micro_batch_size(cfg.global_batch_size, world_size or world_size_of(cfg))


def micro_batch_size_derived(cfg: Config) -> bool:
    """Whether `cfg.micro_batch_size` is the derived value (null in the config); a value assigned
    after validation is explicit, as one from the command line is."""
    derived = getattr(cfg, _MICRO_DERIVED, None)
    return derived is not None and derived == cfg.micro_batch_size


def accumulation_steps(cfg: Config, world_size: int | None = None) -> int:
    world_size = world_size or world_size_of(cfg)
    return cfg.global_batch_size // (micro_batch_size_of(cfg, world_size) * world_size)


def total_micro_batches(cfg: Config, world_size: int | None = None) -> int:
    """Micro-batches per process over the whole run; a max_tokens budget may end mid-window."""
    world_size = world_size or world_size_of(cfg)
    if cfg.max_tokens is not None:
        per_micro = micro_batch_size_of(cfg, world_size) * world_size * seq_len_of(cfg)
        return -(-cfg.max_tokens // per_micro)
    assert cfg.max_steps is not None
    return cfg.max_steps * accumulation_steps(cfg, world_size)


def total_steps(cfg: Config, world_size: int | None = None) -> int:
    world_size = world_size or world_size_of(cfg)
    accum = accumulation_steps(cfg, world_size)
    return -(-total_micro_batches(cfg, world_size) // accum) if accum else 0


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
    cfg.optim.lr = default_lr(cfg.optim.name, cfg.model.n_embd)
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
    return (
        f"'model.vocab_size' ({cfg.model.vocab_size}) is smaller than the data's vocabulary ({data_vocab} tokens, "
        f"{cfg.data.tokenizer.value} tokenizer); use model.vocab_size>={data_vocab} or model.vocab_size=null."
    )


def effective_lr(cfg: Config) -> float:
    """The peak LR the run uses: optim.lr, scaled with the global batch when schedule.lr_scaling asks
    (seed 003 §3: linear, batch xk -> lr xk; sqrt, lr x sqrt(k))."""
    s = cfg.schedule
    lr = cfg.optim.lr if cfg.optim.lr is not None else default_lr(cfg.optim.name, cfg.model.n_embd)
    if s.lr_scaling is LRScaling.none or s.reference_batch_size is None:
        return lr
    ratio = cfg.global_batch_size / s.reference_batch_size
    return lr * (ratio if s.lr_scaling is LRScaling.linear else math.sqrt(ratio))


def resolved_warmup_steps(schedule: ScheduleConfig, total: int) -> int:
    if schedule.warmup_steps is not None:
        return schedule.warmup_steps
    return int(round(schedule.warmup_fraction * total))


def config_to_dict(cfg: Any) -> Any:
    """Plain-Python view of a config (enums as their values), e.g. to write it as YAML."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Enum):
        return cfg.value
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


def model_config_from_dict(data: dict) -> ModelConfig:
    """Rebuild (and type-check) a `ModelConfig`, e.g. from an export's model_config.json."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), data))
    except OmegaConfBaseException as err:
        raise ConfigError(describe_omegaconf_error(err)) from None


def config_from_dict(data: dict) -> Config:
    """Rebuild a `Config` from `config_to_dict` output (e.g. a run dir's config.yaml)."""
    from omegaconf import OmegaConf

    return to_config(OmegaConf.create(data))
