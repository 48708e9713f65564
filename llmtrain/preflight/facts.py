"""What the machine and the data say about a config, for the pre-flight checklist (check.py):
the device and precision, the data's size (prepared, or estimated from the source), the model's
parameter counts, the memory and compute estimates, the per-rank memory of the parallel layouts
and what the data's size says of the model's depth. `gather_facts` collects them once; every item
of the checklist reads them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmtrain.config.derived import expected_data_vocab, model_vocab_size, seq_len_of, total_steps, world_size_of
from llmtrain.config.schema import Config, Precision, TokenizerKind
from llmtrain.core.errors import UserError
from llmtrain.data.cache import cached_meta, pretrained_tokenizer, source_files
from llmtrain.distributed.layout import resolve_device
from llmtrain.engine.precision import resolve_precision
from llmtrain.model_tensors import model_tensors
from llmtrain.preflight.compute import ComputeEstimate, estimate_compute
from llmtrain.preflight.estimate import (
    MemoryEstimate,
    ModelShape,
    available_memory,
    data_page_bytes,
    estimate_memory,
    largest_fitting_micro_batch,
    model_shape,
    runtime_bytes,
)
from llmtrain.preflight.parameters import WITHOUT_EMBEDDINGS, ParameterCounts, parameter_counts

MEMORY_WARN_FRACTION = 0.85  # above this share of the free memory, fragmentation and spikes can OOM
TOKENS_PER_PARAM = 20  # compute-optimal training (Chinchilla): ~20 tokens per parameter without embeddings


@dataclass
class Facts:
    """What the machine and the data say about a config."""

    device: torch.device
    precision: Precision  # `auto` resolved for the device
    vocab_size: int
    train_tokens: int | None  # None: the data is not prepared yet and its size is unknown
    data_note: str
    shape: ModelShape
    parameters: ParameterCounts
    memory: MemoryEstimate
    memory_budget: float
    memory_source: str
    compute: ComputeEstimate | None
    fitting_micro_batch: int | None  # the largest micro-batch (dividing the global batch) that fits
    # Per-rank peak of each parallel layout over `layout_world` processes: the run's own (a parallel
    # config), else this machine's GPUs when it has several; None (and no peaks) for one process.
    layout_peaks: dict[str, float]
    layout_world: int | None
    layout_over: str  # what layout_world counts: "the run's 2 processes", "this machine's 8 GPUs"
    depth: str | None = None  # what the train split's size says of the model's depth (None: nothing useful)
    rate_measured_now: bool = True  # the compute estimate's matmul rate was measured by this check
    data_vocab: int | None = None  # the data's own vocabulary (None: a char vocabulary not read yet)
    data_meta: dict | None = None  # the prepared data's meta.json (None: not prepared yet)

# ---------------------------------------------------------------------------------------------
# Facts
# ---------------------------------------------------------------------------------------------


def gather_facts(cfg: Config, measure_compute: bool = True, data_meta: dict | None = None,
                 matmul_flops: float | None = None) -> Facts:
    """Resolve the device and precision, find the data's size (prepared or estimated from the
    source) and estimate memory and, if asked, compute: at `matmul_flops` (FLOP/s) when the rate
    is known already, else at a rate measured now (a sub-second matmul timing)."""
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision.name, device)
    meta = data_meta if data_meta is not None else cached_meta(cfg.data)
    if meta is not None:
        data_vocab, train_tokens = int(meta["vocab_size"]), int(meta["train_tokens"])
        itemsize = 2 if meta["dtype"] == "uint16" else 4
        note = "prepared data"
    else:
        data_vocab, train_tokens = _expected_vocab(cfg), _estimated_train_tokens(cfg)
        itemsize = 2 if (data_vocab or 256) <= 2**16 else 4
        note = ("data not prepared yet: sizes estimated from the source"
                + ("" if data_vocab is not None else " (byte-sized vocabulary)"))
    if meta is None and cfg.data.tokenizer is TokenizerKind.bpe and cfg.model.vocab_size is not None:
        data_vocab = min(data_vocab, cfg.model.vocab_size)  # bpe's is an upper bound: refuse only the real one
    # char: the data's vocabulary is unknown until prepared, so an explicit size is not refused here
    vocab = (cfg.model.vocab_size if data_vocab is None and cfg.model.vocab_size is not None
             else model_vocab_size(cfg, data_vocab or 256))
    shape = model_shape(cfg, vocab)
    parameters = parameter_counts(model_tensors(cfg.model, vocab))
    seq = seq_len_of(cfg)
    windows = total_steps(cfg) * cfg.global_batch_size
    data_bytes = data_page_bytes(train_tokens or 0, itemsize, windows, seq + 1) if device.type == "cpu" else 0.0
    runtime = runtime_bytes(device)
    memory = estimate_memory(cfg, shape, vocab, device.type, precision, runtime_bytes=runtime, data_bytes=data_bytes)
    available, source = available_memory(device)
    budget = available + runtime  # what this process holds now is not in the free figure
    compute = estimate_compute(cfg, shape, device, matmul_flops) if measure_compute else None
    fitting = largest_fitting_micro_batch(cfg, shape, vocab, device.type, precision, budget * MEMORY_WARN_FRACTION,
                                          runtime_bytes=runtime, data_bytes=data_bytes)
    world, over = layout_world(cfg, device)
    layouts = {}
    if world:
        # The run's own batch over its processes; over this machine's GPUs, the same micro-batch per GPU.
        spread = cfg if world == world_size_of(cfg) else dataclasses.replace(
            cfg, global_batch_size=cfg.micro_batch_size * world)
        layouts = {layout: estimate_memory(spread, shape, vocab, device.type, precision, layout, world,
                                           runtime_bytes=runtime, data_bytes=data_bytes).peak
                   for layout in ("ddp", "zero1", "fsdp")}
    return Facts(device, precision, vocab, train_tokens, note, shape, parameters, memory, budget, source, compute,
                 fitting, layouts, world, over, depth_advice(cfg, shape, train_tokens), matmul_flops is None,
                 data_vocab=data_vocab, data_meta=meta)


# The model size a data set can feed: TOKENS_PER_PARAM each, counting up to 4 passes over the data,
# which train about as well as new data (Muennighoff et al. 2023, "Scaling Data-Constrained Language
# Models"); more passes are worth less and less.
DATA_PASSES_WORTH = 4
# Depth beyond which more layers stop paying off: ~12 for up to a billion tokens, 24 from there on.
ENOUGH_LAYERS, ENOUGH_LAYERS_BILLIONS = 12, 24


def depth_advice(cfg: Config, shape: ModelShape, train_tokens: int | None) -> str | None:
    """The footer's line on depth for this much data: the configured layers (of the configured
    width) against those the train split can feed; a deeper model only when both the data and the
    depth rule support it. None when the size is unknown or there is nothing to change."""
    if not train_tokens:
        return None
    layers, width = cfg.model.n_layer, cfg.model.n_embd
    supported = train_tokens * DATA_PASSES_WORTH / TOKENS_PER_PARAM
    fed = int(supported // max(1, shape.largest_block_params))  # layers of this width the data can feed
    data = (f"data: {train_tokens:,} train tokens feed about {supported:,.0f} parameters {WITHOUT_EMBEDDINGS} "
            f"(~{TOKENS_PER_PARAM} tokens each, over up to {DATA_PASSES_WORTH} passes)")
    if layers > fed:
        blocks = (f"about {fed} layer{'s' if fed > 1 else ''} of width {width}" if fed else
                  f"less than one layer of width {width} ({shape.largest_block_params:,} parameters)")
        return f"{data}: {blocks}, {layers} configured: more data, or a smaller model"
    useful = min(fed, ENOUGH_LAYERS if train_tokens < 1e9 else ENOUGH_LAYERS_BILLIONS)
    if layers < useful:
        return f"{data}: up to about {useful} layers of width {width} can pay off ({layers} configured)"
    return None


def layout_world(cfg: Config, device: torch.device) -> tuple[int | None, str]:
    """The processes the per-rank memory of the parallel layouts is worth estimating for, and what
    they are: the run's own when it has several (parallel.nproc, torchrun's WORLD_SIZE), else the
    GPUs of this machine when it has more than one; (None, "") for one process on one device, where
    the figures would mean nothing."""
    if (world := world_size_of(cfg)) > 1:
        return world, f"the run's {world} processes"
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return (gpus, f"this machine's {gpus} GPUs") if gpus > 1 else (None, "")


def _expected_vocab(cfg: Config) -> int | None:
    """The data's vocabulary before it is prepared; a model folder's tokenizer.json knows its own."""
    if cfg.data.tokenizer is TokenizerKind.pretrained:
        return pretrained_tokenizer(cfg.data).vocab_size
    return expected_data_vocab(cfg.data)


def _estimated_train_tokens(cfg: Config) -> int | None:
    """Bytes of the source (one token per byte), less the validation share; None if unreadable."""
    try:
        files = source_files(cfg.data)
        size = sum(f.path.stat().st_size for f in files)
    except (OSError, UserError):
        return None
    if not files:  # data=hf: the size is known once prepared
        return None
    if cfg.data.max_bytes is not None:
        size = min(size, cfg.data.max_bytes)
    return int(size * (1 - cfg.data.val_fraction))
