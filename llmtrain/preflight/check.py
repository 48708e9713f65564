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
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from llmtrain.config.derived import (
    accumulation_steps,
    default_lr,
    effective_lr,
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
)
from llmtrain.core.errors import UserError
from llmtrain.data import quality
from llmtrain.data.cache import source_files
from llmtrain.engine.precision import native_bf16
from llmtrain.engine.schedule import final_lr, held_lr_text
from llmtrain.engine.step import evaluate
from llmtrain.model import GPT
from llmtrain.preflight.estimate import (
    estimate_memory,
    format_bytes,
    format_seconds,
    largest_fitting_micro_batch,
    model_shape,
)
from llmtrain.preflight.facts import MEMORY_WARN_FRACTION, TOKENS_PER_PARAM, Facts, gather_facts
from llmtrain.preflight.parameters import WITHOUT_EMBEDDINGS

EXIT_PASS, EXIT_WARN, EXIT_FAIL = 0, 1, 2
# An explicit model.vocab_size this many times the data's vocabulary (and 64+ ids above it) warns:
# the unused rows cost weights, optimizer state and, above all, logits memory and head FLOPs.
VOCAB_WASTE_FACTOR = 2


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


