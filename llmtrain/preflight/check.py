"""The pre-flight checklist: settings that make training stable, plus static checks of the model
and data (docs/checklist.md says where each item comes from).

`run_check(cfg)` looks at a validated config and this machine and returns one row per item: PASS,
WARN or FAIL, the value it saw, one line on why it matters, and the override that fixes it.
`llmtrain check` prints the table (exit 0 all pass, 1 warnings, 2 failures); `llmtrain train` runs
the same check before any work and refuses to start on a FAIL unless allow_check_failures=true.

Each item is a small function of (config, facts); facts are what the machine and the data say
(device, precision, token counts, the memory and compute estimates).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmtrain.config.derived import (
    accumulation_steps,
    default_lr,
    effective_lr,
    expected_data_vocab,
    init_gain,
    lr_defaulted,
    model_vocab_size,
    resolved_warmup_steps,
    sane_lr_range,
    schedule_steps,
    seq_len_of,
    total_steps,
    world_size_of,
)
from llmtrain.config.schema import (
    Config,
    DataSource,
    HeadInit,
    NormPosition,
    OptimizerName,
    Precision,
    ResidualInit,
    TokenizerKind,
)
from llmtrain.data import quality
from llmtrain.data.prepare import cached_meta, pretrained_tokenizer, source_files
from llmtrain.distributed.layout import resolve_device
from llmtrain.errors import UserError
from llmtrain.model import GPT
from llmtrain.model_tensors import model_tensors
from llmtrain.preflight.estimate import (
    ComputeEstimate,
    MemoryEstimate,
    ModelShape,
    available_memory,
    data_page_bytes,
    estimate_compute,
    estimate_memory,
    format_bytes,
    format_seconds,
    largest_fitting_micro_batch,
    model_shape,
    runtime_bytes,
)
from llmtrain.preflight.parameters import WITHOUT_EMBEDDINGS, ParameterCounts, parameter_counts
from llmtrain.sinks import default_console
from llmtrain.training.precision import native_bf16, resolve_precision
from llmtrain.training.schedule import final_lr, held_lr_text
from llmtrain.training.step import evaluate

EXIT_PASS, EXIT_WARN, EXIT_FAIL = 0, 1, 2
MEMORY_WARN_FRACTION = 0.85  # above this share of the free memory, fragmentation and spikes can OOM
# An explicit model.vocab_size this many times the data's vocabulary (and 64+ ids above it) warns:
# the unused rows cost weights, optimizer state and, above all, logits memory and head FLOPs.
VOCAB_WASTE_FACTOR = 2
TOKENS_PER_PARAM = 20  # compute-optimal training (Chinchilla): ~20 tokens per parameter without embeddings


class Status(str, Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass
class Row:
    item: str
    status: Status
    seen: str
    why: str
    fix: str = ""


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


class CheckFailed(UserError):
    """The pre-flight check found FAIL rows and the user did not allow them."""

    def __init__(self, message: str, report: CheckReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class CheckReport:
    rows: list[Row]
    facts: Facts

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.status is Status.FAIL]

    @property
    def warnings(self) -> list[Row]:
        return [r for r in self.rows if r.status is Status.WARN]

    @property
    def exit_code(self) -> int:
        return EXIT_FAIL if self.failures else EXIT_WARN if self.warnings else EXIT_PASS

    def row(self, item: str) -> Row:
        return next(r for r in self.rows if r.item == item)

    def refusal(self) -> str:
        names = ", ".join(f"{r.item} ({r.seen})" for r in self.failures)
        fixes = "; ".join(f"{r.item}: {r.fix}" for r in self.failures if r.fix)
        return (
            f"the pre-flight check failed on {len(self.failures)} item(s): {names}. Fix: {fixes}. "
            "To train anyway, add allow_check_failures=true (the rows above say what will go wrong)."
        )


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
        data_vocab, train_tokens, itemsize = int(meta["vocab_size"]), int(meta["train_tokens"]), 2 if meta["dtype"] == "uint16" else 4
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


# ---------------------------------------------------------------------------------------------
# The items
# ---------------------------------------------------------------------------------------------


def check_data_content(cfg: Config, facts: Facts) -> Row | None:
    """Data that is not text (NUL bytes, whitespace only, one repeated token, binary files, text in
    another encoding): warn, naming the files. From the prepared data's meta; before it is
    prepared, from the first MB of each text file."""
    meta = facts.data_meta
    if meta is None and cfg.data.source is DataSource.python_stdlib:
        return Row("data content", Status.PASS, "Python's own sources (judged in full once prepared)",
                   "The embedded default corpus is ordinary text.")
    if meta is None:
        sampled = _sampled_degenerate_files(cfg)
        if sampled is None:
            return None  # not text files, or unreadable: judged once the data is prepared
        files, count = sampled
        seen = f"not prepared yet: the first {quality.SAMPLE_BYTES // 2**20} MB of each file look like text"
    else:
        files, count = meta.get("degenerate_files", []), int(meta.get("degenerate_file_count", 0))
        seen = (f"unigram entropy {float(meta['unigram_entropy_nats']):.2f} nats/token"
                + (f", most common token {meta['dominant_token']} {float(meta['dominant_token_share']):.0%}"
                   if "dominant_token_share" in meta else ""))
    why = ("Data that is not text teaches a text model nothing it will use: near-constant files (NUL bytes, only "
           "whitespace, one token repeated) train to a loss that looks fine, binary or wrongly encoded files to "
           "noise.")
    fix = "remove or replace the named file(s), or convert them to UTF-8 as each one says"
    problems = [quality.describe(f) for f in files]
    if count > len(files):
        problems.append(f"and {count - len(files)} more file(s)")
    if not problems and meta is not None:  # no file stands out: the corpus as a whole may
        problems = _corpus_problems(meta)
    if problems:
        return Row("data content", Status.WARN, "; ".join(problems), why, fix)
    return Row("data content", Status.PASS, seen, why)


def _corpus_problems(meta: dict) -> list[str]:
    """The prepared train split as a whole: near-constant tokens, one token dominating."""
    found = []
    entropy = float(meta.get("unigram_entropy_nats", math.inf))
    share = float(meta.get("dominant_token_share", 0.0))
    if entropy < quality.LOW_ENTROPY_NATS:
        found.append(f"the train split's unigram entropy is {entropy:.2f} nats/token (text has ~2-5)")
    if share > quality.DOMINANT_SHARE:
        found.append(f"one token, {meta.get('dominant_token', '?')}, is {share:.0%} of the train tokens")
    if float(meta.get("replacement_share", 0.0)) > quality.REPLACEMENT_SHARE:
        found.append(f"{float(meta['replacement_share']):.0%} of the characters are undecodable (U+FFFD)")
    return found


def _sampled_degenerate_files(cfg: Config) -> tuple[list[dict], int] | None:
    """Degenerate files among a not yet prepared text corpus, judged on a sample of each file."""
    if cfg.data.source is not DataSource.text:
        return None
    try:
        return quality.sample_degenerate_files([(f.name, f.path) for f in source_files(cfg.data)])
    except (OSError, UserError):
        return None


def check_data_order(cfg: Config, facts: Facts) -> Row:
    d = cfg.data
    seed = d.seed if d.seed is not None else cfg.seed
    order = "epochs (new order each epoch)" if d.sampling.value == "epoch" else f"random windows, shuffle={str(d.shuffle).lower()}"
    seen = f"{order}, data seed {seed if seed is not None else 'drawn at random'}" + (
        f", overfit_batches={d.overfit_batches}" if d.overfit_batches else "")
    why = "Unshuffled data gives correlated batches and a biased path; an unfixed seed makes the order unrepeatable."
    if d.overfit_batches:
        return Row("data order", Status.WARN, seen, "A debugging run: it replays the same batches and cannot generalize.",
                   "data.overfit_batches=0 for real training")
    if not d.shuffle and d.sampling.value == "random":
        return Row("data order", Status.WARN, seen, why, "data.shuffle=true")
    if seed is None:
        return Row("data order", Status.WARN, seen, why, "seed=1337 (or data.seed=N)")
    return Row("data order", Status.PASS, seen, why)


def check_warmup(cfg: Config, facts: Facts) -> Row:
    # Warmup is a share of the LR schedule, which schedule.total_steps may make other than the run.
    total = schedule_steps(cfg)
    own = cfg.schedule.total_steps is not None
    warmup = resolved_warmup_steps(cfg.schedule, total)
    share = warmup / max(1, total)
    of = f"the schedule's {total}" if own else f"{total}"
    seen = f"{warmup} of {of} steps ({share:.1%})"
    why = "Early gradients of a random model are large and unreliable; a full LR on them can push weights to extremes."
    suggestion = f"schedule.warmup_steps={max(1, round(0.05 * total))} (5% of the {'schedule' if own else 'run'})"
    if warmup == 0:
        return Row("warmup", Status.WARN, "none", why, suggestion)
    if 0.01 <= share <= 0.10:
        return Row("warmup", Status.PASS, seen, why)
    if share < 0.01 and warmup >= 500:  # long runs: a few hundred steps settle the early updates
        return Row("warmup", Status.PASS, f"{seen}, >= 500 steps", why)
    if share < 0.01:
        return Row("warmup", Status.WARN, seen + " - short", why, suggestion)
    return Row("warmup", Status.WARN, seen + " - long: the run spends it below its LR",
               "Beyond ~10% warmup wastes steps at a low LR.", suggestion)


def check_schedule_length(cfg: Config, facts: Facts) -> Row | None:
    """A WARN when the LR schedule (schedule.total_steps) ends before the run and the rest of the run
    sits at a lower LR; no row otherwise, so the table of a run its schedule covers is unchanged."""
    run_steps, steps = total_steps(cfg), schedule_steps(cfg)
    peak = effective_lr(cfg)
    held = final_lr(peak, steps, cfg.schedule)
    if steps >= run_steps or held >= peak:  # covers the run, or holds the peak (constant): nothing lost
        return None
    seen = f"ends at step {steps:,} of {run_steps:,}: the last {run_steps - steps:,} steps at {held_lr_text(held, peak)}"
    why = ("Past its end the schedule holds its final LR: the rest of the run costs full compute at the floor (at LR 0 "
           "it trains nothing); usually a schedule left from a shorter run.")
    return Row("schedule length", Status.WARN, seen, why, "schedule.total_steps=null")


def check_clipping(cfg: Config, facts: Facts) -> Row:
    o = cfg.optim
    why = ("Clipping caps the update when one batch's gradient explodes; common values are 1.0-5.0 (PASS: 0.5-10).")
    if o.clip_grad_value is not None:
        return Row("gradient clipping", Status.WARN, f"by value {o.clip_grad_value:g}",
                   "Per-element clipping changes the gradient's direction; clipping the norm keeps it.",
                   "optim.clip_grad_value=null optim.clip_grad_norm=1.0")
    if o.clip_grad_norm is None:
        return Row("gradient clipping", Status.WARN, "off", why, "optim.clip_grad_norm=1.0")
    seen = f"norm {o.clip_grad_norm:g}"
    if o.clip_grad_norm < 0.5:
        return Row("gradient clipping", Status.WARN, seen + " - tight: clips almost every step and slows learning", why,
                   "optim.clip_grad_norm=1.0")
    if o.clip_grad_norm > 10:
        return Row("gradient clipping", Status.WARN, seen + " - loose: barely ever clips", why, "optim.clip_grad_norm=1.0")
    return Row("gradient clipping", Status.PASS, seen, why)


def check_precision(cfg: Config, facts: Facts) -> Row:
    p, device = cfg.precision, facts.device
    chosen = facts.precision
    seen = chosen.value + (" (auto)" if p.name is Precision.auto else "") + f" on {device.type}"
    if chosen is Precision.fp16:
        seen += ", dynamic loss scaling" if p.loss_scaling else ", NO loss scaling"
    if chosen is Precision.fp16 and not p.loss_scaling:
        return Row("mixed precision", Status.FAIL, seen,
                   "fp16 has 5 exponent bits: without a dynamic loss scale small gradients underflow to zero and large "
                   "ones overflow to inf.", "precision.loss_scaling=true (or precision=bf16)")
    if device.type == "cuda":
        bf16_ok = native_bf16()
        if chosen is Precision.fp32:
            return Row("mixed precision", Status.WARN, seen,
                       "bf16/fp16 halve activation memory and run on tensor cores (~30%+ faster).",
                       "precision=auto" if bf16_ok else "precision=fp16")
        if chosen is Precision.bf16 and not bf16_ok:
            return Row("mixed precision", Status.FAIL, seen, "This GPU has no bf16 support.", "precision=fp16")
        return Row("mixed precision", Status.PASS, seen, "Mixed precision halves activation memory on this GPU.")
    if chosen is not Precision.fp32:
        return Row("mixed precision", Status.WARN, seen,
                   f"No fast low-precision matmuls on {device.type} here: autocast measured ~0.65x the fp32 speed.",
                   "precision=fp32 (or precision=auto)")
    return Row("mixed precision", Status.PASS, seen, f"fp32 is the fastest on {device.type}; mixed precision pays on GPUs.")


def check_memory(cfg: Config, facts: Facts) -> Row:
    mem, budget = facts.memory, facts.memory_budget
    share = mem.peak / budget
    seen = f"peak {format_bytes(mem.peak)} of {format_bytes(budget)} ({share:.0%}, {facts.memory_source})"
    why = "Weights, gradients, optimizer state and activations must fit, or the run dies (OOM) after its set-up."
    if share <= MEMORY_WARN_FRACTION:
        return Row("memory", Status.PASS, seen, why)
    return Row("memory", Status.FAIL if share > 1 else Status.WARN, seen, why, memory_fixes(cfg, facts))


def memory_fixes(cfg: Config, facts: Facts) -> str:
    """Overrides that bring the peak under the budget, each with its predicted peak."""
    budget = facts.memory_budget * MEMORY_WARN_FRACTION
    mem = facts.memory
    common = dict(runtime_bytes=mem.runtime, data_bytes=mem.data)
    fixes = []
    micro = largest_fitting_micro_batch(cfg, facts.shape, facts.vocab_size, facts.device.type, facts.precision,
                                        budget, **common)
    if micro is not None and micro < cfg.micro_batch_size:
        accum = cfg.global_batch_size // micro
        fixes.append(f"micro_batch_size={micro} (accumulation {accum} keeps the global batch {cfg.global_batch_size})")
    if not cfg.model.activation_checkpointing:
        alt = copy.deepcopy(cfg)
        alt.model.activation_checkpointing = True
        peak = estimate_memory(alt, facts.shape, facts.vocab_size, facts.device.type, facts.precision, **common).peak
        fixes.append(f"model.activation_checkpointing=true (peak {format_bytes(peak)})")
    if cfg.optim.name in (OptimizerName.adamw, OptimizerName.adam):
        fixes.append(f"optim=adafactor (factored state: {format_bytes(mem.optimizer)} -> "
                     f"{format_bytes(_adafactor_state_bytes(cfg, facts))})")
    if facts.device.type == "cuda" and facts.precision is Precision.fp32:
        fixes.append("precision=auto (halves activations)")
    fixes.append("or shard weights/state across devices (ZeRO/FSDP)")
    return "; ".join(fixes)


def _adafactor_state_bytes(cfg: Config, facts: Facts) -> float:
    alt = copy.deepcopy(cfg)
    alt.optim.name = OptimizerName.adafactor
    return 4.0 * model_shape(alt, facts.vocab_size).optimizer_state_elements


def check_train_mode(cfg: Config, facts: Facts) -> Row:
    """Run llmtrain's own train/eval switching on a one-block copy of the model: training must be
    in train mode (dropout active), evaluation in eval mode (deterministic), and train mode must
    come back after an evaluation."""
    problems = verify_train_eval_modes(cfg)
    dropout = cfg.model.dropout
    seen = f"dropout {dropout:g}; " + ("train/eval switching verified" if not problems else "; ".join(problems))
    why = "Dropout left on in eval (or off in training) makes evaluation noisy and training differ from what was tuned."
    if problems:
        return Row("train/eval mode", Status.FAIL, seen, why, "a code bug: report it (llmtrain's evaluate() must restore train mode)")
    if dropout > 0.3:
        return Row("train/eval mode", Status.WARN, seen + " - high for language-model pre-training",
                   "Dropout above ~0.2 mostly slows pre-training, which rarely overfits.", "model.dropout=0.1")
    return Row("train/eval mode", Status.PASS, seen, why)


def verify_train_eval_modes(cfg: Config) -> list[str]:
    small = copy.deepcopy(cfg.model)
    small.n_layer, small.block_size = 1, min(cfg.model.block_size, 16)
    small.n_head = 2 if cfg.model.n_embd % 2 == 0 and (cfg.model.n_embd // 2) % 2 == 0 else 1
    small.n_embd = 16 * small.n_head
    small.n_kv_head, small.intermediate_size, small.init_from = None, None, None
    small.dropout = max(cfg.model.dropout, 0.1)  # something to switch on and off
    small.activation_checkpointing = False
    # The mode switching is under test, not the init: a zero head or zero residual branches would
    # make every output equal whether dropout is on or not.
    small.init, small.init_std, small.residual_init = "normal_0.02", 0.02, ResidualInit.scaled
    small.head_init, small.tie_weights = HeadInit.plain, True
    generator_state = torch.random.get_rng_state()
    try:
        model = GPT(small, 32)
        model.train()
        x = torch.randint(0, 32, (2, small.block_size), generator=torch.Generator().manual_seed(0))
        problems = []
        if not all(m.training for m in model.modules()):
            problems.append("a module is not in train mode after model.train()")
        with torch.no_grad():
            if torch.equal(model(x), model(x)):
                problems.append("dropout is not active in train mode")
        evaluate(model, [(x, x)], torch.device("cpu"), lambda: torch.autocast("cpu", enabled=False))
        if not model.training:
            problems.append("evaluation left the model in eval mode")
        model.eval()
        with torch.no_grad():
            if not torch.equal(model(x), model(x)):
                problems.append("eval mode is not deterministic")
        return problems
    finally:
        torch.random.set_rng_state(generator_state)  # checking must not move the run's RNG


def check_seed(cfg: Config, facts: Facts) -> Row:
    why = "A fixed seed makes init, dropout and data order repeatable: a rerun tells a bug from noise."
    if cfg.seed is None:
        return Row("global seed", Status.WARN, "none (drawn at random, logged)", why, "seed=1337")
    extra = ", deterministic algorithms" if cfg.deterministic else ""
    if facts.device.type == "cuda" and not cfg.deterministic:
        extra = " (GPU kernels may still differ run to run: deterministic=true or preset=reproducible)"
    return Row("global seed", Status.PASS, f"{cfg.seed}{extra}", why)


def check_effective_batch(cfg: Config, facts: Facts) -> Row:
    accum = accumulation_steps(cfg)
    seq = seq_len_of(cfg)
    tokens = cfg.global_batch_size * seq
    world = world_size_of(cfg)
    seen = (f"{cfg.global_batch_size} seq x {seq} = {tokens:,} tokens/step "
            f"(micro {cfg.micro_batch_size} x accumulation {accum} x {world} process{'es' if world > 1 else ''})")
    why = "The batch the optimizer sees sets the gradient noise and the right LR; accumulation must not change it."
    if facts.train_tokens is not None and tokens > facts.train_tokens:
        return Row("effective batch", Status.WARN, seen + f" > the {facts.train_tokens:,} train tokens",
                   "Each step sees the whole training set more than once.", "a smaller global_batch_size, or more data")
    if accum > 64:
        micro = facts.fitting_micro_batch or max(d for d in range(1, cfg.global_batch_size // 8 + 1)
                                                 if cfg.global_batch_size % d == 0)
        return Row("effective batch", Status.WARN, seen, "Over 64 micro-batches per step: the micro-batch is probably "
                   "too small to use the device.", f"micro_batch_size={micro}")
    return Row("effective batch", Status.PASS, seen, why)


def suggested_lr(cfg: Config) -> tuple[float, float]:
    """(low, high) sane peak LRs for the optimizer and, for Adam-like ones, the model width."""
    return sane_lr_range(cfg.optim.name, cfg.model.n_embd)


def check_learning_rate(cfg: Config, facts: Facts) -> Row:
    lr = effective_lr(cfg)
    low, high = suggested_lr(cfg)
    name = cfg.optim.name.value + (", the default" if lr_defaulted(cfg) else "")
    seen = f"{lr:g} ({name}" + (f", {cfg.schedule.lr_scaling.value}-scaled from {cfg.optim.lr:g}" if lr != cfg.optim.lr else "") + ")"
    why = "Too high diverges (NaN after warmup); too low stalls. The sane range depends on the optimizer and the width."
    adam_like = cfg.optim.name in (OptimizerName.adamw, OptimizerName.adam)
    # The fix is what optim.lr=null would give (the same function sets the default), undoing lr_scaling.
    fix = f"optim.lr={_round_lr(default_lr(cfg.optim.name, cfg.model.n_embd) * cfg.optim.lr / lr)}"
    if (adam_like and lr >= 0.05) or (not adam_like and lr >= 10 * high):
        return Row("learning rate", Status.FAIL, seen + " - diverges", why, fix)
    if lr > high or lr < low:
        width = f" for a {cfg.model.n_embd}-wide model" if adam_like else ""
        return Row("learning rate", Status.WARN, f"{seen} outside {low:.1g}-{high:.1g}{width}", why, fix)
    return Row("learning rate", Status.PASS, seen, why)


def _round_lr(lr: float) -> str:
    return f"{float(f'{lr:.1g}'):g}"


def check_vocabulary(cfg: Config, facts: Facts) -> Row:
    """An explicit model.vocab_size far above the data's: rows no token uses, paid for in every step."""
    data = facts.data_vocab
    model = facts.vocab_size
    origin = ("model.vocab_size" if cfg.model.vocab_size is not None
              else f"the data's, padded to a multiple of {cfg.model.vocab_multiple}")
    seen = f"{model:,} ids ({origin}); the data has " + (f"{data:,}" if data is not None else "an unknown number")
    why = "The model needs an id for every token of the data; each id beyond costs weights, optimizer state and logits."
    if data is None or cfg.model.vocab_size is None or model < VOCAB_WASTE_FACTOR * data or model - data < 64:
        return Row("vocabulary", Status.PASS, seen, why)
    unused = model - data
    # what the data's own vocabulary would cost, padded as gpt_small pads it
    lean_model = dataclasses.replace(cfg.model, vocab_size=None, vocab_multiple=64)
    padded = model_vocab_size(dataclasses.replace(cfg, model=lean_model), data)
    lean_shape = model_shape(cfg, padded)
    lean = estimate_memory(cfg, lean_shape, padded, facts.device.type, facts.precision,
                           runtime_bytes=facts.memory.runtime, data_bytes=facts.memory.data)
    extra = facts.memory.peak - lean.peak
    rows = unused * cfg.model.n_embd * (1 if cfg.model.tie_weights else 2)
    flops = 1 - lean_shape.flops_per_token / facts.shape.flops_per_token
    return Row("vocabulary", Status.WARN, f"{seen}: {unused:,} ids are never used",
               f"They add {rows:,} parameters and ~{format_bytes(max(0.0, extra))} to the peak memory (logits, "
               f"weights, gradients, optimizer state), and {flops:.0%} of each step's FLOPs.",
               f"model.vocab_size=null model.vocab_multiple=64 ({padded:,} ids)")


def check_residual_norm(cfg: Config, facts: Facts) -> Row:
    m = cfg.model
    seen = f"{m.norm_position.value}-{m.norm.value}, {m.n_layer} blocks, residual on attention and MLP"
    why = "Pre-LN lets gradients flow straight through the residual path; post-LN must pass every norm."
    if m.norm_position is NormPosition.post and m.n_layer >= 6:
        return Row("residual / norm", Status.WARN, seen, why + " Deep post-LN stacks need long warmup and small LRs.",
                   "model.norm_position=pre")
    return Row("residual / norm", Status.PASS, seen, why)


def check_init(cfg: Config, facts: Facts) -> Row:
    m = cfg.model
    if m.init_from is not None:  # the random init is overwritten before the first step: nothing to judge
        return Row("init variance", Status.PASS, f"weights from {m.init_from}",
                   "A pretrained checkpoint's weights replace the random init, so its variance does not matter.")
    gain = init_gain(m)  # output variance of a matmul on unit-variance inputs
    seen = (f"normal std {m.init_std:g}: fan-in x std^2 = {gain:.2f}" if m.init == "normal_0.02"
            else f"{m.init}: fan-in x var = {gain:.2f}")
    seen += f"; residual outputs {m.residual_init.value}"
    why = "Each layer's output variance is fan-in x weight variance: far above 1 explodes, far below vanishes."
    if gain > 2.5:
        return Row("init variance", Status.WARN, seen + " - activations grow layer by layer", why,
                   f"model.init_std={_round_lr(math.sqrt(1 / m.n_embd))}")
    if gain < 0.005:
        return Row("init variance", Status.WARN, seen + " - signals vanish", why,
                   f"model.init_std={_round_lr(math.sqrt(1 / m.n_embd))}")
    if m.residual_init is ResidualInit.plain and m.n_layer >= 12:
        return Row("init variance", Status.WARN, seen, "With plain residual outputs the stream's variance grows with "
                   "depth (2 branches per block).", "model.residual_init=scaled")
    return Row("init variance", Status.PASS, seen, why)


def check_token_budget(cfg: Config, facts: Facts) -> Row:
    steps = total_steps(cfg)
    tokens = steps * cfg.global_batch_size * seq_len_of(cfg)
    n = facts.parameters.without_embeddings
    per_param = facts.parameters.tokens_per_param(tokens)
    seen = f"{tokens:,} tokens for {n:,} parameters {WITHOUT_EMBEDDINGS} = {per_param:.1f} tokens/param"
    why = f"Compute-optimal training is ~{TOKENS_PER_PARAM} tokens per parameter; far fewer undertrains, many epochs overfit."
    if facts.train_tokens:
        epochs = tokens / facts.train_tokens
        seen += f", {epochs:.2g} epochs"
        if epochs > 20 and not cfg.data.overfit_batches:
            return Row("token budget", Status.WARN, seen, "Over 20 passes over the data: the model memorizes it.",
                       "more data, or fewer steps")
    if per_param < 1:
        more = (f"max_tokens={TOKENS_PER_PARAM * n}" if cfg.max_tokens is not None
                else f"max_steps={max(steps, int(TOKENS_PER_PARAM * n / max(1, tokens / steps)))}")
        return Row("token budget", Status.WARN, seen, why, f"{more} ({TOKENS_PER_PARAM} tokens/param) or a smaller model")
    return Row("token budget", Status.PASS, seen, why)


def check_run_time(cfg: Config, facts: Facts) -> Row | None:
    c = facts.compute
    if c is None:
        return None
    seen = (f"~{format_seconds(c.step_seconds)}/step, ~{format_seconds(c.run_seconds)} in all "
            f"({c.matmul_flops / 1e9:,.0f} GFLOP/s measured x {c.assumed_mfu:.0%} assumed MFU)")
    why = "Know the cost before starting: a run that takes days here belongs on a faster device."
    if c.run_seconds > 8 * 3600:  # longer than a night on this device
        return Row("run time", Status.WARN, seen, why, "a GPU (device=cuda), a smaller model, or fewer steps")
    return Row("run time", Status.PASS, seen, why)


ITEMS: list[Callable[[Config, Facts], Row | None]] = [
    check_data_content, check_data_order, check_warmup, check_schedule_length, check_clipping, check_precision,
    check_memory, check_train_mode, check_seed, check_effective_batch, check_learning_rate, check_vocabulary,
    check_residual_norm, check_init, check_token_budget, check_run_time,
]


def run_check(cfg: Config, measure_compute: bool = True, data_meta: dict | None = None,
              matmul_flops: float | None = None) -> CheckReport:
    """The checklist for `cfg` on this machine; `matmul_flops` (FLOP/s) gives the compute estimate's
    device rate instead of measuring it, as tests do: a busy machine reads low and must not decide
    what a test sees."""
    facts = gather_facts(cfg, measure_compute=measure_compute, data_meta=data_meta, matmul_flops=matmul_flops)
    rows = [row for item in ITEMS if (row := item(cfg, facts)) is not None]
    return CheckReport(rows, facts)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red"}


def render(report: CheckReport, console: Console | None = None, estimates: bool = True) -> None:
    console = console or default_console()  # piped: a wide table, no padding, unwrapped lines
    table = Table(title="llmtrain check: pre-flight checklist", title_justify="left")
    for name, kwargs in (("item", {"no_wrap": True}), ("", {"no_wrap": True}), ("seen", {"ratio": 3}),
                         ("why it matters", {"ratio": 4}), ("fix", {"ratio": 3})):
        table.add_column(name, **kwargs)
    for r in report.rows:
        table.add_row(r.item, f"[{_STYLE[r.status]}]{r.status.value}[/]", r.seen, r.why, r.fix)
    console.print(table)
    if estimates:
        console.print(estimate_summary(report.facts))
    counts = {s: sum(r.status is s for r in report.rows) for s in Status}
    console.print(f"{counts[Status.PASS]} pass, {counts[Status.WARN]} warn, {counts[Status.FAIL]} fail "
                  f"-> exit {report.exit_code}")


def render_refusal(report: CheckReport, console: Console, full_table: str) -> None:
    """What a refused start prints: the FAIL rows only, how many rows were not shown, and
    `full_table`, the command that prints them all with the estimates (`check_command_line`). The
    whole table is ~180 columns of mostly passing rows; the refusal is about the failing ones."""
    failures, warnings = report.failures, report.warnings
    passed = len(report.rows) - len(failures) - len(warnings)
    hidden = ", ".join(f"{n} {label}" for n, label in ((len(warnings), "warn"), (passed, "pass")) if n)
    console.print(f"[bold]pre-flight check[/]: [{_STYLE[Status.FAIL]}]FAIL[/] on {len(failures)} of {len(report.rows)} "
                  f"items{f' ({hidden} not shown)' if hidden else ''}")
    for r in failures:
        console.print(f"  [{_STYLE[Status.FAIL]}]FAIL[/] [bold]{escape(r.item)}[/]: {escape(r.seen)}")
        console.print(f"       why: {escape(r.why)}")
        if r.fix:
            console.print(f"       fix: {escape(r.fix)}")
    console.print(f"  the full table{' (the warnings too)' if warnings else ''}, with the memory and compute estimate:")
    console.print(f"    {escape(full_table)}", highlight=False)


def check_command_line(overrides: Sequence[str] | None, config_dir: str | None = None) -> str:
    """`llmtrain check` with a run's overrides, which composes the config the run was refused for:
    its run dir (hydra.*, out_dir) dropped, since check writes nothing. `overrides` None (a config
    built in code, not from a command line): the bare command, with a word on what to add."""
    if overrides is None:
        return "llmtrain check  (with the overrides that make this config)"
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/", "out_dir="))]
    return shlex.join(["llmtrain", "check", *(["-cd", config_dir] if config_dir else []), *kept])


def estimate_summary(facts: Facts) -> str:
    mem = facts.memory
    lines = [f"[bold]memory per process[/] ({facts.device}, {facts.precision.value}, micro-batch {mem.micro_batch_size}; "
             f"{facts.data_note}):"]
    lines += [f"  {name:<40} {format_bytes(value):>12}" for name, value in mem.rows() if value]
    lines.append(f"  {'predicted peak':<40} {format_bytes(mem.peak):>12}   budget {format_bytes(facts.memory_budget)} "
                 f"({facts.memory_source})")
    if facts.fitting_micro_batch is None:
        lines.append("  no micro-batch fits in 85% of the budget: see the memory row's fixes")
    else:
        lines.append(f"  largest micro-batch within 85% of the budget: {facts.fitting_micro_batch} "
                     f"(a divisor of the global batch; accumulation makes up the rest)")
    if facts.layout_world:
        lines.append(f"  per rank over {facts.layout_over}: "
                     + ", ".join(f"{name} {format_bytes(peak)}" for name, peak in facts.layout_peaks.items()))
    c = facts.compute
    if c is not None:
        lines += [
            "[bold]compute[/]:",
            f"  {c.flops_per_token / 1e6:,.1f} MFLOP/token (6N + attention) x {c.tokens_per_step:,} tokens/step; "
            f"{c.steps:,} steps",
            f"  this device: {c.matmul_flops / 1e9:,.0f} GFLOP/s fp32 matmul "
            f"({'measured now' if facts.rate_measured_now else 'measured before'}); at {c.assumed_mfu:.0%} MFU "
            f"~{format_seconds(c.step_seconds)}/step, ~{format_seconds(c.run_seconds)} for the run",
            f"  {c.tokens:,} tokens / {facts.parameters.without_embeddings:,} parameters {WITHOUT_EMBEDDINGS} = "
            f"{facts.parameters.tokens_per_param(c.tokens):.1f} tokens/param (~{TOKENS_PER_PARAM} is compute-optimal)",
        ]
    if facts.depth:
        lines.append(f"  {facts.depth}")
    return "\n".join(lines)
