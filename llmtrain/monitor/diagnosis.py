"""Differential diagnosis: an alarm's possible causes, ranked by the evidence of this run.

An alarm says WHAT is wrong (a quantity left its band); which cause is behind it depends on the run.
Each alarm has a differential, the causes that can produce it (`DIFFERENTIAL`). Each cause is
scored from two kinds of evidence:

- the configuration (`RunFacts`, gathered once at start): the LR against the sane range for this
  optimizer and width, warmup, init variance, residual scaling, norm position, clipping, data order,
  weight decay, precision and scaler, the schedule's length;
- what the monitor saw (`Signals`, at the alarm): the update-to-weight ratio, the gradient norm,
  the loss against chance and the unigram baseline, which blocks are concerned.

A score is a likelihood in [0, 1]; a cause the evidence contradicts is left out (no "raise the LR"
while the LR is above its sane range). Causes come out most likely first, each with the evidence
that ranked it and a fix. The fixes of configuration causes are the pre-flight check's own (the
rows of `llmtrain check`), so the check and the alarm never advise differently.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmtrain.config.derived import (
    INIT_GAIN_HIGH,
    INIT_GAIN_LOW,
    REFERENCE_BATCH_TOKENS,
    batch_scaled_lr,
    init_gain,
    resolved_warmup_steps,
    run_default_lr,
    run_lr_range,
)
from llmtrain.config.schema import ADAM_FAMILY, Config, NormPosition, ResidualInit
from llmtrain.core.findings import Finding
from llmtrain.model_tensors import model_tensors

# Update-to-weight ratio ||dW|| / ||W|| per step, as evidence (the alarm bands are monitor keys):
# measured on gpt_tiny at the default LR 3e-3 it falls from ~1.5e-2 early to ~1.5e-3 by step 300;
# at 10x the LR it starts at 0.11. Above UPDATE_RATIO_HIGH the updates are large for any point of a
# healthy run, below UPDATE_RATIO_LOW they are too small to learn.
UPDATE_RATIO_HIGH = 5e-2
UPDATE_RATIO_LOW = 1e-5


@dataclass(frozen=True)
class RunFacts:
    """What the configuration says about the run, for ranking causes (all plain numbers/strings)."""

    lr: float = 0.0  # the peak LR the schedule uses
    lr_low: float = 0.0  # the sane range for this optimizer and width (as `check` computes it)
    lr_high: float = math.inf
    optimizer: str = "adamw"
    n_embd: int = 0
    n_layer: int = 0
    warmup_steps: int = -1  # -1: unknown
    total_steps: int = 0
    schedule_steps: int = 0  # the LR schedule's length (may end before the run)
    schedule_floor: float = 0.0  # the LR once the schedule has ended
    init_gain: float = math.nan  # fan-in x init variance (healthy ~0.05 to 2)
    init_std: float = math.nan  # NaN for a scheme without one (xavier, kaiming)
    init_scheme: str = "normal_0.02"
    residual_scaled: bool = True
    post_ln: bool = False
    bias: bool = False
    clip: float | None = 1.0
    shuffled: bool = True
    weight_decay: float = 0.0
    eps: float = 1e-8  # Adam's epsilon (adam, adamw)
    momentum: float = 0.9  # SGD's
    beta2: float = 0.95  # Adam's second-moment decay
    label_smoothing: float = 0.0
    dropout: float = 0.0
    n_params: int = 0  # the model's parameters: a gradient element's typical size is the norm over its root
    tokens_per_step: int = 0  # the global batch's tokens
    default_lr: float = 0.0  # optim.lr=null's LR for this optimizer and width
    fp16_without_scaler: bool = False
    baseline: float = math.nan  # the unigram entropy of the training data (nats/token)
    chance: float = math.nan  # ln(vocabulary): the loss of a uniform guess
    fixes: dict[str, str] = field(default_factory=dict)  # pre-flight check item -> its suggested fix

    @property
    def lr_over(self) -> float:
        """How many times the sane maximum the LR is (< 1: inside)."""
        return self.lr / self.lr_high if self.lr_high > 0 else 0.0

    @property
    def lr_under(self) -> float:
        """How many times below the sane minimum the LR is (< 1: inside)."""
        return self.lr_low / self.lr if self.lr > 0 else math.inf


@dataclass
class Signals:
    """What the monitor saw up to the alarm."""

    step: int = 0
    grad_norm_peak: float = math.nan  # the largest gradient norm of the recent window
    grad_norm_floor: float = math.nan  # the smallest (pre-clip, as the peak) of the same window
    update_ratio: float | None = None  # the latest ||dW|| / ||W||
    blocks: list[int] = field(default_factory=list)  # the blocks the alarm concerns
    n_blocks: int = 0
    rising: bool = False  # the loss is trending up (a loss_rising episode is active)
    lr_applied: float = math.nan  # the LR in the optimizer at the alarm, and the schedule's for that step
    lr_schedule: float = math.nan
    overfit: str = ""  # what the overfitting rule saw at the last evaluation ("" when it saw nothing)
    best_val_step: int = 0  # the step of the best validation loss so far


@dataclass(frozen=True)
class Cause:
    cause: str  # a stable id, e.g. "lr_too_high"
    title: str
    evidence: str
    fix: str | None
    score: float

    def to_record(self) -> dict[str, Any]:
        return {"cause": self.cause, "title": self.title, "evidence": self.evidence, "fix": self.fix,
                "score": round(self.score, 3)}


def _g(value: float) -> str:
    return f"{value:.2g}"


def _times(factor: float) -> str:
    """'3.3x', '33x', '333x'."""
    return f"{factor:.1f}x" if factor < 10 else f"{factor:.0f}x"


def _ratio_text(s: Signals) -> str:
    if s.update_ratio is None:
        return ""
    return f"; update/weight ratio {s.update_ratio:.2g} (healthy: ~1e-2 early in training, ~1e-3 later)"


def _init_text(f: RunFacts) -> str:
    """'init std 1: fan-in x std^2 = 128' (or the scheme's gain)."""
    if math.isfinite(f.init_std):
        return f"init std {_g(f.init_std)}: fan-in x std^2 = {f.init_gain:.3g}"
    return f"init {f.init_scheme}: fan-in x variance = {f.init_gain:.3g}"


def _early(f: RunFacts, s: Signals) -> bool:
    """The alarm came in the first part of the run, where warmup matters."""
    return s.step <= max(100, 3 * max(f.warmup_steps, 0))


# ---- the causes: each returns (score, evidence), or None when the evidence rules it out ------------
Score = tuple[float, str] | None


def lr_too_high(f: RunFacts, s: Signals) -> Score:
    if f.lr < f.lr_low:
        return None
    high_updates = s.update_ratio is not None and s.update_ratio > UPDATE_RATIO_HIGH
    if f.lr_over > 1:
        # Each co-occurring sign of too large steps (large updates, a rising loss) adds to it.
        score = 0.5 + 0.4 * min(1.0, math.log10(f.lr_over)) + 0.05 * high_updates + 0.05 * s.rising
        return score, (
            f"LR {_g(f.lr)} is {_times(f.lr_over)} the sane maximum {_g(f.lr_high)} for {f.optimizer} at width "
            f"{f.n_embd}{_ratio_text(s)}")
    if high_updates:
        return 0.45, f"LR {_g(f.lr)} is inside the sane range, but{_ratio_text(s)[1:]}"
    return 0.15, f"LR {_g(f.lr)} is inside the sane range {_g(f.lr_low)}-{_g(f.lr_high)}"


def lr_too_low(f: RunFacts, s: Signals) -> Score:
    if f.lr > f.lr_high or (s.update_ratio is not None and s.update_ratio > UPDATE_RATIO_HIGH):
        return None
    low_updates = s.update_ratio is not None and s.update_ratio < UPDATE_RATIO_LOW
    if f.lr_under > 1:
        score = 0.5 + 0.4 * min(1.0, math.log10(f.lr_under) / 2)
        return score + (0.05 if low_updates else 0.0), (
            f"LR {_g(f.lr)} is {_times(f.lr_under)} below the sane minimum {_g(f.lr_low)} for {f.optimizer} at width "
            f"{f.n_embd}{_ratio_text(s)}")
    if low_updates:
        return 0.45, f"LR {_g(f.lr)} is inside the sane range, but{_ratio_text(s)[1:]}"
    return 0.1, f"LR {_g(f.lr)} is inside the sane range {_g(f.lr_low)}-{_g(f.lr_high)}"


def no_warmup(f: RunFacts, s: Signals) -> Score:
    if f.warmup_steps < 0 or f.lr < f.lr_low:
        return None
    if f.warmup_steps == 0 and _early(f, s):
        return 0.8, f"no warmup: the full LR {_g(f.lr)} from step 1; the alarm came at step {s.step}"
    length = f.schedule_steps or f.total_steps
    if f.warmup_steps < 0.01 * length and f.warmup_steps < 100 and _early(f, s):
        return 0.55, f"warmup of {f.warmup_steps} steps ({f.warmup_steps / max(1, length):.1%} of the schedule)"
    return None


def no_clipping(f: RunFacts, s: Signals) -> Score:
    if f.clip is not None:
        return None
    big = math.isfinite(s.grad_norm_peak) and s.grad_norm_peak > 1.0
    peak = f"; gradient norm up to {_g(s.grad_norm_peak)}" if math.isfinite(s.grad_norm_peak) else ""
    return (0.8 if big else 0.35), f"gradient clipping is off{peak}"


# A pre-clip norm this many times the threshold on every recent check: each update is cut to a
# tenth or less of its size, whatever the LR says.
CLIP_TIGHT_RATIO = 10.0


def clip_too_tight(f: RunFacts, s: Signals) -> Score:
    """Clipping scales every update down by the pre-clip norm over the threshold: measured, not assumed."""
    if f.clip is None or not math.isfinite(s.grad_norm_floor) or s.grad_norm_floor <= f.clip:
        return None
    ratio = s.grad_norm_floor / f.clip
    evidence = (f"every recent pre-clip gradient norm is at least {_g(s.grad_norm_floor)}, {_times(ratio)} the clip "
                f"threshold {_g(f.clip)}: each update is cut to 1/{ratio:.0f} or less of its size")
    return (0.9 if ratio >= CLIP_TIGHT_RATIO else 0.3), evidence


# RunFacts.optimizer is optim.name's value; torchao's 8-/4-bit AdamW divide by sqrt(v) + eps alike.
_ADAM_NAMES = tuple(name.value for name in ADAM_FAMILY)


def eps_too_large(f: RunFacts, s: Signals) -> Score:
    """Adam divides each update by sqrt(v) + eps, where sqrt(v) is about a gradient element's size:
    an epsilon as large as that element shrinks every update, whatever the LR says. The element's
    size is estimated from the largest recent (clipped) gradient norm spread over the parameters."""
    if f.optimizer not in _ADAM_NAMES or f.n_params <= 0 or not math.isfinite(s.grad_norm_peak):
        return None
    norm = s.grad_norm_peak if f.clip is None else min(s.grad_norm_peak, f.clip)
    element = norm / math.sqrt(f.n_params)
    if element <= 0:  # no gradient at all: epsilon shrinks nothing, another cause is at work
        return None
    ratio = f.eps / element
    if ratio < 1:
        return None
    evidence = (f"Adam epsilon {f.eps:g} is {_times(ratio)} a gradient element's typical size ({_g(element)}: the "
                f"norm {_g(norm)} over {f.n_params:,} parameters), so every update shrinks about "
                f"{1 + ratio:.0f}-fold")
    return (0.9 if ratio >= 10 else 0.5), evidence


# Below this Adam's second moment averages fewer than ~10 steps' squared gradients (1 / (1 - beta2)).
BETA2_LOW = 0.9


def beta2_too_low(f: RunFacts, s: Signals) -> Score:
    """A short second-moment average follows each batch's gradient size: after a few batches of small
    gradients the denominator is small, and the next ordinary gradient makes an outsized update."""
    if f.optimizer not in _ADAM_NAMES or f.beta2 >= BETA2_LOW:
        return None
    steps = 1 / max(1e-9, 1 - f.beta2)
    return (0.8 if f.beta2 < 0.5 else 0.6), (f"Adam beta2 {f.beta2:g} averages the squared gradients over only "
                                               f"~{steps:.0f} steps (usual 0.95-0.999: 20-1000), so a batch after "
                                               "small ones takes an outsized step")


def sgd_without_momentum(f: RunFacts, s: Signals) -> Score:
    if f.optimizer != "sgd" or f.momentum > 0:
        return None
    return 0.5, "SGD with momentum 0: each step follows one batch's noisy gradient (momentum 0.9 averages ~10)"


# Above these a small language model underfits: the usual values are 0-0.1 for both.
LABEL_SMOOTHING_HIGH = 0.2
DROPOUT_HIGH = 0.3


def over_regularized(f: RunFacts, s: Signals) -> Score:
    """Label smoothing spreads a share of every target over the whole vocabulary, so the loss cannot
    go below what that spread costs; dropout that high removes much of each layer's signal."""
    found = []
    if f.label_smoothing > LABEL_SMOOTHING_HIGH:
        found.append(f"label smoothing {f.label_smoothing:g} (usual 0-0.1): that share of every target is spread "
                     "over the whole vocabulary, so even a perfect model keeps a high loss")
    if f.dropout > DROPOUT_HIGH:
        found.append(f"dropout {f.dropout:g} (usual 0-0.2 for pre-training) drops that share of every layer's output")
    if not found:
        return None
    return (0.6 + 0.1 * (len(found) - 1)), "; ".join(found)


def _regularization_fix(f: RunFacts, s: Signals) -> str | None:
    fixes = (["optim.label_smoothing=0.0"] if f.label_smoothing > LABEL_SMOOTHING_HIGH else []) + (
        ["model.dropout=0.1"] if f.dropout > DROPOUT_HIGH else [])
    return " ".join(fixes) or None


# Below SMALL_BATCH_TOKENS a batch is small enough for gradient noise to be a likely cause.
SMALL_BATCH_TOKENS = 1024


def lr_for_batch(f: RunFacts) -> float:
    """The default LR scaled down to this batch by the root of its size (never up)."""
    return batch_scaled_lr(f.default_lr, f.tokens_per_step)


def batch_too_small(f: RunFacts, s: Signals) -> Score:
    """Gradient noise: with few tokens per step each gradient is one noisy draw, and an LR set for a
    larger batch follows the noise. Judged against the root-scaled default LR, not the sane range."""
    if not 0 < f.tokens_per_step < SMALL_BATCH_TOKENS or f.default_lr <= 0 or f.lr <= 0:
        return None
    over = f.lr / lr_for_batch(f)
    if over < 2:
        return None
    return 0.55 + 0.3 * min(1.0, math.log10(over)), (
        f"{f.tokens_per_step:,} tokens per step: a noisy gradient, and the LR {_g(f.lr)} is {_times(over)} what "
        f"such a batch bears ({_g(lr_for_batch(f))}, the default scaled by the root of the batch against "
        f"{REFERENCE_BATCH_TOKENS:,} tokens); or raise the batch (global_batch_size, with micro_batch_size for memory)")


def overfitting(f: RunFacts, s: Signals) -> Score:
    return (0.9, f"the gap is widening: {s.overfit}") if s.overfit else None


def init_too_large(f: RunFacts, s: Signals) -> Score:
    if not math.isfinite(f.init_gain) or f.init_gain < INIT_GAIN_LOW:
        return None
    if f.init_gain > INIT_GAIN_HIGH:
        return 0.85, f"{_init_text(f)} (healthy up to ~2): each layer multiplies the signal's variance"
    return 0.1, f"{_init_text(f)}, inside the healthy range"


def init_too_small(f: RunFacts, s: Signals) -> Score:
    if not math.isfinite(f.init_gain) or f.init_gain > INIT_GAIN_HIGH:
        return None
    if f.init_gain < INIT_GAIN_LOW:
        return 0.85, f"{_init_text(f)} (healthy from ~0.05): the signal vanishes layer by layer"
    return 0.1, f"{_init_text(f)}, inside the healthy range"


def residual_unscaled(f: RunFacts, s: Signals) -> Score:
    if f.residual_scaled:
        return None
    if f.n_layer >= 12:
        return 0.7, f"residual outputs not scaled down (model.residual_init=plain) in {f.n_layer} blocks"
    return 0.3, f"residual outputs not scaled down (model.residual_init=plain), {f.n_layer} blocks"


def post_ln(f: RunFacts, s: Signals) -> Score:
    if not f.post_ln:
        return None
    frozen = f", blocks {_blocks(s.blocks)} starved of gradient" if s.blocks and len(s.blocks) < s.n_blocks else ""
    if f.n_layer >= 6:
        return 0.8 + (0.1 if frozen else 0.0), f"post-LN in {f.n_layer} blocks{frozen}"
    return 0.4, f"post-LN ({f.n_layer} blocks){frozen}"


def too_deep(f: RunFacts, s: Signals) -> Score:
    if f.n_layer < 12:
        return None
    return 0.3, f"{f.n_layer} blocks"


def fp16_no_scaler(f: RunFacts, s: Signals) -> Score:
    if not f.fp16_without_scaler:
        return None
    return 0.95, "precision=fp16 with precision.loss_scaling=false"


def data_unshuffled(f: RunFacts, s: Signals) -> Score:
    if f.shuffled:
        return None
    return 0.85, "data.shuffle=false: consecutive windows in file order, so batches are correlated"


def weight_decay_too_high(f: RunFacts, s: Signals) -> Score:
    if f.weight_decay <= 0.1:
        return (0.15, f"weight decay {f.weight_decay:g} is in the usual range") if f.weight_decay > 0 else None
    score = 0.5 + 0.4 * min(1.0, math.log10(f.weight_decay / 0.1) / 2)
    return score, (f"weight decay {f.weight_decay:g} (usual 0.01-0.1): the weights shrink by "
                   f"{f.lr * f.weight_decay:.2%} per step at the peak LR")


def schedule_ended(f: RunFacts, s: Signals) -> Score:
    if not f.schedule_steps or f.schedule_steps >= f.total_steps:
        return None
    if s.step > f.schedule_steps:
        return 0.95, (f"the LR schedule ended at step {f.schedule_steps} of {f.total_steps}; since then the LR "
                      f"sits at {_g(f.schedule_floor)}")
    return 0.3, (f"the LR schedule ends at step {f.schedule_steps} of {f.total_steps} (this is step {s.step}); "
                 f"from there the LR sits at {_g(f.schedule_floor)}")


def lr_overwritten(f: RunFacts, s: Signals) -> Score:
    if not (s.lr_schedule > 0 and math.isfinite(s.lr_applied)):
        return None
    factor = s.lr_applied / s.lr_schedule
    if factor <= 1.1:
        return None  # the schedule's LR, or below it: the LR cuts of reduce_lr and rollbacks are llmtrain's own
    return 0.6, f"the applied LR {_g(s.lr_applied)} is {factor:.2g}x the schedule's {_g(s.lr_schedule)}"


def _blocks(blocks: list[int]) -> str:
    return ", ".join(map(str, blocks[:8])) + (", ..." if len(blocks) > 8 else "")


def _fixed(score: float, evidence: str) -> Callable[[RunFacts, Signals], Score]:
    """A cause the run's evidence cannot confirm or rule out: a fixed prior, below confirmed ones."""
    return lambda f, s: (score, evidence)


@dataclass(frozen=True)
class CauseKind:
    title: str
    rank: Callable[[RunFacts, Signals], Score]
    fix: Callable[[RunFacts, Signals], str | None]  # config overrides; None: nothing in the configuration to change


def _check_fix(item: str, fallback: str | None = None) -> Callable[[RunFacts, Signals], str | None]:
    """The pre-flight check's fix for its row `item` (one source for `check` and the alarm); the
    fallback only where the check has no such row."""
    return lambda f, s: f.fixes.get(item, fallback)


def _lr_fix(direction: float) -> Callable[[RunFacts, Signals], str | None]:
    """Outside the sane range: the check's fix (the default LR). Inside it (the evidence is the
    update ratio): a step in `direction` from the LR, never back toward the default."""
    def fix(f: RunFacts, s: Signals) -> str | None:
        outside = f.lr > f.lr_high if direction < 1 else f.lr < f.lr_low
        return f.fixes.get("learning rate") if outside else f"optim.lr={_g(f.lr * direction)}"
    return fix


def _init_fix(too_large: bool) -> Callable[[RunFacts, Signals], str | None]:
    """The check's init fix when the gain is what is wrong (its row may name the residual scaling
    instead, for a deep plain-residual model: that is `residual_unscaled`'s)."""
    def fix(f: RunFacts, s: Signals) -> str | None:
        wrong = f.init_gain > INIT_GAIN_HIGH if too_large else f.init_gain < INIT_GAIN_LOW
        return f.fixes.get("init variance") if wrong else None
    return fix


CAUSES: dict[str, CauseKind] = {
    "lr_too_high": CauseKind("Learning rate too high", lr_too_high, _lr_fix(1 / 3)),
    "lr_too_low": CauseKind("Learning rate too low", lr_too_low, _lr_fix(3)),
    "no_warmup": CauseKind("Warmup missing or too short", no_warmup,
                           _check_fix("warmup", "schedule.warmup_fraction=0.05")),
    "no_clipping": CauseKind("Gradient clipping off", no_clipping,
                             _check_fix("gradient clipping", "optim.clip_grad_norm=1.0")),
    "clip_too_tight": CauseKind("Gradient clipping too tight", clip_too_tight,
                                _check_fix("gradient clipping", "optim.clip_grad_norm=1.0")),
    "eps_too_large": CauseKind("Adam epsilon too large for the gradient scale", eps_too_large,
                               lambda f, s: "optim.eps=1e-8"),
    "sgd_without_momentum": CauseKind("SGD without momentum", sgd_without_momentum, lambda f, s: "optim.momentum=0.9"),
    "beta2_too_low": CauseKind("Adam beta2 too low", beta2_too_low, lambda f, s: "optim.beta2=0.95"),
    "over_regularized": CauseKind("Label smoothing or dropout so high the model underfits", over_regularized,
                                  _regularization_fix),
    "batch_too_small": CauseKind("Batch too small for the LR (gradient noise)", batch_too_small,
                                 lambda f, s: f"optim.lr={_g(lr_for_batch(f))}"),
    "overfitting": CauseKind("Overfitting: the model memorizes its training data", overfitting,
                             lambda f, s: f"max_steps={s.best_val_step}" if s.best_val_step else None),
    "init_too_large": CauseKind("Initialization too large", init_too_large, _init_fix(too_large=True)),
    "init_too_small": CauseKind("Initialization too small", init_too_small, _init_fix(too_large=False)),
    "residual_unscaled": CauseKind("Residual branches not scaled down", residual_unscaled,
                                   lambda f, s: "model.residual_init=scaled" if not f.residual_scaled else None),
    "post_ln": CauseKind("Post-LN: the gradient must pass through every norm", post_ln,
                         _check_fix("residual / norm", "model.norm_position=pre")),
    "too_deep": CauseKind("Model too deep for this setup", too_deep, lambda f, s: "model.n_layer=6"),
    "fp16_no_scaler": CauseKind("fp16 without a loss scaler", fp16_no_scaler,
                                _check_fix("mixed precision", "precision.loss_scaling=true")),
    "data_unshuffled": CauseKind("Data not shuffled", data_unshuffled, _check_fix("data order", "data.shuffle=true")),
    "weight_decay_too_high": CauseKind("Weight decay too strong", weight_decay_too_high,
                                       lambda f, s: "optim.weight_decay=0.1" if f.weight_decay > 0.1 else None),
    "schedule_ended": CauseKind("The LR schedule ended before the run", schedule_ended,
                                _check_fix("schedule length", "schedule.total_steps=null")),
    "norm_layers": CauseKind("Normalization missing, misplaced or over the wrong dimension",
                             _fixed(0.2, "not visible in the configuration: compare the norm layers with a "
                                    "standard implementation"), lambda f, s: None),
    "bias_drift": CauseKind("Bias terms drifting", lambda f, s: (0.12, "the model has bias terms") if f.bias else None,
                            lambda f, s: "model.bias=false"),
    "bad_batch": CauseKind("A bad batch", _fixed(0.2, "inspect the batches around the alarm's step"),
                           lambda f, s: None),
    "broken_residual": CauseKind("Residual path broken (vanishing gradient)",
                                 _fixed(0.2, "check that each block's output contains its input"), lambda f, s: None),
    "head_zero_init": CauseKind("LM head initialized at zero", _fixed(0.15, "a zero head passes no gradient down"),
                                lambda f, s: "model.head_init=plain"),
    "loss_bug": CauseKind("Loss or labels wrong (scaled, detached, shifted)",
                          _fixed(0.15, "test the loss on a known input"), lambda f, s: None),
    "lr_overwritten": CauseKind("LR overwritten (restored state, a callback, scaling applied twice)", lr_overwritten,
                                lambda f, s: None),
    "memory_kept": CauseKind("Tensors kept across steps (e.g. total += loss)",
                             _fixed(0.5, "memory rises step after step"), lambda f, s: None),
    "growing_containers": CauseKind("Containers or hooks that grow every step",
                                    _fixed(0.4, "memory rises step after step"), lambda f, s: None),
    "allocator_cache": CauseKind("Allocator cache growing with varying shapes",
                                 _fixed(0.3, "compare allocated with reserved memory"), lambda f, s: None),
}

# The causes each alarm can have (its differential), in the order of a fixed prior: with equal
# scores, the earlier one ranks first.
DIFFERENTIAL: dict[str, tuple[str, ...]] = {
    "grad_norm_high": ("lr_too_high", "batch_too_small", "no_warmup", "no_clipping", "beta2_too_low", "init_too_large",
                       "fp16_no_scaler", "data_unshuffled", "bad_batch"),
    "grad_norm_surge": ("lr_too_high", "batch_too_small", "no_warmup", "no_clipping", "beta2_too_low", "init_too_large",
                        "data_unshuffled", "bad_batch"),
    "grad_norm_low": ("clip_too_tight", "lr_too_low", "schedule_ended", "init_too_small", "post_ln", "broken_residual",
                      "head_zero_init", "weight_decay_too_high", "fp16_no_scaler", "loss_bug"),
    "grad_norm_low_early_layers": ("post_ln", "residual_unscaled", "init_too_small", "too_deep", "broken_residual"),
    "param_norm_jump": ("lr_too_high", "no_warmup", "no_clipping", "beta2_too_low", "init_too_large", "bad_batch",
                        "lr_overwritten"),
    "param_norm_decrease": ("weight_decay_too_high", "lr_too_high", "lr_too_low", "init_too_large"),
    "lr_zero": ("schedule_ended", "lr_overwritten"),
    "lr_exploding": ("lr_overwritten",),
    "activation_mean_drift": ("lr_too_high", "init_too_large", "init_too_small", "no_warmup", "no_clipping",
                              "residual_unscaled", "post_ln", "norm_layers", "bias_drift"),
    # A tiny batch's noisy steps and a very deep stack grow the residual stream too (both seen in the
    # tuning half of the pathology benchmark, where the fixed prior of the norm layers was blamed).
    "activation_variance_high": ("lr_too_high", "batch_too_small", "no_warmup", "beta2_too_low", "init_too_large",
                                 "init_too_small", "residual_unscaled", "too_deep", "no_clipping", "norm_layers"),
    "activation_variance_growing": ("lr_too_high", "batch_too_small", "init_too_large", "init_too_small",
                                    "residual_unscaled", "too_deep", "no_warmup", "post_ln", "norm_layers"),
    "activation_variance_shrinking": ("init_too_small", "weight_decay_too_high", "lr_too_low", "norm_layers"),
    "memory_leak": ("memory_kept", "growing_containers", "allocator_cache"),
    "loss_spike": ("data_unshuffled", "lr_too_high", "batch_too_small", "no_warmup", "no_clipping", "beta2_too_low",
                   "fp16_no_scaler", "bad_batch"),
    "fp16_no_scaler": ("fp16_no_scaler",),
    "loss_above_chance": ("init_too_large", "lr_too_high", "no_warmup", "no_clipping", "beta2_too_low",
                          "fp16_no_scaler", "loss_bug"),
    "loss_rising": ("lr_too_high", "batch_too_small", "no_warmup", "no_clipping", "beta2_too_low", "data_unshuffled",
                    "weight_decay_too_high", "init_too_large", "bad_batch"),
    "loss_not_decreasing": ("clip_too_tight", "eps_too_large", "over_regularized", "sgd_without_momentum", "lr_too_low",
                            "batch_too_small", "schedule_ended", "init_too_small", "lr_too_high", "post_ln",
                            "weight_decay_too_high", "init_too_large", "residual_unscaled", "loss_bug"),
    "update_ratio_high": ("lr_too_high", "batch_too_small", "no_warmup", "beta2_too_low", "weight_decay_too_high",
                          "init_too_small", "no_clipping"),
    "update_ratio_low": ("clip_too_tight", "eps_too_large", "lr_too_low", "schedule_ended",
                         "weight_decay_too_high", "init_too_large"),
    "schedule_ended": ("schedule_ended",),
    "loss_oscillating": ("data_unshuffled", "batch_too_small", "beta2_too_low", "bad_batch"),
    "loss_autocorrelated": ("data_unshuffled",),
    "steps_too_small": ("eps_too_large", "lr_too_low", "schedule_ended", "clip_too_tight"),
    "overfitting": ("overfitting",),
    # AdamW's decay and step both scale with the LR: a low LR cannot make the decay dominate, an LR
    # so high that the weights blew up can (the decay grows with the weights, the step does not).
    # An epsilon that shrinks every update leaves the decay (which it does not touch) dominant too.
    "weight_decay_dominant": ("weight_decay_too_high", "eps_too_large", "lr_too_high"),
}


def diagnose(alarm: str, facts: RunFacts | None, signals: Signals) -> list[Cause]:
    """The alarm's causes, most likely first; [] without facts (a monitor fed synthetic samples)."""
    if facts is None:
        return []
    ranked = []
    for order, cause_id in enumerate(DIFFERENTIAL.get(alarm, ())):
        kind = CAUSES[cause_id]
        found = kind.rank(facts, signals)
        if found is not None:
            score, evidence = found
            ranked.append((-min(score, 1.0), order, Cause(cause_id, kind.title, evidence, kind.fix(facts, signals),
                                                         min(score, 1.0))))
    return [cause for *_, cause in sorted(ranked, key=lambda r: (r[0], r[1]))]


def run_facts(cfg: Config, check_rows: list[Finding], *, peak_lr: float, total_steps: int, schedule_steps: int,
              schedule_floor: float, baseline: float, vocab_size: int, fp16_without_scaler: bool,
              tokens_per_step: int = 0) -> RunFacts:
    """The configuration's side of the evidence, with the pre-flight check's fixes (`check_rows`:
    the rows of the check the run passed; their `item` and `fix`)."""
    m, o = cfg.model, cfg.optim
    low, high = run_lr_range(cfg)
    init_std = m.init_std if m.init == "normal_0.02" else math.nan
    fixes = {row.item: row.fix for row in check_rows if row.fix}
    return RunFacts(
        lr=peak_lr, lr_low=low, lr_high=high, optimizer=o.name.value, n_embd=m.n_embd, n_layer=m.n_layer,
        warmup_steps=resolved_warmup_steps(cfg.schedule, schedule_steps), total_steps=total_steps,
        schedule_steps=schedule_steps, schedule_floor=schedule_floor, init_gain=init_gain(m), init_std=init_std,
        init_scheme=m.init,
        residual_scaled=m.residual_init is ResidualInit.scaled, post_ln=m.norm_position is NormPosition.post,
        bias=m.bias, clip=o.clip_grad_norm, shuffled=cfg.data.shuffle or cfg.data.sampling.value == "epoch",
        weight_decay=o.weight_decay, eps=o.eps, n_params=model_tensors(m, vocab_size).n_params, momentum=o.momentum,
        label_smoothing=o.label_smoothing, dropout=m.dropout, beta2=o.beta2, tokens_per_step=tokens_per_step,
        default_lr=run_default_lr(cfg),
        fp16_without_scaler=fp16_without_scaler, baseline=baseline,
        chance=math.log(vocab_size) if vocab_size > 1 else math.nan, fixes=fixes)
