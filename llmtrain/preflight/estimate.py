"""Memory and compute estimates for a config, before any training starts.

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

Activations are counted per token from what each op saves for backward (validated against
autograd's own saved-tensor hooks in the tests): per block the norm inputs and outputs, q/k/v and
the attention output, the MLP's hidden pre- and post-activation, dropout masks, and the full
(T x T) attention weights when the attention falls back to its math kernel (dropout on CPU). With
activation checkpointing only each block's input is kept, plus the block being recomputed in
backward, the gradients of its activations and the recompute's temporaries (about three blocks).

Per-rank layouts: single and DDP hold everything (DDP adds its gradient buckets); ZeRO-1 shards the
optimizer state; FSDP shards weights, gradients and state, and gathers about two blocks at a time.

Compute: training FLOPs per token (6N plus attention), a measured matmul rate of this device, and an
assumed utilization give the step time and the run time.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from llmtrain.config.derived import accumulation_steps, micro_batch_size_of, seq_len_of, total_steps
from llmtrain.config.schema import (
    Config,
    MlpKind,
    NormKind,
    NormPosition,
    OptimizerName,
    PositionEncoding,
    Precision,
)
from llmtrain.model import mlp_width
from llmtrain.model_tensors import model_tensors
from llmtrain.monitor.probes import matmul_peak_flops, rss_mb

MB = 2**20
LAYOUTS = ("single", "ddp", "zero1", "fsdp")
# Model FLOPs utilization assumed for the time estimate (the health records in metrics.jsonl carry
# the measured one, "mfu"). CPU, measured on this project's 2-core machine against the same 1024^2
# matmul probe (fp32, fused AdamW, 2 threads; 1 thread by CPU time agrees within 0.05): 0.64-0.66
# for the 4x128 default (T 256, batch 16: small matmuls, per-op overhead), 0.77 for 6x256, 0.84-0.88
# for 6x384 and 0.87 for 12x768 (T 128, batch 4); in between linear in log2(width), flat outside.
# (An earlier table said 0.33 and 0.6: the default run then took 202 ms/step against ~405 estimated.)
# CUDA and MPS: typical figures for small models, not measured here.
ASSUMED_MFU = {"cuda": 0.4, "mps": 0.3}
CPU_MFU_BY_WIDTH = ((128, 0.65), (384, 0.85))
# Memory the allocator holds beyond the live activations: forward temporaries already freed but not
# yet reused, and backward's gradients of activations. Measured on CPU (glibc malloc): resident
# memory peaks 1.2-1.4x above the saved activations, on models from 4x128 to 6x768 wide. Not
# measured on CUDA here; the caching allocator's rounding and backward buffers are of the same kind.
ALLOCATOR_SLACK = {"cpu": 1.3}
DEFAULT_ALLOCATOR_SLACK = 1.2


@dataclass
class ModelShape:
    """Parameter counts of the configured model, from its shapes (model_tensors.py: never built)."""

    n_params: int  # unique parameters (tied weights once)
    n_matmul_params: int  # weights of Linear layers: the ones autocast casts
    n_embedding_params: int  # token + position tables
    optimizer_state_elements: int
    flops_per_token: float
    largest_block_params: int
    n_layers: int
    n_buffer_elements: int = 0  # RoPE's tables: held whole by every rank, never trained


def model_shape(cfg: Config, vocab_size: int) -> ModelShape:
    tensors = model_tensors(cfg.model, vocab_size)
    embeddings = [name for name in ("wte.weight", "wpe.weight") if name in tensors.outside]
    state = sum(optimizer_state_elements(cfg, shape) for shape in tensors.unique_outside().values())
    state += cfg.model.n_layer * sum(optimizer_state_elements(cfg, shape) for shape in tensors.block.values())
    return ModelShape(
        n_params=tensors.n_params,
        n_matmul_params=cfg.model.n_layer * tensors.block_matmul_params
        + (0 if cfg.model.tie_weights else tensors.head_matmul_params),
        n_embedding_params=sum(math.prod(tensors.outside[name]) for name in embeddings),
        optimizer_state_elements=state,
        flops_per_token=tensors.flops_per_token(seq_len_of(cfg)),
        largest_block_params=tensors.block_params,
        n_layers=cfg.model.n_layer,
        n_buffer_elements=tensors.buffer_elements,
    )


def optimizer_state_elements(cfg: Config, shape: tuple[int, ...]) -> int:
    """Elements of optimizer state one parameter of this shape carries."""
    n = math.prod(shape)
    name = cfg.optim.name
    if name in (OptimizerName.adamw, OptimizerName.adam):
        return 2 * n  # first and second moments
    if name is OptimizerName.sgd:
        return n if cfg.optim.momentum > 0 else 0
    # Adafactor: a matrix keeps one row and one column of factored second moments; a vector all of it.
    if len(shape) >= 2:
        return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    return n


def activation_bytes_per_token(cfg: Config, precision: Precision, device_type: str) -> dict[str, float]:
    """Bytes autograd saves per token: one block (`block`), a checkpointed block's input
    (`block_input`), and the embedding + head (`head`, `head_transient`)."""
    m = cfg.model
    C, T, H = m.n_embd, seq_len_of(cfg), m.n_head
    low = precision in (Precision.bf16, Precision.fp16)
    a = 2 if low else 4  # matmul outputs (and the casts of norm outputs) under autocast
    r = 4  # the residual stream stays fp32
    hidden = mlp_width(m)
    has_dropout = m.dropout > 0
    norm_stats = 4 if m.norm is NormKind.rmsnorm else 8  # rstd (+ mean for LayerNorm), fp32, per token

    # q, k, v (one storage) and the output (laid out (B, T, H, D), so the projection's input is a view
    # of it), plus the log-sum-exp per head.
    attention = 4 * C * a + 4 * H
    if m.position is PositionEncoding.rope:
        # rotate-half makes new q and k in fp32 (the fp32 cos/sin tables promote them), and SDPA
        # keeps contiguous (and, under autocast, low-precision) copies of them: measured 16 bytes
        # per channel in fp32, 14 under autocast.
        attention += 14 * C if low else 16 * C
    if has_dropout and device_type == "cpu":
        # SDPA's fused CPU kernel has no dropout, so the math kernel runs (in fp32): it keeps the
        # softmax weights, the dropout mask and the dropped weights, (T x T) per head, instead of
        # the log-sum-exp, and its own copies of q/k/v (measured net: +3 channels under autocast,
        # -2 fp32 channels in fp32, where the residual dropout masks are views it shares).
        attention += 12 * H * T - 4 * H + (3 * C * a if low else -2 * C * 4)
    block = (
        2 * (r * C + norm_stats)  # both norms keep their input
        + 2 * a * C  # ... and their output (cast) feeds a matmul, which keeps it
        + attention
        + (4 if m.mlp is MlpKind.swiglu else 2) * a * hidden  # MLP pre/post activation (gated: 4 tensors)
        + (2 * C * a if has_dropout else 0)  # residual dropout masks (same dtype as the branch output)
    )
    V = cfg.model.vocab_size or 256
    # final norm in/out, log-softmax output, targets; the embedding dropout mask (fp32 stream)
    head = a * C + 4 * V + 8 + (4 * C if has_dropout else 0) + (4 * C if m.position is PositionEncoding.rope else 0)
    if m.norm_position is not NormPosition.post:  # post-LN blocks end normalized: no final norm
        head += r * C + norm_stats
    # Backward of the loss: the gradient of the log-softmax input and of the logits (plus, under
    # autocast, the low-precision one): measured 3x the logits' fp32 size with the saved output.
    head_transient = 4 * V * 2 + (a * V if low else 0)
    return {"block": block, "block_input": r * C, "head": head, "head_transient": head_transient}


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

    @property
    def peak(self) -> float:
        # The loss transients are few large blocks: the allocator returns those (glibc mmaps them),
        # so the slack applies to the many block activations only.
        working = self.activations * self.allocator_slack + self.loss_transients
        grads_alongside = self.gradients if self.accumulating else max(0.0, self.gradients - working)
        return (self.weights + self.optimizer + self.autocast_weights + working + grads_alongside
                + self.runtime + self.data)

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer),
            ("autocast weight copies", self.autocast_weights), ("activations (one micro-batch)", self.activations),
            ("loss transients", self.loss_transients),
            (f"allocator slack (x{self.allocator_slack:g} of activations)",
             (self.allocator_slack - 1) * self.activations),
            ("runtime (Python, torch)", self.runtime),
            ("data pages", self.data),
        ]


def estimate_memory(
    cfg: Config, shape: ModelShape, vocab_size: int, device_type: str, precision: Precision,
    layout: str = "single", world_size: int = 1, micro_batch_size: int | None = None,
    runtime_bytes: float = 0.0, data_bytes: float = 0.0,
) -> MemoryEstimate:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    micro = micro_batch_size or micro_batch_size_of(cfg, world_size)
    T = seq_len_of(cfg)
    cfg_v = _with_vocab(cfg, vocab_size)
    per_token = activation_bytes_per_token(cfg_v, precision, device_type)
    low = precision in (Precision.bf16, Precision.fp16)
    L = cfg.model.n_layer
    if cfg.model.activation_checkpointing:
        # every block's input, plus, in backward, the block being recomputed, the gradients of its
        # activations and the recompute's own temporaries: about three blocks' worth (measured
        # 3.3-3.6x on CPU for 4 and 6 blocks of 384 wide)
        kept = L * per_token["block_input"] + 3 * per_token["block"]
    else:
        kept = L * per_token["block"]
    per_sequence_act = T * (kept + per_token["head"])
    per_sequence_transient = T * per_token["head_transient"]

    weights = 4.0 * shape.n_params
    grads = 4.0 * shape.n_params
    opt = 4.0 * shape.optimizer_state_elements
    autocast = 2.0 * shape.n_matmul_params if low else 0.0
    shard = world_size if layout in ("zero1", "fsdp") else 1
    if layout == "fsdp":
        # Sharded fp32 master weights, gradients and state; about two blocks gathered at a time
        # (the current one and the prefetched next) in the compute dtype, plus one block's gradients.
        gathered = 2 * shape.largest_block_params * (2 if low else 4)
        weights = weights / world_size + gathered
        grads = grads / world_size + 4.0 * shape.largest_block_params
        autocast = 0.0  # the gathered copies already are in the compute dtype
    weights += 4.0 * shape.n_buffer_elements  # RoPE's cos/sin tables, block_size x head_dim each
    if layout == "ddp" and world_size > 1:
        grads *= 2  # the reducer's gradient buckets are a second copy of the gradients
    opt /= shard
    accum = accumulation_steps(cfg, world_size) if micro_batch_size is None else max(
        1, cfg.global_batch_size // (micro * world_size))
    est = MemoryEstimate(
        layout=layout, world_size=world_size, micro_batch_size=micro, weights=weights, gradients=grads,
        optimizer=opt, autocast_weights=autocast, activations=micro * per_sequence_act,
        loss_transients=micro * per_sequence_transient, runtime=runtime_bytes, data=data_bytes,
        accumulating=accum > 1, allocator_slack=ALLOCATOR_SLACK.get(device_type, DEFAULT_ALLOCATOR_SLACK),
        per_sequence=(per_sequence_act * ALLOCATOR_SLACK.get(device_type, DEFAULT_ALLOCATOR_SLACK)
                      + per_sequence_transient),
    )
    return est


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
    return rss_mb() * MB


def data_page_bytes(train_tokens: int, itemsize: int, windows: int, window_tokens: int) -> float:
    """Host memory of the memory-mapped train split after `windows` random reads: each read touches
    about window_bytes/4096 + 1 pages, and pages touched stay resident (file-backed)."""
    file_bytes = train_tokens * itemsize
    pages = max(1, file_bytes // 4096)
    per_read = window_tokens * itemsize / 4096 + 1
    return file_bytes * (1 - math.exp(-windows * per_read / pages))


# ---------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------


@dataclass
class ComputeEstimate:
    flops_per_token: float
    tokens_per_step: int
    steps: int
    matmul_flops: float  # measured on this device, FLOP/s
    assumed_mfu: float

    @property
    def step_seconds(self) -> float:
        return self.flops_per_token * self.tokens_per_step / (self.matmul_flops * self.assumed_mfu)

    @property
    def run_seconds(self) -> float:
        return self.step_seconds * self.steps

    @property
    def tokens(self) -> int:
        return self.tokens_per_step * self.steps


def estimate_compute(cfg: Config, shape: ModelShape, device: torch.device, matmul_flops: float | None = None,
                     world_size: int = 1) -> ComputeEstimate:
    rate = matmul_flops if matmul_flops is not None else matmul_peak_flops(device)
    return ComputeEstimate(
        flops_per_token=shape.flops_per_token,
        tokens_per_step=cfg.global_batch_size * seq_len_of(cfg) // world_size,
        steps=total_steps(cfg, world_size),
        matmul_flops=rate,
        assumed_mfu=assumed_mfu(device.type, cfg.model.n_embd),
    )


def assumed_mfu(device_type: str, width: int) -> float:
    if device_type != "cpu":
        return ASSUMED_MFU.get(device_type, 0.3)
    (w0, m0), (w1, m1) = CPU_MFU_BY_WIDTH
    t = min(1.0, max(0.0, (math.log2(width) - math.log2(w0)) / (math.log2(w1) - math.log2(w0))))
    return m0 + t * (m1 - m0)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
