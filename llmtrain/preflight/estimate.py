"""Memory estimates for a config, before any training starts (the time: preflight/compute.py).

Memory per rank is the sum of what a training step keeps alive:

    weights + gradients + optimizer state        exact, from the model's parameter shapes
    autocast weight copies                       bf16/fp16 casts of the matmul weights, kept for backward
    activations of one micro-batch               what autograd saves per token, block by block (below)
    loss transients                              logits, their fp32 copy and gradients at the head
    runtime + data                               host only: the process itself (Python, torch) and
                                                 the pages of the memory-mapped token file it touches

and the peak is reached at the start of a backward pass. Gradients are part of it from the second
micro-batch of an accumulation window on (they persist across the window); with one micro-batch per
step they are created while activations are freed, so only the larger of the two counts.

Activations are counted per token from what each op saves for backward, with and without activation
checkpointing: preflight/activations.py.

Per-device layouts (`LayoutDegrees`; `estimate_layout` is the one estimate, `estimate_memory` its
named layouts, the single device among them with every degree 1): DDP holds everything (and its
reducer's gradient buckets, also under ZeRO-1, which runs inside DDP); ZeRO-1 shards the optimizer
state; FSDP shards weights, gradients and state, and gathers about two blocks at a time; tensor
parallelism (distributed/tensor_parallel.py) splits each block's matmul weights and the activations
inside attention and the MLP, the embedding and head by vocabulary rows, and with sequence
parallelism the norms' and residual activations too; pipeline parallelism splits the blocks into
stages, each keeping the activations of the micro-batches in flight. `llmtrain plan`
(llmtrain/plan/) compares them over a number of devices.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmtrain.checkpointing import CheckpointPlan
from llmtrain.config.derived import accumulation_steps, micro_batch_size_of, seq_len_of
from llmtrain.config.finetune import is_lora, quantized_base
from llmtrain.config.schema import (
    CheckpointFormat,
    Config,
    OptimizerName,
    Precision,
)
from llmtrain.lora import adapter_shapes
from llmtrain.model_tensors import model_tensors
from llmtrain.monitor.probes import rss_mb
from llmtrain.preflight.activations import activation_bytes_per_token, checkpoint_plan, checkpointed_activations
from llmtrain.qlora import nf4_bytes, quantized_names

MB = 2**20
LAYOUTS = ("single", "ddp", "zero1", "fsdp")  # the named layouts of estimate_memory (the check's per-rank line)
# Memory the allocator holds beyond the live activations: forward temporaries already freed but not
# yet reused, and backward's gradients of activations. Measured on CPU (glibc malloc): resident
# memory peaks 1.2-1.4x above the saved activations, on models from 4x128 to 6x768 wide. Not
# measured on CUDA here; the caching allocator's rounding and backward buffers are of the same kind.
ALLOCATOR_SLACK = {"cpu": 1.3}
DEFAULT_ALLOCATOR_SLACK = 1.2
# With gradient accumulation the parameters' gradients live between micro-batches, allocated in the
# middle of the heap that held the last one's activations: the next micro-batch's activations fit
# the holes less well, and glibc cannot return what lies below the gradients. Measured on CPU over
# 6-8 steps (4 against 1 micro-batch per step, models 4x128 to 8x512, activations 100-270 MiB):
# 0.3x the activations more at the peak (80-160 MiB), beyond the gradients themselves.
ACCUMULATION_SLACK = {"cpu": 0.3}


@dataclass
class ModelShape:
    """Parameter counts of the configured model, from its shapes (model_tensors.py: never built)."""

    n_params: int  # unique parameters (tied weights once)
    n_matmul_params: int  # weights of Linear layers: the ones autocast casts
    n_embedding_params: int  # token + position tables
    optimizer_state_elements: float  # float32 elements (low-bit state: its bytes / 4)
    flops_per_token: float
    largest_block_params: int
    n_layers: int
    n_buffer_elements: int = 0  # RoPE's tables: held whole by every rank, never trained
    block_matmul_params: int = 0  # one block's Linear weights: what tensor parallelism splits
    block_optimizer_state_elements: float = 0  # one block's share of optimizer_state_elements
    n_vocab_params: int = 0  # the token embedding and an untied head: what tensor parallelism splits by rows
    # finetune=lora: the adapters, beside n_params, and the only parameters with gradients and optimizer
    # state (optimizer_state_elements is then theirs)
    adapter_params: int = 0
    # finetune=qlora: the frozen weights (of n_params) stored in NF4, and their bytes (~0.52 a value)
    nf4_params: int = 0
    nf4_bytes: float = 0.0

    @property
    def outside_params(self) -> int:
        """Parameters outside the blocks: the embedding tables, the final norm, an untied head."""
        return self.n_params - self.n_layers * self.largest_block_params

    @property
    def outside_matmul_params(self) -> int:
        """Matmul weights outside the blocks (an untied head's), counted in n_matmul_params."""
        return self.n_matmul_params - self.n_layers * self.block_matmul_params


def attention_span(cfg: Config) -> int:
    """Keys each query attends to at most: the sequence, or the sliding window when the model has one
    (model.sliding_window, read with getattr so configs from before the key work the same)."""
    window = getattr(cfg.model, "sliding_window", None)
    return min(seq_len_of(cfg), window) if window else seq_len_of(cfg)


def model_shape(cfg: Config, vocab_size: int) -> ModelShape:
    tensors = model_tensors(cfg.model, vocab_size)
    embeddings = [name for name in ("wte.weight", "wpe.weight") if name in tensors.outside]
    block_state = sum(optimizer_state_elements(cfg, shape) for shape in tensors.block.values())
    state = sum(optimizer_state_elements(cfg, shape) for shape in tensors.unique_outside().values())
    state += cfg.model.n_layer * block_state
    adapters = adapter_shapes(cfg.model, cfg.finetune, vocab_size) if is_lora(cfg) else {}
    if adapters:  # the frozen weights carry no optimizer state: only the adapters do (a block's: block 0's)
        block_state = sum(optimizer_state_elements(cfg, s) for n, s in adapters.items() if n.startswith("blocks.0."))
        state = sum(optimizer_state_elements(cfg, shape) for shape in adapters.values())
    # finetune=qlora: the weights qlora.py's rule picks by name (one block's, counted n_layer times) in NF4
    nf4, names = [0, 0], [*(f"blocks.0.{n}" for n in tensors.block), *tensors.outside, *adapters]
    for name in quantized_names(names if quantized_base(cfg) else []):
        numel, times = (math.prod(tensors.block[name[9:]]), cfg.model.n_layer) if name.startswith("blocks.0.") else (
            math.prod(tensors.outside[name]), 1)
        nf4 = [nf4[0] + times * numel, nf4[1] + times * nf4_bytes(numel)]
    return ModelShape(
        n_params=tensors.n_params,
        n_matmul_params=cfg.model.n_layer * tensors.block_matmul_params
        + (0 if cfg.model.tie_weights else tensors.head_matmul_params),
        n_embedding_params=sum(math.prod(tensors.outside[name]) for name in embeddings),
        optimizer_state_elements=state,
        # The attention term counts the keys a query sees (min(context, window)): the useful FLOPs,
        # as MFU counts them. SDPA given a window as a dense mask still computes the masked scores,
        # so the time a step takes shrinks only with a kernel that skips masked blocks.
        flops_per_token=tensors.flops_per_token(attention_span(cfg)),
        largest_block_params=tensors.block_params,
        n_layers=cfg.model.n_layer,
        n_buffer_elements=tensors.buffer_elements,
        block_matmul_params=tensors.block_matmul_params,
        block_optimizer_state_elements=block_state,
        n_vocab_params=sum(math.prod(tensors.outside[name]) for name in tensors.unique_outside()
                           if name in ("wte.weight", "lm_head.weight")),
        adapter_params=sum(math.prod(shape) for shape in adapters.values()),
        nf4_params=nf4[0], nf4_bytes=nf4[1],
    )


# torchao's low-bit AdamW (torchao/optim/adam.py, subclass_8bit.py, subclass_4bit.py): a moment of a
# tensor of at least 4096 elements that its block size divides is quantized: 8 or 4 bits a value, one
# float32 scale per block (256 values for 8-bit, 128 for 4-bit) and a float32 lookup table per tensor
# (256 or 16 entries). Smaller tensors keep float32 moments.
LOW_BIT_MIN_ELEMENTS = 4096
LOW_BIT_LAYOUT = {OptimizerName.adamw8bit: (8, 256, 256), OptimizerName.adamw4bit: (4, 128, 16)}  # bits, block, table


def optimizer_state_elements(cfg: Config, shape: tuple[int, ...]) -> float:
    """Optimizer state one parameter of this shape carries, in float32 elements (callers count 4
    bytes each): a low-bit optimizer's quantized moments as their bytes / 4."""
    n = math.prod(shape)
    name = cfg.optim.name
    if name in (OptimizerName.adamw, OptimizerName.adam):
        return 2 * n  # first and second moments
    if name in LOW_BIT_LAYOUT:
        bits, block, table = LOW_BIT_LAYOUT[name]
        if n < LOW_BIT_MIN_ELEMENTS or n % block:
            return 2 * n
        return 2 * (n * bits / 8 + 4 * (n // block + table)) / 4
    if name is OptimizerName.sgd:
        return n if cfg.optim.momentum > 0 else 0
    # Adafactor: a matrix keeps one row and one column of factored second moments; a vector all of it.
    if len(shape) >= 2:
        return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    return n


@dataclass(frozen=True)
class LayoutDegrees:
    """How a run's devices share the work; their product is the number of devices. A layout is a
    set of degrees: ddp over 8 is dp_replicate=8, fsdp over 8 dp_shard=8, fsdp with tensor
    parallelism dp_shard=4 x tp=2; a single device has every degree 1. The run's own mesh
    (config.derived.Degrees: replicas x shards x tp) plus what the estimate also weighs: pipeline
    stages (planned, not trained yet), ZeRO-1 and sequence parallelism."""

    dp_replicate: int = 1  # data parallel, every rank with a whole copy (DDP): gradients all-reduced
    dp_shard: int = 1  # data parallel with weights, gradients and optimizer state sharded (FSDP)
    tp: int = 1  # tensor parallel: each block's matmuls (heads, MLP units) split
    pp: int = 1  # pipeline parallel: the blocks split into consecutive stages
    zero1: bool = False  # the optimizer state sharded over the dp_replicate ranks (ZeRO stage 1)
    sequence_parallel: bool = False  # tp > 1: the norms and the residual stream split along the sequence too

    @property
    def devices(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        """Ranks that each take their own share of the global batch (tp and pp ranks share one)."""
        return self.dp_replicate * self.dp_shard


def layout_degrees(layout: str, world_size: int) -> LayoutDegrees:
    """The degrees of a named layout (LAYOUTS) over `world_size` processes."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    if layout == "single":  # one process, whatever batch share it is given
        return LayoutDegrees()
    if layout == "fsdp":
        return LayoutDegrees(dp_shard=world_size)
    return LayoutDegrees(dp_replicate=world_size, zero1=layout == "zero1")


@dataclass
class MemoryEstimate:
    """Bytes per rank; `peak` is what the device (or host) must hold at the worst moment."""

    layout: str
    world_size: int
    micro_batch_size: int
    weights: float
    gradients: float
    optimizer: float
    autocast_weights: float
    activations: float
    loss_transients: float
    runtime: float
    data: float
    accumulating: bool
    allocator_slack: float
    per_sequence: float  # activation + transient bytes one more sequence of a micro-batch adds
    degrees: LayoutDegrees = field(default_factory=LayoutDegrees)
    checkpointing: CheckpointPlan = field(default_factory=CheckpointPlan)  # which blocks are recomputed in backward
    # The part of `gradients` held the whole run: DDP's buckets, allocated when the model is wrapped.
    # The rest, the parameters' own gradients, is created during backward as activations are freed.
    gradient_buckets: float = 0.0
    host_gather: float = 0.0  # the first process's whole-model copy for files (whole_model_gather)
    early_gradients: float = 0.0  # the head's gradients (fsdp: the root unit's), created first in backward
    # The health monitor's copy of the trainable weights, held from a check (after backward) to the
    # end of its step, for the update-to-weight ratio (monitor/watch.py); 0 with the monitor off.
    monitor_copy: float = 0.0

    @property
    def working(self) -> float:
        """Activations with the allocator's slack, and the loss transients: the memory a
        micro-batch's forward and backward add. The loss transients are few large blocks: the
        allocator returns those (glibc mmaps them), so the slack applies to the many block
        activations only."""
        return self.activations * self.allocator_slack + self.loss_transients

    @property
    def peak(self) -> float:
        working = self.working
        # Backward frees activations as it creates gradients, except the head's (fsdp: the root
        # unit's), which come first, while every activation is still held.
        grads_alongside = self.gradients if self.accumulating else self.gradient_buckets + max(
            self.early_gradients, self.gradients - self.gradient_buckets - working)
        training = (self.weights + self.optimizer + self.autocast_weights + working + grads_alongside
                    + self.runtime + self.data)
        # A save comes after a step: its gradients freed, but on CPU their memory stays with the
        # process (glibc keeps the freed heap), and the gathered copy comes on top.
        saving = self.weights + self.optimizer + self.gradients + self.runtime + self.data + self.host_gather
        return max(training, saving if self.host_gather else 0.0, self.checking)

    @property
    def checking(self) -> float:
        """A monitor check: the activations freed, every gradient held, and the monitor's copy."""
        return self.weights + self.optimizer + self.gradients + self.monitor_copy + self.runtime + self.data

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer),
            ("autocast weight copies", self.autocast_weights), ("activations (one micro-batch)", self.activations),
            ("loss transients", self.loss_transients),
            (f"allocator slack (x{self.allocator_slack:g} of activations)",
             (self.allocator_slack - 1) * self.activations),
            ("runtime (Python, torch)", self.runtime),
            ("data pages", self.data),
            *([("whole-model copy for files (first process)", self.host_gather)] if self.host_gather else []),
            # Shown where it makes the peak: elsewhere it fits in the activations' freed memory.
            *([("monitor's weight copy (at a check)", self.monitor_copy)]
              if self.monitor_copy and self.checking >= self.peak else []),
        ]


def estimate_memory(
    cfg: Config, shape: ModelShape, vocab_size: int, device_type: str, precision: Precision,
    layout: str = "single", world_size: int = 1, micro_batch_size: int | None = None,
    runtime_bytes: float = 0.0, data_bytes: float = 0.0,
) -> MemoryEstimate:
    """Per-rank memory of a named layout (LAYOUTS) over `world_size` processes, with the config's
    activation checkpointing: `estimate_layout` with its degrees."""
    degrees = layout_degrees(layout, world_size)
    micro = micro_batch_size or micro_batch_size_of(cfg, world_size)
    accum = accumulation_steps(cfg, world_size) if micro_batch_size is None else max(
        1, cfg.global_batch_size // (micro * world_size))
    est = estimate_layout(cfg, shape, vocab_size, device_type, precision, degrees, micro_batch_size=micro,
                          accumulation=accum, runtime_bytes=runtime_bytes, data_bytes=data_bytes)
    est.layout, est.world_size = layout, world_size
    return est


def estimate_layout(
    cfg: Config, shape: ModelShape, vocab_size: int, device_type: str, precision: Precision,
    degrees: LayoutDegrees = LayoutDegrees(), checkpointing: CheckpointPlan | bool | None = None,
    micro_batch_size: int | None = None,
    accumulation: int | None = None, runtime_bytes: float = 0.0, data_bytes: float = 0.0,
) -> MemoryEstimate:
    """Memory of one device in the layout `degrees`, each data-parallel rank taking micro-batches of
    `micro_batch_size` sequences, `accumulation` of them per optimizer step (both by default from
    the config, over degrees.data_parallel ranks); `checkpointing` None: the config's
    model.activation_checkpointing and checkpoint_every, True/False (a plan's rung): full on every
    block, or none. With every degree 1 this is the single-device estimate.

    Pipeline stages are taken at their heaviest: ceil(layers / pp) blocks, the embedding table (the
    first stage's) and the head with the logits (the last stage's, holding the table too when tied),
    and, under the 1F1B schedule, the activations of min(pp, micro-batches) micro-batches in flight
    (the first stage's: pp x layers / pp blocks of one micro-batch, as many as without stages)."""
    d = degrees
    dp = d.data_parallel
    micro = micro_batch_size or micro_batch_size_of(cfg, dp)
    accum = accumulation if accumulation is not None else max(1, cfg.global_batch_size // (micro * dp))
    ckpt = checkpoint_plan(cfg, checkpointing)
    T = seq_len_of(cfg)
    per_token = activation_bytes_per_token(_with_vocab(cfg, vocab_size), precision, device_type)
    low = precision in (Precision.bf16, Precision.fp16)
    share = device_share(shape, d)
    block = share.block_params

    weights = 4.0 * share.params
    grads = 4.0 * share.params
    root = share.params - share.layers * block  # outside the blocks: embeddings, final norm, head
    head = 4.0 * vocab_size * cfg.model.n_embd / d.tp  # the head's gradient: first in backward
    buckets = 0.0
    opt = 4.0 * share.optimizer_state_elements
    autocast = 2.0 * share.matmul_params if low else 0.0
    if shape.adapter_params:  # LoRA (one device or DDP): gradients for the adapters only
        weights += 4.0 * shape.adapter_params
        grads = 4.0 * shape.adapter_params
        head = min(head, grads)
    if shape.nf4_params:  # QLoRA (one device): those weights in NF4, dequantized a layer at a time, never kept
        weights -= 4.0 * shape.nf4_params - shape.nf4_bytes
        autocast = 0.0  # and autocast caches no copy of a frozen weight (it caches those that need gradients)
    if d.dp_shard > 1:
        # Sharded fp32 master weights, gradients and state; about two blocks gathered at a time
        # (the current one and the prefetched next) in the compute dtype, plus one block's gradients.
        # The root unit (embeddings, final norm, head: distributed/wrapping.py) stays gathered from
        # its forward to the end of backward, and its gradients are reduce-scattered last.
        gathered = (2 * block + root) * (2 if low else 4)
        weights = weights / d.dp_shard + gathered
        opt = opt / d.dp_shard
        autocast = 0.0  # the gathered copies already are in the compute dtype
        # The root unit's gradients end backward whole, three times over: the head's, the tied
        # embedding's own (summed into it), and the copy FSDP2 reduce-scatters (measured on gloo: a
        # transient of 3-4x the unit's fp32 size at the end of backward).
        head = 3 * 4.0 * root
        if accum == 1:
            grads = grads / d.dp_shard + 4.0 * (block + root)
        # else: an accumulation window holds FSDP's reduce-scatter until its last micro-batch
        # (engine/step.py), and until then every rank keeps its unsharded gradients, in fp32 (FSDP2
        # accumulates them in the reduce dtype): as many as without sharding.
    elif d.dp_replicate > 1:
        buckets = grads  # DDP's (and ZeRO-1's, which runs inside DDP) gradient buckets: a second copy
        grads += buckets
        if d.zero1:
            opt = opt / d.dp_replicate
    weights += 4.0 * shape.n_buffer_elements  # RoPE's cos/sin tables, block_size x head_dim each

    # Tensor parallelism splits what attention and the MLP keep; sequence parallelism the rest of a
    # block too (the norms and the residual stream hold the device's slice of the sequence).
    block_act = per_token["block"] - per_token["block_split"] * (1 - 1 / d.tp)
    block_input = per_token["block_input"]
    if d.sequence_parallel:
        block_act, block_input = per_token["block"] / d.tp, block_input / d.tp
    kept, recomputing = checkpointed_activations(ckpt, share.layers, block_act, block_input, per_token, d.tp, d.pp,
                                                 device_type)
    in_flight = min(d.pp, accum)  # a pipeline stage keeps the micro-batches it has not run backward on
    # the heavier of a pipeline's first stage (micro-batches in flight, no head) and its last (one,
    # and the head's); without stages both terms are the one device's
    per_sequence_act = T * (max(in_flight * kept, kept + per_token["head"]) + recomputing)
    per_sequence_transient = T * per_token["head_transient"]
    slack = ALLOCATOR_SLACK.get(device_type, DEFAULT_ALLOCATOR_SLACK)
    if accum > 1:
        slack += ACCUMULATION_SLACK.get(device_type, 0.0)
    return MemoryEstimate(
        layout=layout_name(d), world_size=d.devices, micro_batch_size=micro, weights=weights, gradients=grads,
        optimizer=opt, autocast_weights=autocast, activations=micro * per_sequence_act,
        loss_transients=micro * per_sequence_transient, runtime=runtime_bytes, data=data_bytes,
        accumulating=accum > 1, allocator_slack=slack, per_sequence=per_sequence_act * slack + per_sequence_transient,
        degrees=d, checkpointing=ckpt, gradient_buckets=buckets,
        host_gather=whole_model_gather(cfg, shape, d) if device_type == "cpu" else 0.0, early_gradients=head,
        monitor_copy=(4.0 * shape.adapter_params if shape.adapter_params else 4.0 * share.params / d.dp_shard)
        if cfg.monitor.enabled else 0.0,
    )


def whole_model_gather(cfg: Config, shape: ModelShape, d: LayoutDegrees) -> float:
    """Bytes the first process gathers to write whole-model files when the layout splits the model:
    the final weights (for `sample` and `export`), and under full-format checkpoints (tensor or
    pipeline parallel, or fsdp with checkpoint.format=full) the weights and optimizer state at every
    save, tensor parallel's q/k/v rows reordered in a copy of each (the weight and each moment).
    These land in host memory: part of the device's only on CPU. A pipeline's first process already
    holds its own stage, counted once (about 1/pp of the whole)."""
    if d.dp_shard == 1 and d.tp == 1 and d.pp == 1:
        return 0.0  # every process holds the whole model: the files are written from it, no copy
    weights, state = 4.0 * shape.n_params, 4.0 * shape.optimizer_state_elements
    full_files = d.tp > 1 or d.pp > 1 or cfg.checkpoint.format is CheckpointFormat.full
    saves = cfg.checkpoint.final or cfg.checkpoint.every_steps or cfg.checkpoint.every_minutes
    gathered = weights + (state if full_files and saves else 0.0)
    if d.tp > 1:
        m = cfg.model
        kv_width = m.n_embd * (m.n_kv_head or m.n_head) // m.n_head
        qkv = shape.n_layers * m.n_embd * (m.n_embd + 2 * kv_width)
        gathered += 4.0 * qkv * (1 + (2 if full_files and saves else 0))
    return gathered * (1 - 1 / d.pp) if d.pp > 1 else gathered


@dataclass(frozen=True)
class DeviceShare:
    """The part of the model one device holds in a layout before any data-parallel sharding."""

    layers: int  # blocks of its pipeline stage (the heaviest one's)
    block_params: float  # of one block, its matmul weights split tp ways
    params: float
    matmul_params: float  # the weights autocast casts
    optimizer_state_elements: float


def device_share(shape: ModelShape, d: LayoutDegrees) -> DeviceShare:
    """One device's part of the model under `d`'s tensor and pipeline degrees: its stage's blocks
    with their matmul weights split tp ways (norms and biases whole), and everything outside the
    blocks: the token embedding and an untied head split tp ways by vocabulary rows, the position
    table and the final norm whole (distributed/tensor_parallel.py's plan); all of it held by the
    heaviest pipeline stage (the first's table or the last's head, which holds the table too when
    tied)."""
    layers = -(-shape.n_layers // d.pp)
    block = shape.largest_block_params - shape.block_matmul_params * (1 - 1 / d.tp)
    outside = shape.outside_params - shape.n_vocab_params * (1 - 1 / d.tp)
    outside_matmul = shape.outside_matmul_params / d.tp  # an untied head, split by vocabulary rows
    # The optimizer state follows the parameters it belongs to (exact for Adam's two moments and
    # SGD's momentum, close for Adafactor's factored rows and columns of the split matrices).
    block_state = shape.block_optimizer_state_elements * block / max(1, shape.largest_block_params)
    outside_state = shape.optimizer_state_elements - shape.n_layers * shape.block_optimizer_state_elements
    outside_state *= outside / max(1, shape.outside_params)
    return DeviceShare(
        layers=layers, block_params=block, params=layers * block + outside,
        matmul_params=layers * shape.block_matmul_params / d.tp + outside_matmul,
        optimizer_state_elements=layers * block_state + outside_state,
    )


def layout_name(d: LayoutDegrees) -> str:
    """A short name for a set of degrees: single, ddp, zero1, fsdp, hsdp, tp, fsdp+tp, pp, fsdp+pp..."""
    if d.devices == 1:
        return "single"
    data = ("hsdp" if d.dp_replicate > 1 and d.dp_shard > 1 else "fsdp" if d.dp_shard > 1
            else ("zero1" if d.zero1 else "ddp") if d.dp_replicate > 1 else "")
    return "+".join(part for part in (data, "tp" if d.tp > 1 else "", "pp" if d.pp > 1 else "") if part)


def largest_fitting_micro_batch(
    cfg: Config, shape: ModelShape, vocab_size: int, device_type: str, precision: Precision, budget: float,
    world_size: int = 1, runtime_bytes: float = 0.0, data_bytes: float = 0.0, layout: str = "single",
) -> int | None:
    """The largest micro-batch that divides the global batch per rank and whose peak fits `budget`."""
    per_rank = cfg.global_batch_size // world_size
    for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        est = estimate_memory(cfg, shape, vocab_size, device_type, precision, layout, world_size, micro,
                              runtime_bytes, data_bytes)
        if est.peak <= budget:
            return micro
    return None


def _with_vocab(cfg: Config, vocab_size: int) -> Config:
    out = copy.copy(cfg)
    out.model = copy.copy(cfg.model)
    out.model.vocab_size = vocab_size
    return out


# ---------------------------------------------------------------------------------------------
# What the machine offers
# ---------------------------------------------------------------------------------------------


def available_memory(device: torch.device) -> tuple[float, str]:
    """Bytes this process can still use on `device`, and where the figure comes from."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Blocks the caching allocator holds but no tensor uses (e.g. from an earlier job of an
        # in-process sweep) are not "free" to the driver, yet this run can use them.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + cached), f"free on {torch.cuda.get_device_name(device)} ({total / 2**30:.0f} GiB total)"
    available = _meminfo_available()
    limit = _cgroup_headroom()
    if limit is not None and (available is None or limit < available):
        return limit, "cgroup memory limit headroom"
    if available is not None:
        return available, "host MemAvailable"
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "host physical memory (no free figure here)"


def _meminfo_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> float | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    if limit == "max":
        return None
    return float(int(limit) - int(used))


def runtime_bytes(device: torch.device) -> float:
    """The process's own footprint that the estimate adds on the host: what it holds now (Python,
    torch, the libraries). On CUDA the context lives outside the allocator and is already gone from
    the free memory, so nothing is added there."""
    if device.type != "cpu":
        return 0.0
    # A training step's first optimizer step imports torch._dynamo (torch.optim asks whether it is
    # being compiled): ~800 modules, ~70 MiB on torch 2.13, that a check-time process has not loaded.
    # Loaded here (once a process; ~1 s) so the figure is the training process's.
    import torch._dynamo  # noqa: F401

    return rss_mb() * MB


def data_page_bytes(train_tokens: int, itemsize: int, windows: int, window_tokens: int) -> float:
    """Host memory of the memory-mapped train split after `windows` random reads: each read touches
    about window_bytes/4096 + 1 pages, and pages touched stay resident (file-backed)."""
    file_bytes = train_tokens * itemsize
    pages = max(1, file_bytes // 4096)
    per_read = window_tokens * itemsize / 4096 + 1
    return file_bytes * (1 - math.exp(-windows * per_read / pages))


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def describe_footprint(values: int, stored: float) -> str:
    """'1,572,864 frozen weights in 4 bits (NF4: 792.1 KiB against 6.0 MiB in fp32)'."""
    return (f"{values:,} frozen weights in 4 bits (NF4: {format_bytes(stored)} against {format_bytes(4 * values)} "
            "in fp32)")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} B"
