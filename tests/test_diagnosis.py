"""The differential diagnosis: each alarm's causes ranked by this run's evidence, with the check's fixes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from llmtrain.config.derived import default_lr, sane_lr_range
from llmtrain.config.schema import ALARM_NAMES, Config, NormPosition, ResidualInit
from llmtrain.config.validate import validate
from llmtrain.monitor.catalog import CATALOG
from llmtrain.monitor.diagnosis import CAUSES, DIFFERENTIAL, RunFacts, Signals, diagnose, run_facts
from llmtrain.preflight.check import run_check

LOW, HIGH = sane_lr_range(Config().optim.name, 128)
HEALTHY = RunFacts(lr=3e-3, lr_low=LOW, lr_high=HIGH, n_embd=128, n_layer=4, warmup_steps=50, total_steps=1000,
                   schedule_steps=1000, init_gain=128 * 0.02**2, init_std=0.02, weight_decay=0.1, baseline=3.25,
                   chance=math.log(256))


def top(alarm: str, facts: RunFacts, **signals: object) -> str:
    causes = diagnose(alarm, facts, Signals(**signals))  # type: ignore[arg-type]
    return causes[0].cause


@pytest.mark.parametrize(("alarm", "change", "signals", "expected"), [
    ("param_norm_jump", {"lr": 0.03}, {"step": 20}, "lr_too_high"),
    ("activation_mean_drift", {"lr": 0.09}, {"step": 200}, "lr_too_high"),  # not the norm layers
    ("loss_rising", {"lr": 0.01, "warmup_steps": 0}, {"step": 40}, "no_warmup"),
    ("update_ratio_low", {"lr": 1e-7}, {"step": 40, "update_ratio": 2e-6}, "lr_too_low"),
    ("loss_above_chance", {"init_std": 1.0, "init_gain": 128.0}, {"step": 10}, "init_too_large"),
    ("loss_not_decreasing", {"init_std": 1e-6, "init_gain": 1.3e-10}, {"step": 100}, "init_too_small"),
    ("activation_variance_growing", {"residual_scaled": False, "n_layer": 16}, {"step": 100}, "residual_unscaled"),
    ("grad_norm_low_early_layers", {"post_ln": True, "n_layer": 12}, {"step": 30, "blocks": [0, 1], "n_blocks": 12},
     "post_ln"),
    ("grad_norm_surge", {"lr": 0.02, "clip": None}, {"step": 50, "grad_norm_peak": 40.0}, "no_clipping"),
    ("grad_norm_high", {"fp16_without_scaler": True}, {"step": 30}, "fp16_no_scaler"),
    ("loss_spike", {"shuffled": False}, {"step": 80}, "data_unshuffled"),
    ("update_ratio_high", {"weight_decay": 10.0}, {"step": 30, "update_ratio": 0.2}, "weight_decay_too_high"),
    ("lr_zero", {"schedule_steps": 100, "total_steps": 300}, {"step": 130}, "schedule_ended"),
    # every update cut to 1/4000 by the clip: the blocks' gradients look starved, the pre-clip norm does not
    ("grad_norm_low", {"clip": 1e-4}, {"step": 40, "grad_norm_floor": 0.4, "grad_norm_peak": 0.9}, "clip_too_tight"),
    ("update_ratio_low", {"clip": 1e-3}, {"step": 40, "grad_norm_floor": 0.3, "update_ratio": 1e-6}, "clip_too_tight"),
    # Adam's epsilon 1.0 against gradient elements of ~5e-4 (norm 0.5 over 0.86M parameters): decay dominates
    ("weight_decay_dominant", {"eps": 1.0, "n_params": 858_880}, {"step": 60, "grad_norm_peak": 0.5},
     "eps_too_large"),
    ("loss_not_decreasing", {"label_smoothing": 0.5}, {"step": 100}, "over_regularized"),
    ("loss_not_decreasing", {"dropout": 0.5}, {"step": 100}, "over_regularized"),
    ("loss_not_decreasing", {"optimizer": "sgd", "momentum": 0.0, "lr": 0.3, "lr_low": 0.03, "lr_high": 3.0},
     {"step": 100}, "sgd_without_momentum"),
    ("loss_spike", {"beta2": 0.5}, {"step": 80}, "beta2_too_low"),
])
def test_the_true_cause_ranks_first(alarm: str, change: dict, signals: dict, expected: str) -> None:
    assert top(alarm, dataclasses.replace(HEALTHY, **change), **signals) == expected


def test_clipping_is_blamed_only_where_the_pre_clip_norms_are_far_above_it() -> None:
    """The norms clipping left alone, or cut by a little, do not make it the cause."""
    starved = {"step": 40, "grad_norm_floor": 0.4, "grad_norm_peak": 0.9}
    assert "clip_too_tight" not in [c.cause for c in diagnose("grad_norm_low", HEALTHY, Signals(**starved))]
    slight = diagnose("grad_norm_low", dataclasses.replace(HEALTHY, clip=0.2), Signals(**starved))
    assert next(c for c in slight if c.cause == "clip_too_tight").score < 0.5
    off = diagnose("grad_norm_low", dataclasses.replace(HEALTHY, clip=None), Signals(**starved))
    assert "clip_too_tight" not in [c.cause for c in off]
    tight = diagnose("grad_norm_low", dataclasses.replace(HEALTHY, clip=1e-4), Signals(**starved))[0]
    assert "4000x the clip threshold 0.0001" in tight.evidence and tight.fix == "optim.clip_grad_norm=1.0"


def test_epsilon_is_blamed_only_when_it_rivals_a_gradient_element() -> None:
    """The default 1e-8 is far below any gradient element of a real model; 1.0 is far above."""
    signals = Signals(step=60, grad_norm_peak=0.5)
    default = dataclasses.replace(HEALTHY, n_params=858_880)
    assert "eps_too_large" not in [c.cause for c in diagnose("update_ratio_low", default, signals)]
    silent = diagnose("update_ratio_low", dataclasses.replace(default, eps=1.0), Signals(step=60, grad_norm_peak=0.0))
    assert "eps_too_large" not in [c.cause for c in silent], "no gradient at all: epsilon shrinks nothing"
    sgd = dataclasses.replace(default, eps=1.0, optimizer="sgd")
    assert "eps_too_large" not in [c.cause for c in diagnose("update_ratio_low", sgd, signals)]
    large = diagnose("update_ratio_low", dataclasses.replace(default, eps=1.0), signals)[0]
    assert large.cause == "eps_too_large" and large.fix == "optim.eps=1e-8"
    assert "Adam epsilon 1 is 1854x a gradient element's typical size (0.00054" in large.evidence


def test_regularization_and_momentum_are_blamed_only_outside_their_usual_values() -> None:
    usual = dataclasses.replace(HEALTHY, label_smoothing=0.1, dropout=0.2, optimizer="sgd", momentum=0.9)
    causes = [c.cause for c in diagnose("loss_not_decreasing", usual, Signals(step=100))]
    assert "over_regularized" not in causes and "sgd_without_momentum" not in causes
    both = diagnose("loss_not_decreasing", dataclasses.replace(HEALTHY, label_smoothing=0.4, dropout=0.5),
                    Signals(step=100))[0]
    assert both.cause == "over_regularized" and both.fix == "optim.label_smoothing=0.0 model.dropout=0.1"


def test_beta2_is_blamed_only_below_the_usual_range_and_only_for_adam() -> None:
    for facts in (dataclasses.replace(HEALTHY, beta2=0.95), dataclasses.replace(HEALTHY, beta2=0.5, optimizer="sgd")):
        assert "beta2_too_low" not in [c.cause for c in diagnose("loss_spike", facts, Signals(step=80))]
    low = diagnose("loss_spike", dataclasses.replace(HEALTHY, beta2=0.8), Signals(step=80))[0]
    assert low.cause == "beta2_too_low" and "over only ~5 steps" in low.evidence and low.fix == "optim.beta2=0.95"


def test_it_never_advises_against_its_evidence() -> None:
    high = dataclasses.replace(HEALTHY, lr=0.1)
    for alarm in DIFFERENTIAL:
        assert "lr_too_low" not in {c.cause for c in diagnose(alarm, high, Signals(step=210))}, alarm
    low = dataclasses.replace(HEALTHY, lr=1e-7)
    for alarm in DIFFERENTIAL:
        assert "lr_too_high" not in {c.cause for c in diagnose(alarm, low, Signals(step=40))}, alarm
    # A large update ratio rules out "too low" even at an LR inside the range.
    causes = diagnose("param_norm_decrease", HEALTHY, Signals(step=200, update_ratio=0.2))
    assert "lr_too_low" not in {c.cause for c in causes}
    small = dataclasses.replace(HEALTHY, init_gain=1e-10, init_std=1e-6)
    assert "init_too_large" not in {c.cause for c in diagnose("activation_variance_growing", small, Signals())}


def test_the_evidence_carries_the_numbers() -> None:
    cause = diagnose("param_norm_jump", dataclasses.replace(HEALTHY, lr=0.1), Signals(step=20, update_ratio=0.05))[0]
    assert cause.cause == "lr_too_high"
    assert f"is {0.1 / HIGH:.0f}x the sane maximum" in cause.evidence and "update/weight ratio 0.05" in cause.evidence
    record = cause.to_record()
    assert set(record) == {"cause", "title", "evidence", "fix", "score"} and 0 < record["score"] <= 1


def test_causes_are_most_likely_first_and_evidence_free_causes_rank_below_confirmed_ones() -> None:
    causes = diagnose("activation_mean_drift", dataclasses.replace(HEALTHY, lr=0.09), Signals(step=100))
    scores = [c.score for c in causes]
    assert scores == sorted(scores, reverse=True)
    assert causes[0].score > next(c.score for c in causes if c.cause == "norm_layers")
    # Without facts (synthetic streams) there is nothing to rank.
    assert diagnose("grad_norm_high", None, Signals()) == []


def test_every_alarm_has_a_differential_of_known_causes() -> None:
    for name in ALARM_NAMES:
        assert name in CATALOG, name
        assert DIFFERENTIAL.get(name), name
        assert set(DIFFERENTIAL[name]) <= set(CAUSES), name


def fixes_of(cfg: Config) -> tuple[dict[str, str], RunFacts]:
    validate(cfg)
    rows = run_check(cfg, measure_compute=False).rows
    facts = run_facts(cfg, rows, peak_lr=cfg.optim.lr, total_steps=1000, schedule_steps=1000, schedule_floor=0.0,
                      baseline=3.25, vocab_size=256, fp16_without_scaler=False)
    return {row.item: row.fix for row in rows if row.fix}, facts


def test_the_fix_is_the_pre_flight_checks_own() -> None:
    cfg = Config()
    cfg.optim.lr, cfg.model.init_std = 0.1, 1.0
    cfg.model.norm_position, cfg.model.n_layer = NormPosition.post, 12
    fixes, facts = fixes_of(cfg)
    by_cause = {c.cause: c for alarm in DIFFERENTIAL for c in diagnose(alarm, facts, Signals(step=10))}
    assert by_cause["lr_too_high"].fix == fixes["learning rate"]
    assert by_cause["init_too_large"].fix == fixes["init variance"]
    assert by_cause["post_ln"].fix == fixes["residual / norm"]
    # The check's LR fix is the default for this optimizer and width.
    assert fixes["learning rate"] == f"optim.lr={float(f'{default_lr(cfg.optim.name, 128):.1g}'):g}"


def test_run_facts_reads_the_configuration() -> None:
    cfg = Config()
    cfg.optim.lr, cfg.optim.clip_grad_norm, cfg.data.shuffle = 0.01, None, False
    cfg.model.residual_init = ResidualInit.plain
    _, facts = fixes_of(cfg)
    assert (facts.lr, facts.clip, facts.shuffled, facts.residual_scaled) == (0.01, None, False, False)
    assert facts.chance == pytest.approx(math.log(256)) and facts.lr_over == pytest.approx(0.01 / HIGH)


def test_a_batch_too_small_for_the_lr_is_its_own_cause() -> None:
    """64 tokens a step at the default LR: eight times what such a batch bears (the default scaled by
    the root of the batch against 4,096 tokens). nanoGPT's 768 tokens at 1e-3 are fine."""
    tiny = dataclasses.replace(HEALTHY, lr=3e-3, default_lr=3e-3, tokens_per_step=64)
    causes = diagnose("loss_oscillating", tiny, Signals(step=200))
    assert causes[0].cause == "batch_too_small", causes
    assert "64 tokens per step" in causes[0].evidence and causes[0].fix == "optim.lr=0.00038"
    nanogpt = dataclasses.replace(HEALTHY, lr=1e-3, default_lr=3e-3, tokens_per_step=768)
    assert "batch_too_small" not in [c.cause for c in diagnose("loss_oscillating", nanogpt, Signals(step=200))]
    default = dataclasses.replace(HEALTHY, lr=3e-3, default_lr=3e-3, tokens_per_step=4096)
    assert "batch_too_small" not in [c.cause for c in diagnose("loss_spike", default, Signals(step=200))]
