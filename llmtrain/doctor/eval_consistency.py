"""`llmtrain doctor eval-consistency`: eval mode is deterministic and equals train mode with dropout off,
dropout is random in train mode, and the train loop's `evaluate` leaves the model in train mode."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from llmtrain.config.schema import Config
from llmtrain.data.sampler import IGNORE_INDEX
from llmtrain.doctor.bench import (
    Batch,
    Check,
    ModelFactory,
    _names,
    _verdict,
    eval_mode,
    make_bench,
    prepare_out_dir,
    render_checks,
    write_json,
)
from llmtrain.engine.step import evaluate

# ---------------------------------------------------------------------------------------------
# eval-consistency
# ---------------------------------------------------------------------------------------------

EVAL_FORCED_DROPOUT = 0.1  # a config without dropout still gets its train/eval switch tested
EVAL_TOL = 1e-5  # max |logit difference| relative to 1 + max |logit|, fp32
EVAL_MAX_BATCH = 8


@dataclass
class EvalConsistencyResult:
    passed: bool
    checks: list[Check]
    dropout: float
    seconds: float = 0.0


def run_eval_consistency(
    cfg: Config, out_dir: Path, console: Console, build_model: ModelFactory | None = None
) -> EvalConsistencyResult:
    """Eval mode is deterministic and equals train mode without dropout; dropout changes train mode;
    the train loop's `evaluate` gives the eval-mode loss and leaves the model in train mode. All in
    fp32: this compares modes, not precisions (grad-check does those)."""
    start = time.perf_counter()
    out_dir = prepare_out_dir(out_dir)
    bench = make_bench(cfg, console, build_model)
    p = cfg.model.dropout if cfg.model.dropout > 0 else EVAL_FORCED_DROPOUT
    console.print(f"[bold]doctor eval-consistency[/]: {cfg.model.name}, dropout {p:g}"
                  + (" (forced: the config has none)" if cfg.model.dropout == 0 else "")
                  + f", batch {min(cfg.micro_batch_size, EVAL_MAX_BATCH)} x {bench.seq_len} tokens, fp32")
    dropped = bench.model(dropout=p)
    plain = bench.model(dropout=0.0)
    plain.load_state_dict(dropped.state_dict())
    batch = bench.batch(min(cfg.micro_batch_size, EVAL_MAX_BATCH))
    checks = [*check_modes(dropped, plain, batch[0], p), check_evaluate(dropped, batch, bench.device)]
    result = EvalConsistencyResult(all(c.passed for c in checks), checks, p, time.perf_counter() - start)
    render_checks(checks, console, "eval-consistency")
    write_json(out_dir / "eval-consistency.json", {"experiment": "eval-consistency", **dataclasses.asdict(result)})
    console.print(f"{_verdict(result.passed)}; wrote {out_dir / 'eval-consistency.json'} ({result.seconds:.1f}s)")
    return result


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Max absolute difference, and the tolerance it is judged against (relative to the logits' scale)."""
    return float((a.float() - b.float()).abs().max()), EVAL_TOL * (1.0 + float(b.float().abs().max()))


def check_modes(dropped: nn.Module, plain: nn.Module, x: torch.Tensor, p: float) -> list[Check]:
    """`dropped` has dropout p, `plain` the same weights and dropout 0."""
    with eval_mode(dropped):
        first, second = dropped(x), dropped(x)
    with torch.no_grad():
        plain.train()
        train_plain = plain(x)
        dropped.train()
        noisy_a, noisy_b = dropped(x), dropped(x)
    repeat, _ = _max_diff(second, first)
    versus_train, tol = _max_diff(first, train_plain)
    noise, _ = _max_diff(noisy_a, noisy_b)
    return [
        Check("eval mode twice: identical logits", torch.equal(first, second), f"max |diff| {repeat:.3g}",
              "bitwise equal", hint="eval mode is random: dropout (or other noise) still active in eval mode, e.g. "
              "F.dropout(..., training=True) or a dropout_p not gated on self.training"),
        Check(f"eval mode (dropout {p:g}) = train mode, dropout 0", versus_train <= tol,
              f"max |diff| {versus_train:.3g}", f"<= {tol:.2g}", f"tolerance {EVAL_TOL:g} x (1 + max |logit|)",
              "inference computes something else than training: a layer with its own eval path (a cache, "
              "a different mask or normalization), or dropout applied in eval mode"),
        Check(f"train mode, dropout {p:g}: random", noise > tol, f"max |diff| {noise:.3g}", f"> {tol:.2g}",
              "two train-mode forwards of the same batch", "dropout has no effect in train mode: model.dropout "
              "does not reach the layers, or they are stuck in eval mode"),
    ]


def check_evaluate(model: nn.Module, batch: Batch, device: torch.device) -> Check:
    """The train loop's own `evaluate`: the eval-mode loss, the same twice, and train mode afterwards."""
    x, y = batch
    model.train()
    first = evaluate(model, [batch], device, contextlib.nullcontext)
    left_in_eval = [name or "(the model)" for name, m in model.named_modules() if not m.training]
    second = evaluate(model, [batch], device, contextlib.nullcontext)
    with eval_mode(model):
        logits = model(x)
    expected = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).double(), y.reshape(-1),
                                                       ignore_index=IGNORE_INDEX))
    gap = abs(first - expected)
    passed = not left_in_eval and first == second and gap <= 1e-5 * max(1.0, abs(expected))
    return Check(
        "evaluate(): eval loss, repeatable, train mode after", passed,
        f"|diff| {gap:.2e}; {'equal' if first == second else 'DIFFERENT'}; {'train' if not left_in_eval else 'EVAL'}",
        "<= 1e-5 x loss; equal; train",
        f"evaluate() {first:.6f} and again {second:.6f}; loss of eval-mode logits {expected:.6f}"
        + (f"; left in eval mode: {_names(left_in_eval)}" if left_in_eval else ""),
        "the train loop's evaluation does not measure the eval-mode model, is not repeatable, or leaves the "
        "model in eval mode (training would go on without dropout)",
        {"loss": first, "repeat": second, "expected": expected, "left_in_eval": left_in_eval},
    )
