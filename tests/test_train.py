"""The train loop's maths: golden losses, accumulation equivalence, partial windows, masking."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from llmtrain.config.schema import ModelConfig, OptimizerName
from llmtrain.data.sampler import IGNORE_INDEX
from llmtrain.engine.precision import NumericPrecision
from llmtrain.engine.step import accumulate_window, evaluate, loss_sum
from llmtrain.engine.timing import StepTimer
from llmtrain.model import GPT
from llmtrain.training.loop import train

from .conftest import ASSETS, tiny_config

GOLDEN = ASSETS / "golden_losses.json"


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_golden_losses(tmp_path: Path) -> None:
    """A change that does not touch the maths keeps these losses (regenerate: LLMTRAIN_UPDATE_GOLDEN=1)."""
    result = train(tiny_config(tmp_path / "run"))
    losses = [result.train_losses[step] for step in sorted(result.train_losses)]
    assert len(losses) == 10
    if os.environ.get("LLMTRAIN_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"losses": losses, "note": "tests/conftest.py tiny_config, fp32, 1 thread"},
                                     indent=2))
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert losses == pytest.approx(golden, rel=1e-5)
    assert losses[-1] < losses[0] - 0.3, "the tiny model must learn something in 10 steps"


def test_same_seed_same_losses_bit_for_bit(tmp_path: Path) -> None:
    a = train(tiny_config(tmp_path / "a", max_steps=4))
    b = train(tiny_config(tmp_path / "b", max_steps=4))
    assert a.train_losses == b.train_losses
    for key, value in final_params(tmp_path / "a").items():
        assert torch.equal(value, final_params(tmp_path / "b")[key]), key


@pytest.mark.parametrize(
    ("optimizer", "lr", "param_atol"),
    [
        ("sgd", 0.3, 1e-6),
        # Adam divides by sqrt(v): where a gradient is ~0 its float rounding noise (the two runs sum
        # in different orders) becomes a full-size update, so parameters agree to 1e-5, not 1e-6.
        ("adamw", 3e-3, 1e-5),
    ],
)
def test_micro_8_accum_1_equals_micro_2_accum_4(tmp_path: Path, optimizer: str, lr: float, param_atol: float) -> None:
    common = dict(global_batch_size=8, max_steps=6, **{"optim.name": OptimizerName(optimizer), "optim.lr": lr})
    big = train(tiny_config(tmp_path / "big", micro_batch_size=8, **common))
    small = train(tiny_config(tmp_path / "small", micro_batch_size=2, **common))
    assert sorted(big.train_losses) == sorted(small.train_losses) == list(range(1, 7))
    for step, loss in big.train_losses.items():
        assert small.train_losses[step] == pytest.approx(loss, abs=1e-6)
    p_big, p_small = final_params(tmp_path / "big"), final_params(tmp_path / "small")
    for key in p_big:
        torch.testing.assert_close(p_small[key], p_big[key], rtol=0, atol=param_atol)


def test_trailing_partial_window_still_steps(tmp_path: Path) -> None:
    # 2 x 32 tokens per micro-batch, accumulation 4: 10 micro-batches = steps of 4, 4 and 2.
    cfg = tiny_config(tmp_path / "run", micro_batch_size=2, global_batch_size=8, max_steps=None, max_tokens=10 * 2 * 32)
    result = train(cfg)
    assert result.steps == 3
    assert result.tokens == 10 * 2 * 32
    assert sorted(result.train_losses) == [1, 2, 3]


def _tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8), vocab_size=11)


def test_partial_window_gradient_equals_one_big_batch() -> None:
    """Token-count normalization: any split of the same sequences gives the same gradient."""
    torch.manual_seed(1)
    x, y = torch.randint(0, 11, (6, 8)), torch.randint(0, 11, (6, 8))
    y[0, :5] = IGNORE_INDEX  # unequal token counts per micro-batch: a mean of means would be wrong
    grads = []
    for split in ([6], [2, 2, 2], [1, 5]):
        model = _tiny_model()
        batches = list(zip(x.split(split), y.split(split)))
        cpu = torch.device("cpu")
        loss = accumulate_window(model, batches, cpu, NumericPrecision(), StepTimer(0, cpu))
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    for loss, grad in grads[1:]:
        assert loss == pytest.approx(grads[0][0], rel=1e-6)
        for g, ref in zip(grad, grads[0][1]):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


def test_ignore_index_tokens_are_excluded_from_the_mean() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    masked = targets.clone()
    masked[1, 2:] = IGNORE_INDEX
    keep = masked != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
    assert loss_sum(logits, masked).item() == pytest.approx(expected.item(), rel=1e-6)
    # ...and the evaluation mean divides by real tokens only.
    model = _tiny_model()
    x = torch.randint(0, 11, (2, 8))
    y = torch.randint(0, 11, (2, 8))
    y_masked = y.clone()
    y_masked[:, 4:] = IGNORE_INDEX
    with torch.no_grad():
        per_token = torch.nn.functional.cross_entropy(model(x)[:, :4].reshape(-1, 11), y[:, :4].reshape(-1))
    mean = evaluate(model, [(x, y_masked)], torch.device("cpu"), contextlib.nullcontext)
    assert mean == pytest.approx(per_token.item(), rel=1e-5)
    assert model.training, "evaluate must restore train mode"


def test_eval_runs_and_is_logged(tmp_path: Path) -> None:
    result = train(tiny_config(tmp_path / "run", max_steps=4, eval_interval=2, eval_batches=2))
    assert sorted(result.val_losses) == [2, 4]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(math.isclose(r["val_ppl"], math.exp(r["val_loss"]), rel_tol=1e-9) for r in evals)
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in trains)


def test_evaluate_runs_in_eval_mode_with_dropout() -> None:
    torch.manual_seed(3)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=0.5), vocab_size=11)
    x, y = torch.randint(0, 11, (4, 8)), torch.randint(0, 11, (4, 8))
    first = evaluate(model, [(x, y)], torch.device("cpu"), contextlib.nullcontext)
    second = evaluate(model, [(x, y)], torch.device("cpu"), contextlib.nullcontext)
    assert first == second, "dropout must be off during evaluation"
    model.eval()
    with torch.no_grad():
        eval_logits = model(x)
    model.train()
    expected = torch.nn.functional.cross_entropy(eval_logits.reshape(-1, 11), y.reshape(-1)).item()
    assert first == pytest.approx(expected, rel=1e-6)
    with torch.no_grad():
        assert not torch.allclose(model(x), eval_logits), "the test needs dropout to change the outputs"
