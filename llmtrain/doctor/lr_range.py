"""`llmtrain doctor lr-range`: an exponential LR sweep with the config's model, optimizer, clipping and
precision on fresh batches, stopped when the loss diverges; suggests a peak LR."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console

from llmtrain.config.derived import describe_lr, effective_lr
from llmtrain.config.schema import Config
from llmtrain.core.errors import UserError
from llmtrain.doctor.bench import (
    Bench,
    ModelFactory,
    _precision_name,
    _pyplot,
    _verdict,
    backward,
    fastest_threads,
    make_bench,
    prepare_out_dir,
    write_json,
)
from llmtrain.engine.optim import build_optimizer, clip_gradients, set_lr
from llmtrain.engine.precision import build_precision

# ---------------------------------------------------------------------------------------------
# lr-range
# ---------------------------------------------------------------------------------------------

LR_RANGE_MIN = 1e-6
LR_RANGE_MAX = 1.0
LR_RANGE_STEPS = 120
LR_RANGE_DIVERGE = 4.0  # stop when the smoothed loss exceeds this many times its best
LR_RANGE_BETA = 0.9  # smoothing of the loss (an exponential moving average, bias-corrected)


@dataclass
class LRRangeResult:
    passed: bool
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggested_lr: float | None  # steepest descent; minimum / 10 when the minimum comes too early for a slope
    min_loss_lr: float | None  # where the smoothed loss is lowest
    steepest_lr: float | None  # where the smoothed loss falls fastest per decade of LR, before its minimum
    rule: str
    diverged_lr: float | None
    config_lr: float
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_lr_range(
    cfg: Config, out_dir: Path, console: Console, build_model: ModelFactory | None = None,
    steps: int = LR_RANGE_STEPS, min_lr: float = LR_RANGE_MIN, max_lr: float = LR_RANGE_MAX,
) -> LRRangeResult:
    """Sweep the LR exponentially from `min_lr` to `max_lr` over `steps` optimizer steps of the config's
    model, optimizer (weight decay, betas), clipping and precision, each on a fresh batch of the
    config's global batch; stop once the smoothed loss exceeds 4x its best or climbs back above its start."""
    if not 0 < min_lr < max_lr or steps < 10:
        raise UserError(f"lr-range needs 0 < min_lr < max_lr and at least 10 steps; got min_lr={min_lr:g}, "
                        f"max_lr={max_lr:g}, steps={steps}.")
    start = time.perf_counter()
    out_dir = prepare_out_dir(out_dir)
    bench = make_bench(cfg, console, build_model)
    accum = cfg.global_batch_size // cfg.micro_batch_size
    console.print(
        f"[bold]doctor lr-range[/]: {cfg.model.name}, {cfg.optim.name.value} (weight decay {cfg.optim.weight_decay:g}, "
        f"{_clipping(cfg)}), {_precision_name(cfg, bench.device)}, batch {cfg.global_batch_size} x "
        f"{bench.seq_len} tokens ({accum} micro-batch{'es' if accum > 1 else ''}); LR {min_lr:g} -> {max_lr:g} "
        f"exponentially over up to {steps} steps; stop when the smoothed loss > {LR_RANGE_DIVERGE:g}x its best "
        "or back above its start"
    )
    lrs, losses, smoothed, diverged = _sweep(bench, steps, min_lr, max_lr, accum, console)
    result = judge_lr_range(lrs, losses, smoothed, diverged, effective_lr(cfg))
    result.seconds = time.perf_counter() - start
    _report_lr_range(result, cfg, console)
    plot_lr_range(result, out_dir / "lr-range.png", cfg)
    write_json(out_dir / "lr-range.json", {"experiment": "lr-range", **dataclasses.asdict(result),
                                           "smoothing_beta": LR_RANGE_BETA, "optimizer": cfg.optim.name.value})
    console.print(f"wrote {out_dir / 'lr-range.png'} and {out_dir / 'lr-range.json'} ({result.seconds:.1f}s)")
    return result


def _clipping(cfg: Config) -> str:
    if cfg.optim.clip_grad_norm is not None:
        return f"grad norm clipped to {cfg.optim.clip_grad_norm:g}"
    if cfg.optim.clip_grad_value is not None:
        return f"gradients clipped to +-{cfg.optim.clip_grad_value:g}"
    return "no clipping"


def _sweep(
    bench: Bench, steps: int, min_lr: float, max_lr: float, accum: int, console: Console,
) -> tuple[list[float], list[float], list[float], float | None]:
    """The sweep itself: the train loop's step (accumulate, unscale, clip, step) at a rising LR."""
    cfg, device = bench.cfg, bench.device
    model = bench.model()
    optimizer = build_optimizer(model, cfg.optim, device.type)
    precision = build_precision(cfg.precision, device.type)
    params = [p for p in model.parameters() if p.requires_grad]
    fastest_threads(bench, model, bench.batch(cfg.micro_batch_size), precision, console)
    sampler = bench.sampler(cfg.micro_batch_size)
    lrs, losses, smoothed = [], [], []
    average, best, diverged = 0.0, math.inf, None
    every = max(1, steps // 12)
    for step in range(steps):
        lr = min_lr * (max_lr / min_lr) ** (step / (steps - 1))
        for group in optimizer.param_groups:
            set_lr(group, lr)
        window = [sampler.next_batch() for _ in range(accum)]
        loss = backward(model, window, device, precision, cfg.optim.label_smoothing)
        precision.unscale(optimizer)
        clip_gradients(params, cfg.optim)
        if precision.loss_scaling or math.isfinite(loss):  # the scaler skips an overflowed step itself
            precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        lrs.append(lr)
        losses.append(loss)
        if not math.isfinite(loss):
            smoothed.append(math.inf)
            diverged = lr
            console.print(f"  step {step + 1:4d}  lr {lr:9.3g}  loss {loss}: not finite, stopping")
            break
        average = LR_RANGE_BETA * average + (1 - LR_RANGE_BETA) * loss
        smoothed.append(average / (1 - LR_RANGE_BETA ** (step + 1)))
        best = min(best, smoothed[-1])
        if step == 0 or (step + 1) % every == 0:
            console.print(f"  step {step + 1:4d}  lr {lr:9.3g}  loss {loss:8.4f}  smoothed {smoothed[-1]:8.4f}")
        if step >= 10 and diverging(smoothed, best):
            diverged = lr
            console.print(f"  step {step + 1:4d}  lr {lr:9.3g}  loss {loss:8.4f}  smoothed {smoothed[-1]:8.4f}: "
                          f"diverged (best {best:.4f}, start {smoothed[0]:.4f}), stopping")
            break
    return lrs, losses, smoothed, diverged


def diverging(smoothed: list[float], best: float) -> bool:
    """The smoothed loss is over 4x its best (the usual rule), or, once it had fallen by 10%, back above
    where it started: worse than the untrained model (with clipping, a loss near ln(vocab) may never
    reach 4x its best)."""
    current, first = smoothed[-1], smoothed[0]
    return current > LR_RANGE_DIVERGE * best or (best < 0.9 * first and current > first)


def judge_lr_range(
    lrs: list[float], losses: list[float], smoothed: list[float], diverged: float | None, config_lr: float
) -> LRRangeResult:
    """Suggest a peak LR and judge: a loss that never falls, or a config LR at or past the divergence
    point, is a problem.

    The suggestion is the LR where the smoothed loss falls fastest per decade of LR (steepest descent,
    looked for before the minimum). The other usual rule, the minimum's LR / 10, is reported too but
    not used: the minimum often sits on a long flat stretch (clipping holds the loss there), and its
    argmin wandered 10x between seeds where the steepest point stayed within 2.5x (measured on the
    tests' tiny model, 6 seeds)."""
    result = LRRangeResult(True, lrs, losses, smoothed, None, None, None, "steepest descent of the smoothed loss",
                           diverged, config_lr)
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    if not finite:
        result.passed = False
        result.notes.append("the very first step's loss was not finite: run `llmtrain doctor overfit`")
        return result
    best = min(finite, key=lambda i: smoothed[i])
    result.min_loss_lr = lrs[best]
    if best >= 2:
        slope = np.gradient(np.array(smoothed[: best + 1]), np.log10(np.array(lrs[: best + 1])))
        result.steepest_lr = lrs[int(np.argmin(slope))]
        result.suggested_lr = result.steepest_lr
    else:  # the minimum is at the sweep's very start: no slope to read
        result.suggested_lr, result.rule = lrs[best] / 10, "minimum of the smoothed loss / 10"
    start = smoothed[finite[0]]
    if smoothed[best] > 0.9 * start:
        result.passed = False
        result.notes.append(f"the loss never fell more than 10% below its start ({start:.3f} -> best "
                            f"{smoothed[best]:.3f}) at any LR: no LR trains this setup; a code or data problem "
                            "(run `llmtrain doctor overfit`)")
    if diverged is not None and config_lr >= diverged:
        result.passed = False
        result.notes.append(f"optim.lr {config_lr:g} is at or past the LR where the loss diverged ({diverged:.3g}): "
                            f"lower it, e.g. to {result.suggested_lr:.2g}")
    elif config_lr > result.min_loss_lr:
        result.notes.append(f"optim.lr {config_lr:g} is above the loss minimum's LR ({result.min_loss_lr:.3g}): "
                            "training relies on warmup and clipping to stay stable there")
    elif config_lr < result.suggested_lr / 10:
        result.notes.append(f"optim.lr {config_lr:g} is over 10x below the suggestion: training is likely slower "
                            "than it needs to be")
    if diverged is None:
        result.notes.append(f"the loss did not diverge up to lr {lrs[-1]:.3g} (clipping and Adam's normalized "
                            "steps can hold it on a plateau): read the curve, not only the suggestion")
    return result


def _report_lr_range(result: LRRangeResult, cfg: Config, console: Console) -> None:
    if result.suggested_lr is not None:
        console.print(f"suggested peak LR: [bold]{result.suggested_lr:.3g}[/] (rule: {result.rule}); the smoothed "
                      f"loss's minimum is at lr {result.min_loss_lr:.3g} "
                      f"(minimum / 10 = {result.min_loss_lr / 10:.3g})")
        console.print(f"config: optim.lr = {describe_lr(cfg)}"
                      + (f" (effective {result.config_lr:g})" if result.config_lr != cfg.optim.lr else "")
                      + f", {result.config_lr / result.suggested_lr:.2g}x the suggestion")
    for note in result.notes:
        console.print(f"  note: {note}")
    console.print(f"{_verdict(result.passed)}" + ("" if result.passed else ": see the notes above"))


def plot_lr_range(result: LRRangeResult, path: Path, cfg: Config) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    raw = [v if math.isfinite(v) else float("nan") for v in result.losses]
    smooth = [v if math.isfinite(v) else float("nan") for v in result.smoothed]
    ax.plot(result.lrs, raw, color="C0", alpha=0.3, linewidth=1, label="loss")
    ax.plot(result.lrs, smooth, color="C0", linewidth=1.6, label=f"smoothed (EMA {LR_RANGE_BETA:g})")
    marks = [(result.suggested_lr, "C2", "suggested"), (result.min_loss_lr, "C1", "minimum"),
             (result.config_lr, "C3", "config optim.lr"), (result.diverged_lr, "C7", "diverged")]
    for lr, colour, label in marks:
        if lr is not None:
            ax.axvline(lr, color=colour, linestyle="--", linewidth=1, label=f"{label} {lr:.2g}")
    finite = [v for v in smooth if math.isfinite(v)]
    lowest = min([v for v in raw if math.isfinite(v)] + finite, default=0.0)
    if finite:  # the divergence's last points would squash the interesting part
        ax.set_ylim(lowest * 0.95, min(max(finite), 2 * finite[0]) * 1.05)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"doctor lr-range: {cfg.model.name}, {cfg.optim.name.value}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
