"""The pre-flight items about the model and its numerics: precision, train/eval mode, the seed, the
residual path's scaling and the initialization.

Each item is a function of (config, facts) giving a `Finding` (or None where it does not apply);
preflight/check.py lists them in the order the table shows."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from llmtrain.config.derived import (
    INIT_GAIN_HIGH,
    INIT_GAIN_LOW,
    init_gain,
)
from llmtrain.config.schema import (
    ActivationCheckpointing,
    Config,
    HeadInit,
    NormPosition,
    Precision,
    ResidualInit,
)
from llmtrain.core.findings import Finding, Status
from llmtrain.engine.modes import probe_evaluate, probe_modes
from llmtrain.engine.precision import native_bf16
from llmtrain.engine.step import evaluate
from llmtrain.model import GPT
from llmtrain.preflight.facts import Facts
from llmtrain.preflight.items_optimization import round_lr


def check_precision(cfg: Config, facts: Facts) -> Finding:
    p, device = cfg.precision, facts.device
    chosen = facts.precision
    seen = chosen.value + (" (auto)" if p.name is Precision.auto else "") + f" on {device.type}"
    if chosen is Precision.fp16:
        seen += ", dynamic loss scaling" if p.loss_scaling else ", NO loss scaling"
    if chosen is Precision.fp16 and not p.loss_scaling:
        return Finding("mixed precision", Status.FAIL, seen,
                       "fp16 has 5 exponent bits: without a dynamic loss scale small gradients underflow to zero and "
                       "large ones overflow to inf.", "precision.loss_scaling=true (or precision=bf16)")
    if device.type == "cuda":
        bf16_ok = native_bf16()
        if chosen is Precision.fp32:
            return Finding("mixed precision", Status.WARN, seen,
                           "bf16/fp16 halve activation memory and run on tensor cores (~30%+ faster).",
                           "precision=auto" if bf16_ok else "precision=fp16")
        if chosen is Precision.bf16 and not bf16_ok:
            return Finding("mixed precision", Status.FAIL, seen, "This GPU has no bf16 support.", "precision=fp16")
        return Finding("mixed precision", Status.PASS, seen, "Mixed precision halves activation memory on this GPU.")
    if chosen is not Precision.fp32:
        return Finding("mixed precision", Status.WARN, seen,
                       f"No fast low-precision matmuls on {device.type} here: autocast measured ~0.65x the fp32 speed.",
                       "precision=fp32 (or precision=auto)")
    return Finding("mixed precision", Status.PASS, seen,
                   f"fp32 is the fastest on {device.type}; mixed precision pays on GPUs.")


def check_train_mode(cfg: Config, facts: Facts) -> Finding:
    """Run llmtrain's own train/eval switching on a one-block copy of the model (engine/modes.py's
    probe): training must be in train mode (dropout active), evaluation in eval mode (deterministic,
    equal to training without dropout), and train mode must come back after an evaluation."""
    problems = verify_train_eval_modes(cfg)
    dropout = cfg.model.dropout
    seen = f"dropout {dropout:g}; " + ("train/eval switching verified" if not problems else "; ".join(problems))
    why = "Dropout left on in eval (or off in training) makes evaluation noisy and training differ from what was tuned."
    if problems:
        return Finding("train/eval mode", Status.FAIL, seen, why,
                       "a code bug: report it (llmtrain's evaluate() must restore train mode)")
    if dropout > 0.3:
        return Finding("train/eval mode", Status.WARN, seen + " - high for language-model pre-training",
                       "Dropout above ~0.2 mostly slows pre-training, which rarely overfits.", "model.dropout=0.1")
    return Finding("train/eval mode", Status.PASS, seen, why)


def verify_train_eval_modes(cfg: Config) -> list[str]:
    """The mode probe's problems on a one-block copy of the config's model (fp32, CPU, 32 ids), and
    the loop's `evaluate` on it; [] when the switching works. The global RNG is left as it was."""
    small = copy.deepcopy(cfg.model)
    small.n_layer, small.block_size = 1, min(cfg.model.block_size, 16)
    small.n_head = 2 if cfg.model.n_embd % 2 == 0 and (cfg.model.n_embd // 2) % 2 == 0 else 1
    small.n_embd = 16 * small.n_head
    small.n_kv_head, small.intermediate_size, small.init_from = None, None, None
    small.dropout = max(cfg.model.dropout, 0.1)  # something to switch on and off
    small.activation_checkpointing = ActivationCheckpointing.none
    # The mode switching is under test, not the init: a zero head or zero residual branches would
    # make every output equal whether dropout is on or not.
    small.init, small.init_std, small.residual_init = "normal_0.02", 0.02, ResidualInit.scaled
    small.head_init, small.tie_weights = HeadInit.plain, True
    generator_state = torch.random.get_rng_state()
    try:
        model = GPT(small, 32)
        plain = GPT(dataclasses.replace(small, dropout=0.0), 32)
        plain.load_state_dict(model.state_dict())
        x = torch.randint(0, 32, (2, small.block_size), generator=torch.Generator().manual_seed(0))
        modes = probe_modes(model, x, plain)
        # `evaluate` as this module names it: the loop's, which a test may replace with a broken one
        evaluation = probe_evaluate(model, (x, x), torch.device("cpu"), evaluate,
                                    lambda: torch.autocast("cpu", enabled=False))
        return modes.problems() + evaluation.problems()
    finally:
        torch.random.set_rng_state(generator_state)  # checking must not move the run's RNG


def check_seed(cfg: Config, facts: Facts) -> Finding:
    why = "A fixed seed makes init, dropout and data order repeatable: a rerun tells a bug from noise."
    if cfg.seed is None:
        return Finding("global seed", Status.WARN, "none (drawn at random, logged)", why, "seed=1337")
    extra = ", deterministic algorithms" if cfg.deterministic else ""
    if facts.device.type == "cuda" and not cfg.deterministic:
        extra = " (GPU kernels may still differ run to run: deterministic=true or preset=reproducible)"
    return Finding("global seed", Status.PASS, f"{cfg.seed}{extra}", why)


def check_residual_norm(cfg: Config, facts: Facts) -> Finding:
    m = cfg.model
    seen = f"{m.norm_position.value}-{m.norm.value}, {m.n_layer} blocks, residual on attention and MLP"
    why = "Pre-LN lets gradients flow straight through the residual path; post-LN must pass every norm."
    if m.norm_position is NormPosition.post and m.n_layer >= 6:
        return Finding("residual / norm", Status.WARN, seen,
                       why + " Deep post-LN stacks need long warmup and small LRs.", "model.norm_position=pre")
    return Finding("residual / norm", Status.PASS, seen, why)


def check_init(cfg: Config, facts: Facts) -> Finding:
    m = cfg.model
    if m.init_from is not None:  # the random init is overwritten before the first step: nothing to judge
        return Finding("init variance", Status.PASS, f"weights from {m.init_from}",
                       "A pretrained checkpoint's weights replace the random init, so its variance does not matter.")
    gain = init_gain(m)  # output variance of a matmul on unit-variance inputs
    seen = (f"normal std {m.init_std:g}: fan-in x std^2 = {gain:.2f}" if m.init == "normal_0.02"
            else f"{m.init}: fan-in x var = {gain:.2f}")
    seen += f"; residual outputs {m.residual_init.value}"
    why = "Each layer's output variance is fan-in x weight variance: far above 1 explodes, far below vanishes."
    if gain > INIT_GAIN_HIGH:
        return Finding("init variance", Status.WARN, seen + " - activations grow layer by layer", why,
                       f"model.init_std={round_lr(math.sqrt(1 / m.n_embd))}")
    if gain < INIT_GAIN_LOW:
        return Finding("init variance", Status.WARN, seen + " - signals vanish", why,
                       f"model.init_std={round_lr(math.sqrt(1 / m.n_embd))}")
    if m.residual_init is ResidualInit.plain and m.n_layer >= 12:
        return Finding("init variance", Status.WARN, seen, "With plain residual outputs the stream's variance grows "
                       "with depth (2 branches per block).", "model.residual_init=scaled")
    return Finding("init variance", Status.PASS, seen, why)
