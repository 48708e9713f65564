"""The typed configuration: one dataclass per config group, each field with its doc, the enums of
its choices, `config_to_dict` (the plain view written to config.yaml) and the schema's own
introspection (the groups, the fields of a section, the name-keyed mappings). No torch, no Hydra:
this is what every other module reads."""

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from llmtrain.config.finetune import FinetuneConfig, FinetuneMethod  # noqa: F401 - part of the schema


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


class ActivationCheckpointing(str, Enum):
    none = "none"  # every block keeps what autograd saves
    full = "full"  # a checkpointed block keeps only its input and is recomputed whole in backward
    op = "op"  # a checkpointed block also keeps its matmul and attention outputs; the elementwise ops are recomputed


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
    adamw8bit = "adamw8bit"  # torchao's AdamW8bit: moments in 8 bits (the `ao` extra)
    adamw4bit = "adamw4bit"  # torchao's AdamW4bit: moments in 4 bits (the `ao` extra)


# AdamW with its moments quantized block-wise by torchao: AdamW (decoupled weight decay, betas, eps)
# in every respect but the state's bytes.
LOW_BIT_OPTIMIZERS = (OptimizerName.adamw8bit, OptimizerName.adamw4bit)
# The optimizers with Adam's moments: betas and eps apply, the LR defaults follow the width.
ADAM_FAMILY = (OptimizerName.adamw, OptimizerName.adam, *LOW_BIT_OPTIMIZERS)


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
    pretrained = "pretrained"


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
    "grad_norm_surge", "update_ratio_high", "update_ratio_low", "loss_above_chance", "loss_rising",
    "loss_not_decreasing", "schedule_ended", "activation_variance_high", "loss_oscillating", "weight_decay_dominant",
    "overfitting", "loss_autocorrelated", "steps_too_small",
)


class WandbMode(str, Enum):
    off = "off"
    offline = "offline"
    online = "online"


class ReportConsole(str, Enum):
    auto = "auto"  # short for a run under REPORT_FULL_AFTER_S of wall time, full otherwise
    short = "short"
    full = "full"


@dataclass
class ModelConfig:
    name: str = _f("gpt_tiny", "Label of this model shape, shown in the banner.")
    n_layer: int = _f(4, "Number of transformer blocks.")
    n_head: int = _f(4, "Attention heads per block; must divide n_embd.")
    n_kv_head: int | None = _f(
        None, "Key/value heads (grouped-query attention: each serves n_head / n_kv_head query heads); must divide "
        "n_head; null = n_head (plain multi-head attention).")
    n_embd: int = _f(128, "Width of the residual stream.")
    block_size: int = _f(256, "Context length: the longest sequence the model accepts.")
    sliding_window: int | None = _f(
        None, "Sliding-window attention: each token attends to itself and the sliding_window - 1 tokens before it "
        "(Mistral's window); null: full causal attention over the whole context.")
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
    intermediate_size: int | None = _f(
        None, "MLP hidden width in units; overrides mlp_ratio (and swiglu's 2/3 rule); null: from mlp_ratio.")
    rope_theta: float = _f(10000.0, "position=rope: the base of the rotation frequencies (longer contexts use larger).")
    norm_eps: float | None = _f(None, "Epsilon of every norm layer; null: 1e-5 for layernorm, 1e-6 for rmsnorm.")
    activation_checkpointing: ActivationCheckpointing = _f(
        ActivationCheckpointing.none, "Recompute blocks in backward to save memory: none; full (a block keeps only its "
        "input, the whole block is recomputed: least memory, about a third more compute); op (a block keeps its "
        "matmul and attention outputs, the elementwise ops are recomputed: saves less, costs less than full).")
    checkpoint_every: int = _f(
        1, "activation_checkpointing=full|op: checkpoint the blocks whose index (from 0) is a multiple of this: 1 "
        "every block, 2 every other one (blocks 0, 2, 4, ...), trading memory for compute in between.")
    init: str = _f("normal_0.02", "Weight init: normal_0.02, xavier or kaiming.")
    init_std: float = _f(0.02, "Standard deviation of the normal init.")
    residual_init: ResidualInit = _f(
        ResidualInit.scaled,
        "Residual output projections: scaled (std/sqrt(2*n_layer)), zero, or plain.",
    )
    head_init: HeadInit = _f(HeadInit.plain, "LM head when untied: plain, zero, or tiny (std 1e-4).")
    init_from: str | None = _f(
        None, "A local Hugging Face model folder (config.json, safetensors weights, tokenizer.json; GPT-2 or "
        "Llama-family): the model takes its shape, weights and tokenizer, then trains as usual. Keys left at their "
        "defaults take the folder's values; others must agree with it. Never downloads.")


@dataclass
class OptimConfig:
    name: OptimizerName = _f(
        OptimizerName.adamw, "adamw, adam, sgd, adafactor, or adamw8bit / adamw4bit (AdamW with 8-/4-bit moments "
        "from torchao: pip install 'llmtrain[ao]').")
    lr: float | None = _f(
        None, "Peak learning rate (after warmup); null takes the default for this optimizer and model width "
        "(adam/adamw/adamw8bit/adamw4bit: 3e-3 x min(1, 128 / n_embd), sgd 0.1, adafactor 1e-2).")
    weight_decay: float = _f(
        0.1, "Weight decay on matrices, never on biases or norms (decoupled for adamw, adamw8bit and adamw4bit; L2 "
        "for adam/sgd).")
    decay_embeddings: bool = _f(True, "Apply weight decay to embedding tables too (and to a head tied to them).")
    beta1: float = _f(0.9, "Adam beta1, first-moment decay (adam, adamw, adamw8bit, adamw4bit).")
    beta2: float = _f(0.95, "Adam beta2, second-moment decay (adam, adamw, adamw8bit, adamw4bit).")
    eps: float = _f(1e-8, "Adam epsilon (adam, adamw, adamw8bit, adamw4bit).")
    momentum: float = _f(0.9, "SGD momentum.")
    nesterov: bool = _f(False, "SGD Nesterov momentum.")
    fused: bool | None = _f(None, "Fused kernel (adam, adamw); null uses it where torch supports it. adamw8bit/4bit "
                            "compile their own step: null or false.")
    clip_grad_norm: float | None = _f(1.0, "Clip the global gradient norm to this; null disables.")
    clip_grad_value: float | None = _f(None, "Clip each gradient element to +-value; excludes clip_grad_norm.")
    label_smoothing: float = _f(
        0.0, "Label smoothing of the training loss (0 = off; evaluation always reports the plain loss).")


@dataclass
class ScheduleConfig:
    name: ScheduleName = _f(ScheduleName.cosine, "cosine, linear, constant or wsd (warmup-stable-decay).")
    total_steps: int | None = _f(
        None, "The schedule's length in optimizer steps; null: the run's length. A shorter schedule holds its final "
        "LR (the floor) for the rest of the run; a longer one is cut off mid-decay when the run ends.")
    warmup_steps: int | None = _f(None, "Linear warmup length in steps; overrides warmup_fraction.")
    warmup_fraction: float = _f(0.05, "Warmup length as a fraction of the schedule (used when warmup_steps is null).")
    min_lr_ratio: float = _f(0.1, "Floor of the decay as a fraction of the peak LR.")
    decay_fraction: float = _f(0.2, "wsd only: fraction of the schedule spent in the final decay.")
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
    messages_field: str = _f(
        "messages", "instruct: the field with chat messages [{role, content}]; only assistant turns train.")
    decode_errors: DecodeErrors = _f(
        DecodeErrors.replace, "Bytes that are not UTF-8: replace them (U+FFFD) or skip the documents that have them."
    )
    tokenizer: TokenizerKind = _f(
        TokenizerKind.byte, "byte (vocab 256), char (vocabulary from the corpus), bpe (byte-level BPE trained on it), "
        "gpt2 (GPT-2's BPE through tiktoken, vocab 50257; its files must be on this machine, see data.gpt2_dir) or "
        "pretrained (the tokenizer.json of a Hugging Face model folder, data.tokenizer_dir; model.init_from sets both)."
    )
    tokenizer_dir: str | None = _f(
        None, "pretrained only: a local Hugging Face model folder holding tokenizer.json (its config.json or "
        "tokenizer_config.json names the end-of-text token); model.init_from sets it to its folder.")
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
    val_fraction: float = _f(
        0.05, "Share held out for validation: whole documents (several files, JSON lines, stdlib) or a single "
        "file's tail.")
    max_bytes: int | None = _f(None, "Read at most this many bytes of the corpus; null reads all.")
    cache_dir: str | None = _f(None, "Where prepared tokens go; null uses $LLMTRAIN_CACHE or ~/.cache/llmtrain.")
    seed: int | None = _f(None, "Seed of the batch sampler; null derives it from the run seed.")
    sampling: Sampling = _f(
        Sampling.random, "random (windows at random offsets) or epoch (each window once per epoch, new order "
        "each epoch)."
    )
    shuffle: bool = _f(True, "random sampling: false reads consecutive windows in corpus order (debugging only).")
    overfit_batches: int = _f(
        0, "Debugging: cycle through the first N micro-batches forever (the overfit check); 0 = off.")


@dataclass
class PrecisionConfig:
    name: Precision = _f(
        Precision.fp32, "fp32, bf16 (autocast), fp16 (autocast + dynamic loss scaling), or auto (bf16/fp16 on "
        "CUDA, else fp32)."
    )
    loss_scaling: bool = _f(True, "fp16 only: dynamic loss scaling (GradScaler); off lets small gradients underflow.")
    init_scale: float = _f(2.0**16, "fp16 only: initial loss scale.")
    growth_interval: int = _f(2000, "fp16 only: steps without overflow before the scale doubles.")


@dataclass
class ParallelConfig:
    """How the processes share the work: degrees of one device mesh (pipeline stages x data parallel
    replicated x data parallel sharded x tensor parallel) whose product is the number of processes.
    The presets (parallel=single|ddp|zero1|fsdp|hsdp|tp|fsdp_tp|pp|fsdp_pp) set them; -1 on one data-parallel
    degree takes the processes the others leave."""

    nproc: int = _f(1, "Processes to start on this machine (llmtrain starts them: one run dir); leave 1 under "
                    "torchrun, which starts them itself.")
    dp_replicate: int = _f(
        1, "Data-parallel replicas: each holds the whole model (DDP) or, with dp_shard > 1, one sharded copy "
        "(HSDP); gradients are averaged across them. -1: the processes the other degrees leave.")
    dp_shard: int = _f(
        1, "Data-parallel shards: parameters, gradients and optimizer state split across this many processes "
        "(FSDP2, each block gathered only for its own compute). -1: the processes the other degrees leave.")
    tp: int = _f(1, "Tensor-parallel degree: each block's attention heads and MLP columns (and the embedding and head "
        "over the vocabulary) split across this many processes, which read the same batch.")
    zero1: bool = _f(
        False, "ZeRO-1: with replicas only (dp_replicate > 1, nothing sharded), split the optimizer state across "
        "them (ZeroRedundancyOptimizer); each updates its share and broadcasts it.")
    sequence_parallel: bool = _f(
        False, "tp > 1: also split the norms' and residual activations along the sequence across the "
        "tensor-parallel processes (less activation memory, same numbers).")
    pp: int = _f(1, "Pipeline-parallel degree: the model's layers split into this many stages, one per process (two "
        "under interleaved_1f1b), the window's micro-batches flowing through them; with dp_shard > 1 each stage is "
        "FSDP2-sharded over the data-parallel processes.")
    pp_schedule: str = _f(
        "1f1b", "pp > 1: the pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward, one "
        "backward: fewer activations held) or interleaved_1f1b (two stages per process: a smaller bubble).")
    pp_microbatches: int | None = _f(
        None, "pp > 1: micro-batches per optimizer step (at least pp; more shrinks the pipeline's idle bubble); "
        "sets micro_batch_size to each data-parallel rank's batch / this. null: the accumulation steps.")


@dataclass
class CheckpointConfig:
    every_steps: int | None = _f(250, "Save a checkpoint every this many optimizer steps; null disables.")
    every_minutes: float | None = _f(
        30.0, "Also save when this many minutes passed since the last save; null disables.")
    keep_last: int = _f(2, "Keep the newest k checkpoints (older ones are deleted).")
    keep_best: bool = _f(True, "Also keep the checkpoint with the best validation loss.")
    final: bool = _f(True, "Save a checkpoint at the end of the run.")
    on_save_error: SaveErrorPolicy = _f(
        SaveErrorPolicy.warn, "A failed save (disk full, permissions): warn and go on, or stop.")
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
    activation_interval: int = _f(20, "Sample block-output activations every this many steps (hooks only then); "
                                  "a run too short for 5 samples that way samples denser, at most every check.")
    warmup_checks: int = _f(5, "Checks before the memory-leak trend is watched (allocator warm-up).")
    patience: int = _f(3, "Consecutive checks outside a band before an alarm (grad norm, LR).")
    grad_norm_high: float = _f(100.0, "Alarm when the gradient norm stays above this.")
    grad_norm_low: float = _f(1e-3, "Alarm when the gradient norm stays below this.")
    early_layer_ratio: float = _f(
        1e-3, "Alarm when a block's grad norm / the largest block's stays below this (frozen blocks).")
    param_jump: float = _f(0.5, "Alarm when the parameter norm changes by more than this fraction between checks.")
    param_decrease: float = _f(
        0.05, "Alarm when the parameter norm falls by more than this fraction over a trend window.")
    trend_window: int = _f(20, "Checks in a trend window (parameter norm, memory).")
    lr_explode_factor: float = _f(10.0, "Alarm when the applied LR exceeds the schedule's by this factor.")
    activation_mean_max: float = _f(1.0, "Alarm when a block's output mean stays beyond +-this.")
    activation_mean_share: float = _f(0.25, "... and beyond this share of the block output's standard deviation.")
    activation_var_max: float = _f(
        1e4, "Alarm when a block's output variance stays above this (a deep pre-LN residual stream runs in the "
        "thousands).")
    activation_var_factor: float = _f(10.0, "Alarm when a block's output variance grows or shrinks by this factor.")
    activation_var_floor: float = _f(
        1.0, "... growing only once it is above this: a fresh model's small signals growing to unit scale is learning.")
    activation_window: int = _f(5, "Activation samples in the variance trend window.")
    activation_patience: int = _f(2, "Consecutive activation samples out of band (mean, level, trend) before an alarm.")
    memory_leak_mb: float = _f(256.0, "Alarm when memory rises by more than this (MB) over a trend window.")
    spike_z: float = _f(6.0, "Alarm when the loss's robust z-score over the spike window exceeds this.")
    spike_window: int = _f(50, "Checks in the loss-spike window.")
    grad_surge_factor: float = _f(10.0, "Alarm when the gradient norm jumps above this many times its recent median.")
    # Healthy runs hold at most 0.02 for 3 checks (45 recipes); LRs 10-100x too high hold 0.05-0.09.
    update_ratio_high: float = _f(0.05, "Alarm when the update / weight norm ratio of a step stays above this.")
    update_ratio_low: float = _f(1e-5, "Alarm when the update / weight norm ratio of a step stays below this.")
    loss_chance_factor: float = _f(1.5, "Alarm when the loss exceeds this many times a uniform guess (ln vocabulary).")
    loss_rise: float = _f(0.05, "Alarm when the loss stays this fraction above its best so far (and loss_rise_min).")
    loss_rise_min: float = _f(0.15, "The smallest rise above the best loss (nats) that counts as rising.")
    progress_after: int = _f(100, "Steps before learning progress (against chance and the unigram baseline) is judged.")
    baseline_margin: float = _f(0.02, "Not learning: the loss stays within this fraction of the unigram baseline.")
    loss_swing_factor: float = _f(
        10.0, "Alarm when the loss swings between checks this many times more than its steps' noise explains.")
    decay_share_max: float = _f(
        0.5, "Alarm when weight decay (lr x weight_decay) makes more than this share of each update.")
    reduce_lr_factor: float = _f(0.5, "reduce_lr: multiply the LR by this.")
    cooldown_checks: int = _f(10, "reduce_lr: checks before another reduction.")
    repair: bool = _f(
        False, "Repair: when an alarm's most likely cause is confirmed by the run's evidence and its fix can be "
        "applied mid-run (the LR, a restarted warmup, clipping, weight decay, Adam's epsilon and beta2, SGD momentum, "
        "label smoothing), apply it (after rolling back to the last good checkpoint when the weights were thrown "
        "off), record it and go on; a fix that needs a restart is printed as the command to rerun.")
    max_repairs: int = _f(3, "repair: at most this many repairs in a run.")
    actions: dict[str, MonitorAction] = _f(
        {"grad_norm_high": MonitorAction.reduce_lr, "grad_norm_surge": MonitorAction.reduce_lr},
        "Action per alarm (warn, reduce_lr, skip_step, rollback, stop); unlisted: warn.",
    )


@dataclass
class EvalConfig:
    tasks: list[str] = _f(
        [], "Evaluation tasks, each perplexity:PATH (held-out text: a file, folder, glob or .jsonl), "
        "multiple_choice:PATH (HellaSwag-style JSON lines) or harness:TASK (an lm-evaluation-harness task; extra: "
        "eval). `llmtrain eval` runs them; `llmtrain train` also runs them at every evaluation (eval_interval).")
    batch_size: int = _f(8, "Windows or choices scored per forward pass (results do not depend on it).")
    stride: int | None = _f(
        None, "Perplexity: tokens newly scored per window; null = the whole window (non-overlapping windows). "
        "Smaller gives every token more context, at more forward passes.")
    truncate: bool = _f(
        True, "A context longer than the model's window is cut from the left (said once); false refuses it.")
    limit: int | None = _f(None, "Score at most this many documents or examples per task (null: all); for quick "
                           "evaluations during training.")
    text_field: str = _f("text", "perplexity:PATH of .jsonl files: the field that holds each document's text.")
    harness_include: str | None = _f(
        None, "A folder of your own lm-evaluation-harness task YAML files, for harness:TASK.")


# report.console=auto prints the whole verdict table only after a run of at least this many seconds:
# a shorter one is a try-out, whose reader wants what is wrong, not seven rows.
REPORT_FULL_AFTER_S = 300.0


@dataclass
class ReportConfig:
    enabled: bool = _f(True, "Write report.md and report.html (the post-run review) into the run dir when train ends.")
    console: ReportConsole = _f(
        ReportConsole.auto, "What train prints of the review: short (a line per verdict that is not ok, and the "
        "report's path), full (the verdict table), auto (short for a run under 5 minutes, full otherwise).")


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
    eval: EvalConfig = _f(
        EvalConfig(), "Evaluation tasks (held-out perplexity, multiple choice, lm-evaluation-harness).")
    finetune: FinetuneConfig = _f(FinetuneConfig(), "What trains: every weight, or LoRA adapters on frozen weights.")
    tensorboard: bool = _f(
        False, "Also write every metric as TensorBoard scalars to RUN_DIR/tensorboard (extra: tensorboard).")
    wandb: WandbMode = _f(
        WandbMode.off, "Weights & Biases: off, offline (files in RUN_DIR/wandb, no network) or online (extra: "
        "wandb).")
    wandb_project: str = _f("llmtrain", "W&B project name.")
    resume: str = _f("auto", "auto (newest good checkpoint of the run dir), never, or a checkpoint/run dir path.")
    seed: int | None = _f(
        1337, "Global seed: model init, dropout and (by default) data order; null draws one (logged).")
    deterministic: bool = _f(
        False, "Deterministic algorithms only (torch.use_deterministic_algorithms): bitwise repeatable, maybe slower.")
    flush_denormal: bool = _f(
        True, "CPU: flush subnormal floats (< 1.2e-38) to zero; subnormal arithmetic can make steps several times "
        "slower.")
    compile: CompileMode = _f(
        CompileMode.auto, "torch.compile each block: off, on, or auto (on CUDA; on a CPU where this machine measured "
        "it faster for this shape: a long run's first steps measure it, and the verdict is kept for the next run).")
    allow_check_failures: bool = _f(False, "Train even when the pre-flight check (llmtrain check) reports FAIL rows.")
    memory_saver: bool = _f(
        False, "When the predicted peak memory does not fit this device, apply the cheapest saver that does (a "
        "smaller micro-batch, activation checkpointing, 8-bit AdamW, ...; llmtrain check lists them) before the run "
        "starts, and say which; preset=memory_saver sets it.")
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
    report: ReportConfig = _f(
        ReportConfig(), "The post-run review: written (report.enabled), printed (report.console).")
    out_dir: str | None = _f(None, "Run directory; null uses Hydra's run dir.")
    device: str = _f("auto", "auto, cpu, cuda, cuda:N or mps.")
    # int | "auto" | None, typed Any so that every value (2.5, true, "many") reaches the validator's
    # paragraph (config/validate.py) instead of OmegaConf's type error.
    threads: Any = _f(
        "auto", "CPU threads per process: auto (the cores other processes leave free at start-up, shared among the "
        "local processes; a single CPU process re-measures them mid-run as the machine changes), a count; null: auto.")

    def __post_init__(self) -> None:
        # `Config(report=False)`, the spelling from before report had its own keys
        if isinstance(self.report, bool):
            self.report = ReportConfig(enabled=self.report)


def config_to_dict(cfg: Any) -> Any:
    """Plain-Python view of a config (enums as their values), e.g. to write it as YAML."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Enum):
        return cfg.value
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


# --- the schema's own introspection: the groups and the fields of a section


def enum_names(tp: Any) -> list[str] | None:
    """The valid values of an enum type (None for any other type)."""
    return [m.value for m in tp] if isinstance(tp, type) and issubclass(tp, Enum) else None


def schema_fields(schema: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(schema)}


def field_type(tp: Any) -> Any:
    """The concrete type of a field: Optional[X] -> X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return args[0] if is_union and len(args) == 1 else tp


# Sections of Config set by their keys alone: no conf/<name>/ folder of options to pick from.
PLAIN_SECTIONS = ("report",)


def _group_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config)
                 if dataclasses.is_dataclass(field_type(f.type)) and f.name not in PLAIN_SECTIONS)


# The config groups: the fields of Config that are sections (one conf/<group>/ folder each).
GROUPS: tuple[str, ...] = _group_names()


# Mappings of the schema whose keys are names from a fixed list (the schema types them only as str).
MAPPING_KEYS: dict[str, tuple[str, ...]] = {"monitor.actions": ALARM_NAMES}
