"""The monitor's measurements on check steps (monitor/probes.py): fused norms equal to one norm per
tensor, and the matmul rate measured in the run's compute precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmtrain.config.schema import Precision
from llmtrain.monitor.probes import block_norms, snapshot, subtract_in_place, tensor_norms, total_norm

from .conftest import tiny_config


def reference_norm(t: torch.Tensor, ord: float = 2.0) -> float:
    return float(torch.linalg.vector_norm(t.detach().float(), ord))


def test_fused_norms_match_one_norm_per_tensor_and_take_every_kind_of_tensor() -> None:
    torch.manual_seed(0)
    # fp32 (fused), bf16 (widened one by one), a parameter, a scalar and an empty tensor.
    tensors = [torch.randn(7, 5), torch.randn(300).to(torch.bfloat16), torch.nn.Parameter(torch.randn(3, 3)),
               torch.tensor(2.5), torch.zeros(0)]
    for ord in (2.0, 1.0):
        got = tensor_norms(tensors, ord)
        assert got.shape == (5,) and got.dtype == torch.float32 and not got.requires_grad
        assert got.tolist() == pytest.approx([reference_norm(t, ord) for t in tensors], rel=1e-6)
    whole = float(torch.linalg.vector_norm(torch.cat([t.detach().float().flatten() for t in tensors])))
    assert float(total_norm(tensors)) == pytest.approx(whole, rel=1e-6)
    assert tensor_norms([]).shape == (0,)


def test_block_norms_are_each_blocks_norm_over_its_parameters_or_their_gradients() -> None:
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 2, bias=False), torch.nn.Linear(2, 4)]
    blocks[1](blocks[0](torch.randn(3, 4))).sum().backward()  # the third block gets no gradient
    params = [list(block.parameters()) for block in blocks]
    weights = [float(torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in ps]))) for ps in params]
    grads = [float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ps]))) if ps[0].grad is not None
             else 0.0 for ps in params]
    assert block_norms(params, grads=False).tolist() == pytest.approx(weights, rel=1e-6)
    assert block_norms(params, grads=True).tolist() == pytest.approx(grads, rel=1e-6)
    assert block_norms([], grads=True).shape == (0,)


def test_a_snapshot_and_its_in_place_difference_measure_an_update() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 5)), torch.nn.Parameter(torch.randn(5))]
    before = snapshot(params)
    assert all(b is not p and torch.equal(b, p) and not b.requires_grad for b, p in zip(before, params))
    with torch.no_grad():
        for p in params:
            p.add_(0.5)
    diffs = subtract_in_place(before, params)
    assert diffs is before and all(torch.allclose(d, torch.full_like(d, -0.5)) for d in diffs)
    mixed = [params[0], torch.randn(4).to(torch.bfloat16)]  # not all fusable: one by one, same result
    copies = snapshot(mixed)
    assert all(torch.equal(a, b) for a, b in zip(copies, mixed))
    assert all(not d.any() for d in subtract_in_place(copies, mixed))


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_matmul_rate_is_measured_in_the_precision_the_run_computes_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str, dtype: torch.dtype) -> None:
    from llmtrain.preflight.compute import estimate_compute
    from llmtrain.preflight.estimate import model_shape

    measured: list[torch.dtype] = []
    monkeypatch.setattr("llmtrain.preflight.compute.matmul_peak_flops",
                        lambda device, dtype=torch.float32, repeats=8: measured.append(dtype) or 1e9)
    cfg = tiny_config(tmp_path, **{"precision.name": Precision(precision)})
    estimate = estimate_compute(cfg, model_shape(cfg, 256), torch.device("cpu"))
    assert measured == [dtype] and estimate.matmul_dtype == Precision(precision).value
