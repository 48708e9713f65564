"""`llmtrain doctor eval-consistency`: eval mode is deterministic and equals train mode with dropout off,
dropout is random in train mode, and the train loop's `evaluate` leaves the model in train mode."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from llmtrain.config.schema import Config
from llmtrain.core.findings import Finding, Status
from llmtrain.doctor.bench import (
    Batch,
    Check,
    ModelFactory,
    _names,
    _verdict,
    make_bench,
    prepare_out_dir,
    render_checks,
    result_record,
    write_json,
)
from llmtrain.engine.modes import MODE_TOL, probe_evaluate, probe_modes

# ---------------------------------------------------------------------------------------------
# eval-consistency
# ---------------------------------------------------------------------------------------------

EVAL_FORCED_DROPOUT = 0.1  # a config without dropout still gets its train/eval switch tested
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
    fp32: this compares modes, not precisions (grad-check does those). The measuring is engine/modes.py's
    probe, the one the pre-flight check and the report use; the judging and the words are here."""
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
    write_json(out_dir / "eval-consistency.json", result_record("eval-consistency", result))
    console.print(f"{_verdict(result.passed)}; wrote {out_dir / 'eval-consistency.json'} ({result.seconds:.1f}s)")
    return result


def check_modes(dropped: nn.Module, plain: nn.Module, x: torch.Tensor, p: float) -> list[Check]:
    """`dropped` has dropout p, `plain` the same weights and dropout 0."""
    probe = probe_modes(dropped, x, plain)
    tol = probe.tolerance
    assert probe.eval_vs_train is not None and probe.train_noise is not None  # both measured: plain given, noise on
    return [
        Check(Finding("eval mode twice: identical logits", Status.of(probe.eval_identical),
                      f"max |diff| {probe.eval_repeat:.3g}", criterion="bitwise equal",
                      fix="eval mode is random: dropout (or other noise) still active in eval mode, e.g. "
                      "F.dropout(..., training=True) or a dropout_p not gated on self.training")),
        Check(Finding(f"eval mode (dropout {p:g}) = train mode, dropout 0", Status.of(probe.eval_matches_train()),
                      f"max |diff| {probe.eval_vs_train:.3g}", criterion=f"<= {tol:.2g}",
                      details=[f"tolerance {MODE_TOL:g} x (1 + max |logit|)"],
                      fix="inference computes something else than training: a layer with its own eval path (a "
                      "cache, a different mask or normalization), or dropout applied in eval mode")),
        Check(Finding(f"train mode, dropout {p:g}: random", Status.of(probe.dropout_active()),
                      f"max |diff| {probe.train_noise:.3g}", criterion=f"> {tol:.2g}",
                      details=["two train-mode forwards of the same batch"],
                      fix="dropout has no effect in train mode: model.dropout does not reach the layers, or they are "
                      "stuck in eval mode")),
    ]


def check_evaluate(model: nn.Module, batch: Batch, device: torch.device) -> Check:
    """The train loop's own `evaluate`: the eval-mode loss, the same twice, and train mode afterwards."""
    probe = probe_evaluate(model, batch, device)
    first, second, left_in_eval = probe.loss, probe.repeat, probe.left_in_eval
    return Check(Finding(
        "evaluate(): eval loss, repeatable, train mode after", Status.of(not probe.problems()),
        f"|diff| {probe.gap:.2e}; {'equal' if probe.repeatable() else 'DIFFERENT'}; "
        f"{'train' if not left_in_eval else 'EVAL'}",
        criterion="<= 1e-5 x loss; equal; train",  # EVALUATE_TOL
        details=[f"evaluate() {first:.6f} and again {second:.6f}; loss of eval-mode logits {probe.expected:.6f}"
                 + (f"; left in eval mode: {_names(left_in_eval)}" if left_in_eval else "")],
        fix="the train loop's evaluation does not measure the eval-mode model, is not repeatable, or leaves the "
        "model in eval mode (training would go on without dropout)",
    ), {"loss": first, "repeat": second, "expected": probe.expected, "left_in_eval": left_in_eval})
