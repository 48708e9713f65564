"""The pre-flight items about the optimization: warmup, the schedule's length, clipping, the effective
batch, the learning rate (for the optimizer, the width and the batch) and SGD's momentum.

Each item is a function of (config, facts) giving a `Finding` (or None where it does not apply);
preflight/check.py lists them in the order the table shows."""

from __future__ import annotations

from llmtrain.config.derived import (
    accumulation_steps,
    batch_scaled_lr,
    effective_lr,
    lr_defaulted,
    resolved_warmup_steps,
    run_default_lr,
    run_lr_range,
    schedule_steps,
    seq_len_of,
    tokens_per_step,
    total_steps,
    world_size_of,
)
from llmtrain.config.finetune import is_lora
from llmtrain.config.schema import (
    ADAM_FAMILY,
    Config,
    OptimizerName,
)
from llmtrain.core.findings import Finding, Status
from llmtrain.engine.schedule import final_lr, held_lr_text
from llmtrain.preflight.facts import Facts


def check_warmup(cfg: Config, facts: Facts) -> Finding:
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
        return Finding("warmup", Status.WARN, "none", why, suggestion)
    if 0.01 <= share <= 0.10:
        return Finding("warmup", Status.PASS, seen, why)
    if share < 0.01 and warmup >= 500:  # long runs: a few hundred steps settle the early updates
        return Finding("warmup", Status.PASS, f"{seen}, >= 500 steps", why)
    if share < 0.01:
        return Finding("warmup", Status.WARN, seen + " - short", why, suggestion)
    return Finding("warmup", Status.WARN, seen + " - long: the run spends it below its LR",
                   "Beyond ~10% warmup wastes steps at a low LR.", suggestion)


def check_schedule_length(cfg: Config, facts: Facts) -> Finding | None:
    """A WARN when the LR schedule (schedule.total_steps) ends before the run and the rest of the run
    sits at a lower LR; no row otherwise, so the table of a run its schedule covers is unchanged."""
    run_steps, steps = total_steps(cfg), schedule_steps(cfg)
    peak = effective_lr(cfg)
    held = final_lr(peak, steps, cfg.schedule)
    if steps >= run_steps or held >= peak:  # covers the run, or holds the peak (constant): nothing lost
        return None
    seen = (f"ends at step {steps:,} of {run_steps:,}: the last {run_steps - steps:,} steps at "
            f"{held_lr_text(held, peak)}")
    why = ("Past its end the schedule holds its final LR: the rest of the run costs full compute at the floor (at LR 0 "
           "it trains nothing); usually a schedule left from a shorter run.")
    return Finding("schedule length", Status.WARN, seen, why, "schedule.total_steps=null")


def check_clipping(cfg: Config, facts: Facts) -> Finding:
    o = cfg.optim
    why = ("Clipping caps the update when one batch's gradient explodes; common values are 1.0-5.0 (PASS: 0.5-10).")
    if o.clip_grad_value is not None:
        return Finding("gradient clipping", Status.WARN, f"by value {o.clip_grad_value:g}",
                       "Per-element clipping changes the gradient's direction; clipping the norm keeps it.",
                       "optim.clip_grad_value=null optim.clip_grad_norm=1.0")
    if o.clip_grad_norm is None:
        return Finding("gradient clipping", Status.WARN, "off", why, "optim.clip_grad_norm=1.0")
    seen = f"norm {o.clip_grad_norm:g}"
    if o.clip_grad_norm < 0.5:
        return Finding("gradient clipping", Status.WARN, seen + " - tight: clips almost every step and slows learning",
                       why, "optim.clip_grad_norm=1.0")
    if o.clip_grad_norm > 10:
        return Finding("gradient clipping", Status.WARN, seen + " - loose: barely ever clips", why,
                       "optim.clip_grad_norm=1.0")
    return Finding("gradient clipping", Status.PASS, seen, why)


def check_effective_batch(cfg: Config, facts: Facts) -> Finding:
    accum = accumulation_steps(cfg)
    seq = seq_len_of(cfg)
    tokens = tokens_per_step(cfg)
    world = world_size_of(cfg)
    seen = (f"{cfg.global_batch_size} seq x {seq} = {tokens:,} tokens/step "
            f"(micro {cfg.micro_batch_size} x accumulation {accum} x {world} process{'es' if world > 1 else ''})")
    why = "The batch the optimizer sees sets the gradient noise and the right LR; accumulation must not change it."
    if facts.train_tokens is not None and tokens > facts.train_tokens:
        return Finding("effective batch", Status.WARN, seen + f" > the {facts.train_tokens:,} train tokens",
                       "Each step sees the whole training set more than once.",
                       "a smaller global_batch_size, or more data")
    if accum > 64:
        micro = facts.fitting_micro_batch or max(d for d in range(1, cfg.global_batch_size // 8 + 1)
                                                 if cfg.global_batch_size % d == 0)
        return Finding("effective batch", Status.WARN, seen, "Over 64 micro-batches per step: the micro-batch is "
                       "probably too small to use the device.", f"micro_batch_size={micro}")
    return Finding("effective batch", Status.PASS, seen, why)


def suggested_lr(cfg: Config) -> tuple[float, float]:
    """(low, high) sane peak LRs for the optimizer and, for Adam-like ones, the model width."""
    return run_lr_range(cfg)


def check_learning_rate(cfg: Config, facts: Facts) -> Finding:
    lr = effective_lr(cfg)
    low, high = suggested_lr(cfg)
    name = cfg.optim.name.value + (", the default" if lr_defaulted(cfg) else "")
    scaled = f", {cfg.schedule.lr_scaling.value}-scaled from {cfg.optim.lr:g}" if lr != cfg.optim.lr else ""
    seen = f"{lr:g} ({name}{scaled})"
    why = "Too high diverges (NaN after warmup); too low stalls. The sane range depends on the optimizer and the width."
    adam_like = cfg.optim.name in ADAM_FAMILY
    # The fix is what optim.lr=null would give (the same function sets the default), undoing lr_scaling.
    fix = f"optim.lr={round_lr(run_default_lr(cfg) * cfg.optim.lr / lr)}"
    if (adam_like and lr >= 0.05) or (not adam_like and lr >= 10 * high):
        return Finding("learning rate", Status.FAIL, seen + " - diverges", why, fix)
    if lr > high or lr < low:
        width = " for LoRA adapters" if is_lora(cfg) else f" for a {cfg.model.n_embd}-wide model" if adam_like else ""
        return Finding("learning rate", Status.WARN, f"{seen} outside {low:.1g}-{high:.1g}{width}", why, fix)
    tokens = tokens_per_step(cfg)
    bears = batch_scaled_lr(run_default_lr(cfg), tokens)
    if not is_lora(cfg) and lr > SMALL_BATCH_LR_FACTOR * bears:
        return Finding(
            "learning rate", Status.WARN,
            f"{seen} - {lr / bears:.1f}x what {tokens:,} tokens per step bear ({bears:.2g})",
            "A small batch's gradient is mostly noise: the LR it bears falls with the root of its size (the "
            "defaults suit batches of ~4,096 tokens). Too high, the loss settles higher and learns slowly.",
            f"optim.lr={round_lr(bears * cfg.optim.lr / lr)}")
    return Finding("learning rate", Status.PASS, seen, why)


# The LR over the root-scaled LR of its batch above which the check warns. The defaults at 8 x 64
# tokens (512) are 2.8x the root-scaled LR and train well, and small test runs of 256 tokens (4x) are
# left alone; at 128 tokens (5.7x) the run ends ~6% worse than at the scaled LR (the pathology
# benchmark's batch_2 against c_batch2).
SMALL_BATCH_LR_FACTOR = 5.0


def check_momentum(cfg: Config, facts: Facts) -> Finding | None:
    """SGD only: without momentum each step follows one batch's gradient, which for a transformer
    learns several times slower than momentum 0.9 (or Adam)."""
    if cfg.optim.name is not OptimizerName.sgd:
        return None
    seen = f"SGD momentum {cfg.optim.momentum:g}"
    why = "Momentum averages ~1 / (1 - momentum) steps' gradients: it damps their noise and speeds the consistent part."
    if cfg.optim.momentum <= 0:
        return Finding("momentum", Status.WARN, seen + " - plain SGD: each step follows one batch's noisy gradient",
                       why, "optim.momentum=0.9")
    return Finding("momentum", Status.PASS, seen, why)


def round_lr(lr: float) -> str:
    return f"{float(f'{lr:.1g}'):g}"
