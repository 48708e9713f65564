"""`llmtrain doctor overfit`: the config's model, dropout off, memorizes ONE fixed small batch with Adam
at a constant LR. A correct model and loss get there within a few hundred steps whatever the real run's
hyper-parameters, so a failure means a code bug, and quick probes name the suspects."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from llmtrain.config.schema import Config, OptimConfig, OptimizerName
from llmtrain.data.sampler import IGNORE_INDEX
from llmtrain.doctor.bench import (
    Batch,
    Bench,
    ModelFactory,
    _names,
    _param_count,
    _precision_name,
    _pyplot,
    _verdict,
    backward,
    fastest_threads,
    make_bench,
    prepare_out_dir,
    write_json,
)
from llmtrain.engine.modes import eval_mode, probe_modes
from llmtrain.engine.optim import build_optimizer, grad_norm
from llmtrain.engine.precision import NumericPrecision, build_precision

# ---------------------------------------------------------------------------------------------
# overfit
# ---------------------------------------------------------------------------------------------

OVERFIT_TARGET = 0.1  # nats/token: the model gives every target ~90% probability (exp(-0.1))
OVERFIT_LR = 1e-3  # Adam's classic default; memorizing one batch needs no tuning
OVERFIT_STEPS = 400
OVERFIT_BATCH = 4
OVERFIT_MAX_LEN = 64


@dataclass
class OverfitResult:
    passed: bool
    target_loss: float
    losses: list[float]
    grad_norms: list[float]
    steps_to_target: int | None
    causal: bool
    suspects: list[str] = field(default_factory=list)
    probes: dict[str, Any] = field(default_factory=dict)
    batch_shape: tuple[int, int] = (0, 0)
    seconds: float = 0.0


def run_overfit(
    cfg: Config, out_dir: Path, console: Console, build_model: ModelFactory | None = None,
    max_steps: int = OVERFIT_STEPS, lr: float = OVERFIT_LR, target_loss: float = OVERFIT_TARGET,
    batch_size: int = OVERFIT_BATCH, max_seq_len: int = OVERFIT_MAX_LEN,
) -> OverfitResult:
    """Memorize one fixed batch; pass when the loss falls below `target_loss` nats/token within
    `max_steps` and the model does not see future tokens. On failure, probe for the likely bug."""
    start = time.perf_counter()
    out_dir = prepare_out_dir(out_dir)
    bench = make_bench(cfg, console, build_model)
    seq_len = min(bench.seq_len, max_seq_len)
    batch = bench.batch(batch_size, seq_len)
    model = bench.model(dropout=0.0)
    # Nothing that fights memorization: no weight decay, no warmup, no decay, no clipping, no smoothing.
    optimizer = build_optimizer(model, OptimConfig(name=OptimizerName.adam, lr=lr, weight_decay=0.0),
                                bench.device.type)
    precision = build_precision(cfg.precision, bench.device.type)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    console.print(
        f"[bold]doctor overfit[/]: {cfg.model.name} ({_param_count(model):,} parameters, dropout 0) memorizes one "
        f"batch of {batch_size} x {seq_len} tokens; Adam lr {lr:g} constant, no weight decay, no clipping, "
        f"{_precision_name(cfg, bench.device)}; up to {max_steps} steps"
    )
    console.print(f"pass: loss < {target_loss:g} nats/token (from ~ln(vocab) = {math.log(bench.vocab_size):.2f}) "
                  "and neither a future-token leak nor unshifted targets made it easy")
    fastest_threads(bench, model, batch, precision, console)
    losses, norms, reached = memorize(model, optimizer, batch, bench.device, precision, max_steps, target_loss,
                                      console)

    # Two bugs make memorizing too EASY, so they are looked for even when the loss got there.
    x, y = batch
    leak, targets = probe_causality(model, x), probe_targets(x, y)
    passed = reached is not None and not leak["leaks"] and not targets["suspects"]
    result = OverfitResult(passed, target_loss, losses, norms, reached, not leak["leaks"],
                           batch_shape=(batch_size, seq_len), probes={"causality": leak, "targets": targets})
    if not passed:
        result.suspects, result.probes = overfit_suspects(model, optimizer, batch, initial, losses, norms, leak, bench)
    result.seconds = time.perf_counter() - start
    _report_overfit(result, console)
    plot_overfit(result, out_dir / "overfit.png", cfg)
    write_json(out_dir / "overfit.json", {"experiment": "overfit", **dataclasses.asdict(result), "lr": lr,
                                          "optimizer": "adam", "max_steps": max_steps, "model": cfg.model.name})
    console.print(f"wrote {out_dir / 'overfit.png'} and {out_dir / 'overfit.json'} ({result.seconds:.1f}s)")
    return result


def memorize(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, device: torch.device,
    precision: NumericPrecision, max_steps: int, target_loss: float,
    console: Console,
) -> tuple[list[float], list[float], int | None]:
    """Train on the one batch until the loss is below `target_loss` (that step's number is returned)
    or `max_steps` pass; the loss and the unclipped grad norm of every step."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses, norms = [], []
    every = max(1, max_steps // 16)
    for step in range(1, max_steps + 1):
        loss = backward(model, [batch], device, precision)
        precision.unscale(optimizer)
        losses.append(loss)
        norms.append(float(grad_norm(params)))
        if not math.isfinite(loss):
            console.print(f"  step {step:4d}  loss {loss}: not finite, stopping")
            break
        precision.step(optimizer)
        if step == 1 or step % every == 0 or loss < target_loss:
            console.print(f"  step {step:4d}  loss {loss:8.4f}  grad norm {norms[-1]:9.4g}")
        if loss < target_loss:
            model.zero_grad(set_to_none=True)
            return losses, norms, step
    model.zero_grad(set_to_none=True)
    return losses, norms, None


def _report_overfit(result: OverfitResult, console: Console) -> None:
    first, last = result.losses[0], result.losses[-1]
    if result.passed:
        console.print(f"{_verdict(True)}: loss {last:.4f} < {result.target_loss:g} at step {result.steps_to_target} "
                      f"(from {first:.4f}); changing a token leaves every earlier prediction unchanged (causal)")
        return
    why = (f"loss {last:.4f} after {len(result.losses)} steps, not below {result.target_loss:g} (from {first:.4f})"
           if result.steps_to_target is None else
           f"loss reached {last:.4f} at step {result.steps_to_target}, but only because the task was made too easy")
    console.print(f"{_verdict(False)}: {why}.")
    console.print("[bold red]This is a code bug, not a hyper-parameter[/]: one fixed batch with Adam at a constant "
                  "LR and nothing fighting memorization must be learned by heart. Suspects, from the probes:")
    for i, suspect in enumerate(result.suspects, 1):
        console.print(f"  {i}. {suspect}")


def plot_overfit(result: OverfitResult, path: Path, cfg: Config) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = range(1, len(result.losses) + 1)
    finite = [v if math.isfinite(v) else float("nan") for v in result.losses]
    ax.plot(steps, finite, color="C0", linewidth=1.4, label="loss on the fixed batch")
    ax.axhline(result.target_loss, color="C2", linestyle="--", linewidth=1, label=f"target {result.target_loss:g}")
    if all(v > 0 for v in finite if math.isfinite(v)):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"doctor overfit: {cfg.model.name}, batch {result.batch_shape[0]} x {result.batch_shape[1]} -- "
                 f"{'PASS' if result.passed else 'FAIL'}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def probe_causality(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Change the token at the middle position t: predictions before t must not move (no future leak),
    the prediction at t must (each position sees its own token), and changing every token must move
    the output (the input reaches it at all). fp32, eval mode."""

    t = x.shape[1] // 2
    with eval_mode(model):
        base = model(x).float()
        vocab = base.shape[-1]
        changed = x.clone()
        changed[:, t] = (x[:, t] + 1) % vocab
        moved = model(changed).float()
        other = model((x + 1) % vocab).float()  # every token different
    scale = 1e-5 * (1.0 + float(base.abs().max()))
    before = float((moved[:, :t] - base[:, :t]).abs().max()) if t else 0.0
    at = float((moved[:, t] - base[:, t]).abs().max())
    anywhere = float((other - base).abs().max())
    return {"position": t, "max_change_before": before, "max_change_at": at, "max_change_all_tokens": anywhere,
            "leaks": before > scale, "sees_own_token": at > scale, "uses_input": anywhere > scale}


def overfit_suspects(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, initial: dict[str, torch.Tensor],
    losses: list[float], norms: list[float], leak: dict[str, Any], bench: Bench,
) -> tuple[list[str], dict[str, Any]]:
    """Run quick probes on the model that failed and turn what they find into specific suspects."""
    probes: dict[str, Any] = {"causality": leak}
    suspects: list[str] = []
    x, y = batch
    bad = [i + 1 for i, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        suspects.append(f"the loss became non-finite at step {bad[0]}: overflow in the model or the loss (a log or "
                        "division of zero, a missing max-subtraction in a softmax); Adam at 1e-3 on one batch does not "
                        "diverge by itself")
    if leak["leaks"]:
        suspects.append(f"future tokens leak: changing token {leak['position']} moved earlier predictions by "
                        f"{leak['max_change_before']:.3g} (attention not causal: is_causal/mask missing or inverted)")
    if not leak["uses_input"]:
        suspects.append("the output does not depend on the input tokens at all (changing every token changed nothing): "
                        "the forward ignores `idx`, or the embedding output is discarded or detached")
    elif not leak["sees_own_token"]:
        suspects.append(f"the prediction at position {leak['position']} ignores its own token: an off-by-one in the "
                        "attention mask or the positions (position t must see tokens 0..t)")
    target = probe_targets(x, y)
    probes["targets"] = target
    suspects += target["suspects"]
    copying = probe_copying(model, x, y)
    probes["copying"] = copying
    if copying["copies_input"]:
        suspects.append(f"the model predicts its INPUT token ({copying['input_match']:.0%} of positions) rather than "
                        f"the next one ({copying['target_match']:.0%}): targets are not shifted by one")
    grads = probe_gradients(model, batch, bench)
    probes["gradients"] = grads
    suspects += grads["suspects"]
    updates = probe_updates(model, optimizer, initial)
    probes["updates"] = updates
    suspects += updates["suspects"]
    modes = probe_train_mode(model, x)
    probes["modes"] = modes
    suspects += modes["suspects"]
    if norms and norms[0] == 0.0:
        suspects.append("the gradient norm was exactly 0 from the first step: the loss is cut from the parameters "
                        "(.detach(), torch.no_grad(), .item() or a non-differentiable op in the forward)")
    entropy = batch_unigram_entropy(y)
    probes["batch_unigram_entropy"] = entropy
    finite = [v for v in losses if math.isfinite(v)]
    if finite and entropy > 0 and finite[-1] > 0.8 * entropy:
        suspects.append(f"the loss stalled at {finite[-1]:.3f}, near the batch's unigram entropy {entropy:.3f}: the "
                        "model only learned token frequencies, so the context does not reach the output (input "
                        "ignored, residual stream cut or detached, attention output dropped)")
    if finite and len(finite) > 1 and finite[-1] > finite[0]:
        suspects.append(f"the loss ROSE ({finite[0]:.3f} -> {finite[-1]:.3f}): the update goes against the gradient "
                        "(a sign error in the loss) or the targets change between steps")
    if not suspects:
        suspects = [
            "the loss: targets shifted by one, masks (IGNORE_INDEX) and the reduction",
            "the model's forward: residual connections, the attention mask, norm placement, the head",
            "the optimizer step: every parameter registered, the LR applied, gradients zeroed after each step",
        ]
    return suspects, probes


def probe_targets(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The sampler's targets must be the inputs shifted by one. Only where two neighbouring targets
    are real: the last real target of a padded instruction example has no input after it."""
    real = y != IGNORE_INDEX
    same_as_input = bool(real.any()) and bool(((y == x) | ~real).all())
    inside = real[:, :-1] & real[:, 1:]
    shifted = bool(((y[:, :-1] == x[:, 1:]) | ~inside).all())
    suspects = []
    if same_as_input:
        suspects.append("the targets ARE the inputs (y == x): the model is asked to predict the token it sees; the "
                        "targets must be the inputs shifted left by one")
    elif not shifted:
        suspects.append("the targets are not the next tokens (y[:, t] != x[:, t + 1]): check the window slicing")
    return {"targets_equal_inputs": same_as_input, "targets_shifted_by_one": shifted, "suspects": suspects}


def probe_copying(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    with eval_mode(model):
        predicted = model(x).argmax(-1)
    input_match = float((predicted == x).float().mean())
    target_match = float((predicted == y).float().mean())
    return {"input_match": input_match, "target_match": target_match,
            "copies_input": input_match > 0.5 and input_match > 2 * target_match}


def probe_gradients(model: nn.Module, batch: Batch, bench: Bench) -> dict[str, Any]:
    """One more backward on the failed model: which parameters get no gradient at all?"""
    backward(model, [batch], bench.device)
    none = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    zero = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is not None and not p.grad.any()]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    model.zero_grad(set_to_none=True)
    suspects = []
    if none:
        suspects.append(f"{len(none)} parameter(s) get no gradient at all (not on the loss's graph: detached, unused "
                        f"or bypassed): {_names(none)}")
    if zero:
        suspects.append(f"{len(zero)} parameter(s) get an all-zero gradient (multiplied by zero, or a dead branch): "
                        f"{_names(zero)}")
    if frozen:
        suspects.append(f"{len(frozen)} parameter(s) have requires_grad=False: {_names(frozen)}")
    return {"no_grad": none, "zero_grad": zero, "frozen": frozen, "suspects": suspects}


def probe_updates(model: nn.Module, optimizer: torch.optim.Optimizer, initial: dict[str, torch.Tensor]) -> dict:
    """Did the optimizer reach and move every parameter?"""
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_optimizer]
    unchanged = [n for n, p in model.named_parameters() if n in initial and torch.equal(p.detach(), initial[n])]
    lrs = sorted({float(group["lr"]) for group in optimizer.param_groups})
    suspects = []
    if missing:
        suspects.append(f"{len(missing)} trainable parameter(s) are not in the optimizer: {_names(missing)}")
    if unchanged:
        suspects.append(f"{len(unchanged)} parameter(s) never changed during the run (no gradient, LR 0, or not "
                        f"stepped): {_names(unchanged)}")
    if lrs and lrs[-1] <= 0:
        suspects.append(f"the optimizer's LR is {lrs[-1]:g}: nothing can move")
    return {"not_in_optimizer": missing, "unchanged": unchanged, "lrs": lrs, "suspects": suspects}


def probe_train_mode(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """In train mode, with dropout forced to 0 (engine/modes.py's probe): every submodule in train
    mode, no dropout layer left on, the forward deterministic."""
    model.train()
    probe = probe_modes(model, x)
    dropouts = [name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    random = probe.dropout_active()  # two train-mode forwards differ: with dropout 0 nothing should
    suspects = []
    if probe.stuck_in_eval:
        suspects.append(f"{len(probe.stuck_in_eval)} submodule(s) stay in eval mode after model.train(): "
                        f"{_names(probe.stuck_in_eval)}")
    if dropouts:
        suspects.append(f"dropout is still on although model.dropout=0 was asked for: {_names(dropouts)} (the config "
                        "value does not reach the layers)")
    if random:
        suspects.append("the forward is random in train mode with dropout 0: noise that is not dropout, or a dropout "
                        "probability that ignores the config")
    return {"eval_mode_submodules": probe.stuck_in_eval, "active_dropout": dropouts, "random_forward": random,
            "suspects": suspects}


def batch_unigram_entropy(y: torch.Tensor) -> float:
    """Entropy (nats) of the batch's target-token frequencies: the loss of a model that ignores context."""
    real = y[y != IGNORE_INDEX]
    if real.numel() == 0:
        return 0.0
    counts = torch.bincount(real.flatten().cpu()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())
