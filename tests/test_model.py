"""Model switches, init schemes, parameter groups, and the loop under every precision."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmtrain.config.schema import (
    ActivationCheckpointing,
    HeadInit,
    MlpKind,
    ModelConfig,
    NormKind,
    NormPosition,
    OptimConfig,
    PositionEncoding,
    Precision,
    ResidualInit,
)
from llmtrain.engine.optim import param_groups
from llmtrain.engine.step import loss_sum
from llmtrain.model import GPT, param_count
from llmtrain.model_tensors import model_tensors
from llmtrain.training.loop import train

from .conftest import tiny_config

VOCAB = 37


def build(**kw: object) -> GPT:
    torch.manual_seed(0)
    base = dict(n_layer=2, n_head=2, n_embd=16, block_size=12)
    return GPT(ModelConfig(**{**base, **kw}), VOCAB)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"norm_position": NormPosition.post},
        {"position": PositionEncoding.rope, "norm": NormKind.rmsnorm, "mlp": MlpKind.swiglu, "bias": False},
        {"tie_weights": False, "head_init": HeadInit.tiny},
        {"init": "xavier"},
        {"init": "kaiming"},
        {"dropout": 0.1},
    ],
    ids=["gpt", "post-ln", "modern", "untied", "xavier", "kaiming", "dropout"],
)
def test_every_variant_is_causal_and_learns(kw: dict) -> None:
    model = build(**kw)
    x = torch.randint(0, VOCAB, (3, 12))
    model.eval()
    with torch.no_grad():
        full = model(x)
        prefix = model(x[:, :7])
    # Causality: the first 7 positions cannot see what follows them.
    torch.testing.assert_close(full[:, :7], prefix, rtol=1e-4, atol=1e-5)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):  # memorize one batch
        loss = loss_sum(model(x[:, :-1]), x[:, 1:]) / x[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_residual_init_scaled_zero_and_plain() -> None:
    std, layers = 0.02, 6
    big = dict(n_layer=layers, n_embd=256, n_head=4, block_size=8)
    scaled = build(**big, residual_init=ResidualInit.scaled)
    assert scaled.blocks[0].attn.proj.weight.std().item() == pytest.approx(std / math.sqrt(2 * layers), rel=0.05)
    assert scaled.blocks[0].attn.qkv.weight.std().item() == pytest.approx(std, rel=0.05)
    zero = build(**big, residual_init=ResidualInit.zero)
    assert all(b.attn.proj.weight.abs().sum() == 0 and b.mlp.down.weight.abs().sum() == 0 for b in zero.blocks)
    plain = build(**big, residual_init=ResidualInit.plain)
    assert plain.blocks[0].mlp.down.weight.std().item() == pytest.approx(std, rel=0.05)
    # A zeroed residual branch makes every block the identity at init.
    x = torch.randn(2, 8, 256)
    torch.testing.assert_close(zero.blocks[0](x), x)


def test_head_init_zero_and_tied_weights() -> None:
    untied = build(tie_weights=False, head_init=HeadInit.zero)
    assert untied.lm_head.weight.abs().sum() == 0
    tied = build()
    assert tied.lm_head.weight is tied.wte.weight
    assert param_count(tied) == param_count(build(tie_weights=False)) - VOCAB * 16


def test_flops_per_token_is_6n_plus_attention() -> None:
    model = build()
    # Lookups are not matmuls, but the tied head is: minus the embedding, plus the head = same count.
    n_matmul = param_count(model, exclude_positions=True)
    assert model_tensors(model.cfg, VOCAB).flops_per_token(12) == 6 * n_matmul + 12 * 2 * 16 * 12


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    x = torch.randint(0, VOCAB, (2, 12))
    grads = []
    for ckpt in (ActivationCheckpointing.none, ActivationCheckpointing.full):
        model = build(activation_checkpointing=ckpt, dropout=0.0)
        (loss_sum(model(x[:, :-1]), x[:, 1:])).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7)


def test_no_weight_decay_on_biases_norms_and_optionally_embeddings() -> None:
    model = build(tie_weights=False)
    decay, no_decay = param_groups(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(not n.endswith("bias") and "norm" not in n for n in decayed)
    assert {"wte.weight", "wpe.weight", "lm_head.weight", "blocks.0.attn.qkv.weight"} <= decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    _, no_decay_embeddings = param_groups(model, OptimConfig(decay_embeddings=False))
    assert {"wte.weight", "wpe.weight"} <= {names[id(p)] for p in no_decay_embeddings["params"]}


# fp16 on a CPU takes ~12 s: slow (bf16 keeps the quick tier's coverage of autocast)
@pytest.mark.parametrize("precision", [Precision.bf16, pytest.param(Precision.fp16, marks=pytest.mark.slow)])
def test_train_loop_under_mixed_precision(tmp_path: Path, precision: Precision) -> None:
    result = train(tiny_config(tmp_path / "run", max_steps=4, **{"precision.name": precision}))
    losses = list(result.train_losses.values())
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scales = [r.get("loss_scale") for r in records if r["kind"] == "train"]
    if precision is Precision.fp16:
        assert all(s is not None and s > 0 for s in scales), "fp16 logs its dynamic loss scale"
    else:
        assert scales == [None] * 4


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": False},
                                       {"position": PositionEncoding.rope, "norm": NormKind.rmsnorm,
                                        "mlp": MlpKind.swiglu, "n_kv_head": 1, "bias": False}])
def test_model_tensors_are_the_built_models(overrides: dict) -> None:
    """The shapes and counts known without building equal the built model's, for 3 layers."""
    model = build(n_layer=3, **overrides)
    tensors = model_tensors(model.cfg, VOCAB)
    assert dict(tensors.items()) == {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert tensors.n_params == param_count(model)
    assert tensors.n_tensors == len(model.state_dict())
    assert tensors.build_bytes() == 4 * (param_count(model) + sum(b.numel() for b in model.buffers()))


def test_model_tensors_of_a_billion_layers_are_known_at_once() -> None:
    """A config read from a file may say anything: its size is counted, not built (a meta model of
    10^9 blocks took minutes and gigabytes)."""
    tensors = model_tensors(ModelConfig(n_layer=10**9, n_head=2, n_embd=16, block_size=8), VOCAB)
    assert tensors.n_tensors > 10**9 and tensors.n_params > 10**9
