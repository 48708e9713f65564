"""The train/eval-mode probe, written once: does a model switch between training and inference as it
should? Three callers judge what it measures: the pre-flight check (a one-block copy of the config's
model: preflight/items_model.py `check_train_mode`), `llmtrain doctor eval-consistency` (the config's model
on a real batch: doctor/eval_consistency.py) and the report's inference question (the run's reloaded
weights: runs/report/inference.py).

`probe_modes` runs the forwards: eval mode twice (deterministic?), the same weights with dropout 0 in
train mode (what training computes, which inference must equal), train mode twice with dropout on
(random, or dropout does not reach the layers), and lists the submodules `model.train()` leaves in eval
mode. `probe_evaluate` runs the train loop's `evaluate` on a batch: it must give the eval-mode loss,
the same twice, and hand the model back in train mode. Each returns the measurements; the caller
judges (`ModeProbe.problems`, `EvaluateProbe.problems` say what is wrong in words).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.data.sampler import IGNORE_INDEX
from llmtrain.engine.step import Batch
from llmtrain.engine.step import evaluate as loop_evaluate

MODE_TOL = 1e-5  # max |logit difference| relative to 1 + max |logit|, fp32: the same maths, rounded apart
EVALUATE_TOL = 1e-5  # evaluate()'s loss against the eval-mode logits' own, relative to max(1, loss)

Evaluate = Callable[[nn.Module, list[Batch], torch.device, Callable[[], Any]], float]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd inside; the previous mode comes back."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def modules_not_training(model: nn.Module) -> list[str]:
    """The submodules (the model itself as '(the model)') that are in eval mode."""
    return [name or "(the model)" for name, module in model.named_modules() if not module.training]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference, in fp32."""
    return float((a.float() - b.float()).abs().max())


@dataclass
class ModeProbe:
    """What `probe_modes` measured: the largest logit differences and the modules stuck in eval."""

    eval_identical: bool  # two eval-mode forwards bitwise equal
    eval_repeat: float  # their largest difference
    scale: float  # max |logit| of the reference (train mode without dropout, else eval mode)
    stuck_in_eval: list[str]  # submodules in eval mode after model.train()
    eval_vs_train: float | None = None  # eval mode against train mode with dropout 0; None: not measured
    train_noise: float | None = None  # two train-mode forwards with dropout on; None: not measured

    @property
    def tolerance(self) -> float:
        """The largest difference that is rounding, not a different computation."""
        return MODE_TOL * (1.0 + self.scale)

    def eval_matches_train(self) -> bool:
        return self.eval_vs_train is None or self.eval_vs_train <= self.tolerance

    def dropout_active(self) -> bool:
        return self.train_noise is None or self.train_noise > self.tolerance

    def problems(self) -> list[str]:
        """What is wrong, a phrase each; [] for a model that switches modes as it should."""
        found = []
        if self.stuck_in_eval:
            found.append("a module is not in train mode after model.train()")
        if not self.dropout_active():
            found.append("dropout is not active in train mode")
        if not self.eval_identical:
            found.append("eval mode is not deterministic")
        if not self.eval_matches_train():
            found.append("eval mode differs from train mode without dropout")
        return found


def probe_modes(model: nn.Module, x: torch.Tensor, plain: nn.Module | None = None, noise: bool = True) -> ModeProbe:
    """`model` on the tokens `x`: eval mode twice; `plain` (the same weights, dropout 0) in train mode
    when given; `model` in train mode twice when `noise` (its dropout must make them differ). No
    autograd; each model's mode comes back as it was. Meaningful in fp32: this compares modes, not
    precisions."""
    with eval_mode(model):
        first, second = model(x), model(x)
    reference, eval_vs_train, train_noise = first, None, None
    with torch.no_grad():
        if plain is not None:
            was_training = plain.training
            plain.train()
            reference = plain(x)
            plain.train(was_training)
            eval_vs_train = max_diff(first, reference)
        was_training = model.training
        model.train()
        stuck = modules_not_training(model)
        if noise:
            train_noise = max_diff(model(x), model(x))
        model.train(was_training)
    return ModeProbe(torch.equal(first, second), max_diff(second, first), float(reference.float().abs().max()), stuck,
                     eval_vs_train, train_noise)


@dataclass
class EvaluateProbe:
    """What `probe_evaluate` measured: evaluate()'s loss twice, the eval-mode loss, the mode after."""

    loss: float
    repeat: float  # evaluate() again on the same batch
    expected: float  # the loss of the eval-mode logits, computed here in float64
    left_in_eval: list[str]  # submodules evaluate() left in eval mode

    @property
    def gap(self) -> float:
        return abs(self.loss - self.expected)

    def repeatable(self) -> bool:
        return self.loss == self.repeat

    def measures_eval_mode(self) -> bool:
        return self.gap <= EVALUATE_TOL * max(1.0, abs(self.expected))

    def problems(self) -> list[str]:
        """What is wrong, a phrase each; [] for an evaluation that does what the loop needs."""
        found = []
        if self.left_in_eval:
            found.append("evaluation left the model in eval mode")
        if not self.repeatable():
            found.append("evaluation is not repeatable")
        if not self.measures_eval_mode():
            found.append("evaluation does not give the eval-mode loss")
        return found


def probe_evaluate(model: nn.Module, batch: Batch, device: torch.device, evaluate: Evaluate = loop_evaluate,
                   autocast: Callable[[], Any] = contextlib.nullcontext) -> EvaluateProbe:
    """The train loop's `evaluate` (or the one given, as the check passes its own reference) on one
    batch, from train mode: its loss twice, the mode it leaves, and the loss it should give."""
    x, y = batch
    model.train()
    first = evaluate(model, [batch], device, autocast)
    left_in_eval = modules_not_training(model)
    second = evaluate(model, [batch], device, autocast)
    with eval_mode(model):
        logits = model(x.to(device))
    expected = float(F.cross_entropy(logits.reshape(-1, logits.size(-1)).double(), y.to(device).reshape(-1),
                                     ignore_index=IGNORE_INDEX))
    model.train()
    return EvaluateProbe(first, second, expected, left_in_eval)
