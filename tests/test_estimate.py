"""The memory estimator against the truth: autograd's saved tensors, the optimizer's real state, and
the measured peak resident memory of real training runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config.schema import (
    ActivationCheckpointing,
    Config,
    MlpKind,
    ModelConfig,
    NormKind,
    NormPosition,
    OptimizerName,
    PositionEncoding,
    Precision,
)
from llmtrain.engine.optim import build_optimizer
from llmtrain.model import GPT
from llmtrain.preflight.activations import activation_bytes_per_token
from llmtrain.preflight.estimate import (
    estimate_memory,
    largest_fitting_micro_batch,
    model_shape,
)

VOCAB = 256


def saved_bytes(model: GPT, batch: int, seq: int, dtype: torch.dtype | None) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        F.cross_entropy(model(x).reshape(-1, VOCAB).float(), x.reshape(-1))
    return sum(seen.values())


def measured_per_token(model_cfg: ModelConfig, dtype: torch.dtype | None) -> float:
    """Per-token saved bytes (batch 2 minus batch 1 removes everything batch-independent)."""
    torch.manual_seed(0)
    model = GPT(model_cfg, VOCAB)
    model.train()
    T = model_cfg.block_size
    return (saved_bytes(model, 2, T, dtype) - saved_bytes(model, 1, T, dtype)) / T


VARIANTS = {
    "gpt": {},
    "dropout": {"dropout": 0.1},
    "modern": {"position": PositionEncoding.rope, "norm": NormKind.rmsnorm, "mlp": MlpKind.swiglu, "bias": False},
    "post_ln": {"norm_position": NormPosition.post},
    "checkpointed": {"activation_checkpointing": ActivationCheckpointing.full},
}


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_activation_formula_matches_autograds_saved_tensors(variant: str, precision: Precision) -> None:
    dtype = torch.bfloat16 if precision is Precision.bf16 else None
    measured = {}
    for layers in (1, 2):
        mcfg = ModelConfig(n_layer=layers, n_head=4, n_embd=128, block_size=64, **VARIANTS[variant])
        measured[layers] = measured_per_token(mcfg, dtype)
    cfg = Config(model=ModelConfig(n_layer=1, n_head=4, n_embd=128, block_size=64, vocab_size=VOCAB,
                                   **VARIANTS[variant]))
    est = activation_bytes_per_token(cfg, precision, "cpu")
    block = measured[2] - measured[1]
    if variant == "checkpointed":
        assert block == est["block_input"]  # only each block's input is kept
    else:
        assert block == est["block"]
    assert abs((measured[1] - block) - est["head"]) <= 8  # the targets: int64, once


@pytest.mark.parametrize("name", [OptimizerName.adamw, OptimizerName.sgd, OptimizerName.adafactor])
def test_optimizer_state_matches_the_real_optimizer(name: OptimizerName) -> None:
    cfg = Config(model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    cfg.optim.name = name
    model = GPT(cfg.model, 50)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    model(torch.randint(0, 50, (2, 16))).sum().backward()
    optimizer.step()
    real = sum(v.numel() for state in optimizer.state.values() for k, v in state.items()
               if torch.is_tensor(v) and k != "step")
    assert model_shape(cfg, 50).optimizer_state_elements == real


def test_layouts_shard_what_they_promise() -> None:
    cfg = Config(model=ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024))
    cfg.global_batch_size = 64
    shape = model_shape(cfg, 50304)
    single = estimate_memory(cfg, shape, 50304, "cuda", Precision.bf16)
    zero1 = estimate_memory(cfg, shape, 50304, "cuda", Precision.bf16, layout="zero1", world_size=8)
    fsdp = estimate_memory(cfg, shape, 50304, "cuda", Precision.bf16, layout="fsdp", world_size=8)
    ddp = estimate_memory(cfg, shape, 50304, "cuda", Precision.bf16, layout="ddp", world_size=8)
    assert single.optimizer == 2 * 4 * shape.n_params  # AdamW: two fp32 moments
    assert zero1.optimizer == single.optimizer / 8 and zero1.weights == single.weights
    assert fsdp.optimizer == single.optimizer / 8  # what fsdp gathers whole: tests/test_plan.py
    assert fsdp.weights < single.weights / 2 and fsdp.gradients < single.gradients / 2
    assert ddp.gradients == 2 * single.gradients  # the reducer's buckets
    assert single.autocast_weights == 2 * shape.n_matmul_params
    assert fsdp.peak < zero1.peak < ddp.peak


def test_the_monitors_weight_copy_makes_the_peak_only_where_activations_are_small() -> None:
    """From a check to the end of its step the monitor holds a copy of the trainable weights, after
    the activations are freed: gpt_small with a full micro-batch peaks in backward as before; one
    sequence of 16 tokens with every block recomputed peaks at the check, by the copy."""
    cfg = Config(model=ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024))
    cfg.global_batch_size = 16
    shape = model_shape(cfg, 50304)
    big = estimate_memory(cfg, shape, 50304, "cuda", Precision.bf16)
    assert big.monitor_copy == big.weights - 4.0 * shape.n_buffer_elements and big.checking < big.peak
    assert "monitor's weight copy (at a check)" not in dict(big.rows())

    cfg.global_batch_size, cfg.data.seq_len = 1, 16
    cfg.model.activation_checkpointing = ActivationCheckpointing.full
    small = estimate_memory(cfg, shape, 50304, "cuda", Precision.bf16)
    assert small.peak == small.checking == small.weights + small.optimizer + small.gradients + small.monitor_copy
    assert dict(small.rows())["monitor's weight copy (at a check)"] == small.monitor_copy
    cfg.monitor.enabled = False
    off = estimate_memory(cfg, shape, 50304, "cuda", Precision.bf16)
    assert off.monitor_copy == 0 and small.peak - small.monitor_copy <= off.peak < small.peak


def test_largest_fitting_micro_batch_divides_the_global_batch() -> None:
    cfg = Config(model=ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=256))
    cfg.micro_batch_size, cfg.global_batch_size = 48, 48
    shape = model_shape(cfg, VOCAB)
    full = estimate_memory(cfg, shape, VOCAB, "cpu", Precision.fp32).peak
    micro = largest_fitting_micro_batch(cfg, shape, VOCAB, "cpu", Precision.fp32, budget=full / 3)
    assert micro is not None and micro < 48 and 48 % micro == 0
    assert estimate_memory(cfg, shape, VOCAB, "cpu", Precision.fp32, micro_batch_size=micro).peak <= full / 3
    assert largest_fitting_micro_batch(cfg, shape, VOCAB, "cpu", Precision.fp32, budget=1.0) is None


# ---------------------------------------------------------------------------------------------
# predicted peak vs the measured peak of real runs (each in a fresh process)
# ---------------------------------------------------------------------------------------------

PEAK_CONFIGS = {
    "4x128 micro 64 adamw": {"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4, "model.block_size": 256,
                             "micro_batch_size": 64, "global_batch_size": 64},
    "8x512 T128 adafactor": {"model.n_layer": 8, "model.n_embd": 512, "model.n_head": 8, "model.block_size": 128,
                             "micro_batch_size": 8, "global_batch_size": 8, "optim.name": OptimizerName.adafactor},
    "2x128 vocab 50304 accum 2": {"model.n_layer": 2, "model.n_embd": 128, "model.n_head": 2, "model.block_size": 256,
                                  "micro_batch_size": 8, "global_batch_size": 16, "model.vocab_size": 50304},
    "4x384 checkpointed sgd accum 2": {"model.n_layer": 4, "model.n_embd": 384, "model.n_head": 6,
                                       "model.block_size": 256, "micro_batch_size": 16, "global_batch_size": 32,
                                       "model.activation_checkpointing": ActivationCheckpointing.full,
                                       "optim.name": OptimizerName.sgd},
}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and glibc behaviour: Linux")
@pytest.mark.parametrize("name", sorted(PEAK_CONFIGS))
def test_predicted_peak_within_25_percent_of_a_real_run(tmp_path: Path, name: str) -> None:
    from .conftest import predicted_and_measured_peak

    predicted, measured = predicted_and_measured_peak(
        tmp_path / "run", PEAK_CONFIGS[name],
        "from llmtrain.preflight.facts import gather_facts\n"
        "predicted = gather_facts(cfg, measure_compute=False).memory.peak")
    result = {"predicted": predicted, "measured": measured}
    ratio = result["predicted"] / result["measured"]
    print(f"{name}: predicted {result['predicted'] / 2**20:.0f} MiB, measured {result['measured'] / 2**20:.0f} MiB, "
          f"ratio {ratio:.2f}")
    # Measured here: 0.98-1.09 after two steps, 0.89-1.08 after eight (glibc's heap fragments further
    # over the first steps, most with gradient accumulation); a CI machine measured 6% more than this
    # one for the same run.
    assert 0.75 <= ratio <= 1.25, f"{name}: predicted {result['predicted'] / 2**20:.0f} MiB, measured " \
                                 f"{result['measured'] / 2**20:.0f} MiB (ratio {ratio:.2f})"
