"""Selective activation checkpointing (llmtrain/checkpointing.py): every mode gives none's gradients,
keeps what the memory estimate says it keeps, and the config keys (old booleans included) load."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmtrain.checkpointing import CheckpointPlan
from llmtrain.config.hydra import config_from_dict, model_config_from_dict
from llmtrain.config.schema import (
    ActivationCheckpointing,
    Config,
    MlpKind,
    ModelConfig,
    NormKind,
    OptimizerName,
    PositionEncoding,
    Precision,
    config_to_dict,
)
from llmtrain.core.errors import ConfigError
from llmtrain.doctor.grad_check import live_activation_bytes
from llmtrain.model import GPT
from llmtrain.preflight.activations import activation_bytes_per_token
from llmtrain.preflight.estimate import estimate_memory, model_shape

from .conftest import gpt_like, llama_like

FULL, OP, NONE = ActivationCheckpointing.full, ActivationCheckpointing.op, ActivationCheckpointing.none
VOCAB = 64
MODES = [(FULL, 1), (OP, 1), (FULL, 2), (OP, 2)]


def _run(cfg: ModelConfig, mode: ActivationCheckpointing, every: int, dropout: float) -> tuple[dict, int]:
    """(gradients, activation bytes kept at the end of the forward) of one batch, the same weights,
    batch and RNG seed whatever the mode."""
    cfg = dataclasses.replace(cfg, activation_checkpointing=mode, checkpoint_every=every, dropout=dropout)
    torch.manual_seed(0)
    model = GPT(cfg, VOCAB)
    model.train()
    x = torch.randint(0, VOCAB, (3, cfg.block_size), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # the dropout masks: drawn again, from the replayed state, when a block recomputes
    with live_activation_bytes(model) as kept:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, kept["bytes"]


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("recipe", ["gpt", "llama"])
def test_every_mode_gives_the_gradients_of_none(recipe: str, dropout: float) -> None:
    cfg = gpt_like("gpt", 4) if recipe == "gpt" else llama_like("llama", 4)  # llama: RoPE, GQA, SwiGLU, RMSNorm
    reference, plain = _run(cfg, NONE, 1, dropout)
    kept = {}
    for mode, every in MODES:
        grads, kept[mode, every] = _run(cfg, mode, every, dropout)
        for name, grad in reference.items():
            where = f"{mode.value} every {every}: {name}"
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
    # ... and each keeps less than none: full the least, every other block between its mode and none
    assert kept[FULL, 1] < kept[OP, 1] < kept[OP, 2] < plain
    assert kept[FULL, 1] < kept[FULL, 2] < plain


def test_blocks_checkpointed_are_the_multiples_of_checkpoint_every() -> None:
    assert [i for i in range(7) if CheckpointPlan(OP, 2).checkpoints(i)] == [0, 2, 4, 6]
    assert [i for i in range(7) if CheckpointPlan(FULL, 3).checkpoints(i)] == [0, 3, 6]
    assert CheckpointPlan(FULL, 1).count(5) == 5 and CheckpointPlan(OP, 2).count(5) == 3
    assert CheckpointPlan(NONE, 1).count(5) == 0
    assert CheckpointPlan(FULL, 2).count(2, first=1) == 1  # a pipeline stage of blocks 1 and 2


def test_eval_mode_never_checkpoints() -> None:
    model = GPT(dataclasses.replace(gpt_like("gpt", 2), activation_checkpointing=OP), VOCAB).eval()
    x = torch.randint(0, VOCAB, (2, 16))
    reference = GPT(gpt_like("gpt", 2), VOCAB).eval()
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# what the estimate says a block keeps, against the tensors alive at the end of the forward
# ---------------------------------------------------------------------------------------------

SHAPES = {
    "gpt": {},
    "dropout (math attention on CPU)": {"dropout": 0.1},
    "llama": {"position": PositionEncoding.rope, "norm": NormKind.rmsnorm, "mlp": MlpKind.swiglu, "bias": False,
              "n_kv_head": 2},
}


def _kept_per_token(mcfg: ModelConfig, dtype: torch.dtype | None) -> float:
    """Kept bytes per token: batch 2 minus batch 1 leaves out everything batch-independent."""
    kept = []
    for batch in (1, 2):
        torch.manual_seed(0)
        model = GPT(mcfg, 256).train()
        x = torch.randint(0, 256, (batch, mcfg.block_size), generator=torch.Generator().manual_seed(0))
        with live_activation_bytes(model) as counter, torch.autocast("cpu", dtype=dtype or torch.bfloat16,
                                                                     enabled=dtype is not None):
            F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
        kept.append(counter["bytes"])
    return (kept[1] - kept[0]) / mcfg.block_size


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_op_mode_keeps_what_the_estimate_counts(shape: str, precision: Precision) -> None:
    dtype = torch.bfloat16 if precision is Precision.bf16 else None
    per_block = {}
    for mode in (NONE, FULL, OP):
        per_layers = [_kept_per_token(ModelConfig(n_layer=n, n_head=4, n_embd=128, block_size=64,
                                                  activation_checkpointing=mode, **SHAPES[shape]), dtype)
                      for n in (1, 2)]
        per_block[mode] = per_layers[1] - per_layers[0]
    est = activation_bytes_per_token(Config(model=ModelConfig(n_layer=1, n_head=4, n_embd=128, block_size=64,
                                                              vocab_size=256, **SHAPES[shape])), precision, "cpu")
    assert per_block[OP] == est["block_input"] + est["block_op"]
    assert per_block[FULL] == est["block_input"]
    if shape != "llama":  # the none formula counts q/k/v as three full widths (no GQA): exact without it
        assert per_block[NONE] == est["block"]


def test_estimate_orders_the_modes() -> None:
    cfg = Config(model=ModelConfig(n_layer=12, n_head=4, n_embd=64, block_size=512))
    cfg.micro_batch_size = cfg.global_batch_size = 16
    shape = model_shape(cfg, VOCAB)
    activations = {}
    for mode, every in [(NONE, 1), *MODES]:
        cfg.model.activation_checkpointing, cfg.model.checkpoint_every = mode, every
        activations[mode, every] = estimate_memory(cfg, shape, VOCAB, "cpu", Precision.fp32).activations
    assert activations[FULL, 1] < activations[FULL, 2] < activations[NONE, 1]
    assert activations[FULL, 1] < activations[OP, 1] < activations[OP, 2] < activations[NONE, 1]


# ---------------------------------------------------------------------------------------------
# the config: the keys, their validation, and the boolean an older llmtrain saved
# ---------------------------------------------------------------------------------------------


def test_saved_configs_with_the_old_boolean_still_load() -> None:
    for old, new in [(True, FULL), (False, NONE)]:
        saved = config_to_dict(Config())
        saved["model"]["activation_checkpointing"] = old
        assert config_from_dict(saved).model.activation_checkpointing is new
        assert model_config_from_dict({"activation_checkpointing": old}).activation_checkpointing is new


def test_command_line_booleans_and_bad_values_get_one_paragraph() -> None:
    from llmtrain.cli.compose import compose_config

    with pytest.raises(ConfigError) as err:
        compose_config(["model.activation_checkpointing=true"])
    assert "none (what false meant), full (what true meant" in str(err.value)
    assert "model.activation_checkpointing=full" in str(err.value)
    with pytest.raises(ConfigError, match="'model.checkpoint_every' is 0; use a positive integer"):
        compose_config(["model.activation_checkpointing=op", "model.checkpoint_every=0"])
    cfg = compose_config(["model.activation_checkpointing=op", "model.checkpoint_every=2"])
    assert (cfg.model.activation_checkpointing, cfg.model.checkpoint_every) == (OP, 2)
    # the preset picks a saver when the run does not fit (tests/test_memory_savers.py), not a fixed mode
    assert compose_config(["preset=memory_saver"]).memory_saver is True


# ---------------------------------------------------------------------------------------------
# predicted peak vs the measured peak of real runs, per mode (each in a fresh process)
# ---------------------------------------------------------------------------------------------

# Activations dominate: 12 narrow blocks, 512 tokens of context, 16 sequences, SGD (little state).
PEAK_SHAPE = {"model.n_layer": 12, "model.n_embd": 64, "model.n_head": 4, "model.block_size": 512,
              "micro_batch_size": 16, "global_batch_size": 16, "optim.name": OptimizerName.sgd}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and glibc behaviour: Linux")
def test_each_modes_measured_peak_falls_as_predicted(tmp_path: Path) -> None:
    from .conftest import predicted_and_measured_peak

    peaks = {}
    for mode, every in [(NONE, 1), *MODES]:
        peaks[mode, every] = predicted_and_measured_peak(
            tmp_path / f"{mode.value}{every}",
            {**PEAK_SHAPE, "model.activation_checkpointing": mode, "model.checkpoint_every": every},
            "from llmtrain.preflight.facts import gather_facts\n"
            "predicted = gather_facts(cfg, measure_compute=False).memory.peak")
    shown = ", ".join(f"{m.value} every {k}: predicted {p / 2**20:.0f} MiB, measured {r / 2**20:.0f} MiB"
                      for (m, k), (p, r) in peaks.items())
    print(shown)
    # Under-prediction is the costly side (a run the check passed runs out of memory): 15% at most.
    # Over it, 25% (as test_estimate's): the checkpointed modes' resident peaks come out 5-19% under
    # their predictions here (full every other block 654-687 MiB against 778), while their saved
    # tensors match autograd's.
    for (predicted, measured) in peaks.values():
        assert 0.85 <= predicted / measured <= 1.25, shown
    # Falls as predicted: where the prediction sets two modes 75 MiB apart or more, the measurement
    # orders them the same way. Closer ones are not compared: the resident peak of one mode varies by
    # 3-5% (25-40 MiB) from run to run here (op every other block measured 755 and 781 MiB, none 788
    # and 794 MiB), and the prediction is off by up to 19% either way.
    apart = 75 * 2**20
    for low, (predicted_low, measured_low) in peaks.items():
        for high, (predicted_high, measured_high) in peaks.items():
            if predicted_high - predicted_low >= apart:
                assert measured_low < measured_high, f"{low} vs {high}: {shown}"
    assert peaks[FULL, 1][0] <= peaks[NONE, 1][0] - apart  # ... and at least full against none is compared
