"""optim=adamw8bit / adamw4bit: torchao's AdamW with 8-/4-bit moments (the `ao` extra). Built with
the usual groups and settings, a fraction of AdamW's state bytes, an LR set in the form it holds,
the refusals of what cannot work, exact resume, and the pre-flight estimate of its state.

The first step of these optimizers compiles (torch.compile, tens of seconds on CPU, once per
process and set of shapes): everything that steps is in the slow tier."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao.optim", reason="torchao is not installed (pip install 'llmtrain[ao]')")

from llmtrain.checkpoint.disk import tensor_bytes  # noqa: E402
from llmtrain.config.schema import CheckpointFormat, ModelConfig, OptimConfig, OptimizerName  # noqa: E402
from llmtrain.config.validate import validate  # noqa: E402
from llmtrain.core.errors import ConfigError, Interrupted  # noqa: E402
from llmtrain.engine.optim import build_optimizer, set_lr  # noqa: E402
from llmtrain.model import GPT  # noqa: E402
from llmtrain.preflight.estimate import model_shape  # noqa: E402
from llmtrain.training.eta import StepClock  # noqa: E402
from llmtrain.training.loop import train  # noqa: E402

from .conftest import TINY_CORPUS, run_cli, tiny_config  # noqa: E402

LOW_BIT = [OptimizerName.adamw8bit, OptimizerName.adamw4bit]
VOCAB = 64
# 64 wide: the blocks' matrices (64x64 and up) reach torchao's 4096-element threshold, so their
# moments are quantized; the biases and norms keep float32 moments, as they would in any model.
WIDE = {"model.n_embd": 64, "model.n_head": 2}


def _model(width: int = 64, layers: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=layers, n_head=2, n_embd=width, block_size=32, dropout=0.0), VOCAB)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> float:
    tokens = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(seed))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the moments as held (codes, block scales and tables of quantized ones), without the step counts."""
    return sum(tensor_bytes(value) for state in optimizer.state.values()
               for key, value in state.items() if key != "step")


# ---------------------------------------------------------------------------------------------
# quick: construction, the LR, refusals, the ETA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOW_BIT)
def test_builds_torchaos_optimizer_with_the_usual_groups_and_settings(name: OptimizerName) -> None:
    model = _model()
    cfg = OptimConfig(name=name, lr=2e-3, weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-7)
    optimizer = build_optimizer(model, cfg, "cpu")
    assert type(optimizer).__name__ == {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}[name.value]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-7
    assert isinstance(decay["lr"], torch.Tensor) and float(decay["lr"]) == pytest.approx(2e-3)
    assert optimizer.block_size == (256 if name is OptimizerName.adamw8bit else 128)  # torchao's defaults


def test_set_lr_writes_the_lr_in_the_form_the_optimizer_holds() -> None:
    model = _model()
    low_bit = build_optimizer(model, OptimConfig(name=OptimizerName.adamw8bit, lr=1e-3), "cpu")
    plain = build_optimizer(model, OptimConfig(name=OptimizerName.adamw, lr=1e-3), "cpu")
    tensor = low_bit.param_groups[0]["lr"]
    for group in low_bit.param_groups:
        set_lr(group, 5e-4)
    # torchao refuses a float there ("lr was changed to a non-Tensor object"): the same tensor, filled
    assert low_bit.param_groups[0]["lr"] is tensor and float(tensor) == pytest.approx(5e-4)
    assert all(isinstance(g["lr"], torch.Tensor) for g in low_bit.param_groups)
    for group in plain.param_groups:
        set_lr(group, 5e-4)
    assert all(type(g["lr"]) is float and g["lr"] == 5e-4 for g in plain.param_groups)


@pytest.mark.parametrize(("overrides", "words"), [
    ({"optim.fused": True}, "optim.fused=true, but adamw8bit has no fused kernel"),
    ({"parallel.tp": 2, "parallel.nproc": 2}, "cannot run under tensor parallel (parallel.tp=2)"),
    ({"parallel.pp": 2, "parallel.nproc": 2}, "cannot run under pipeline parallel (parallel.pp=2)"),
    ({"parallel.dp_shard": -1, "parallel.nproc": 2, "checkpoint.format": CheckpointFormat.full},
     "with checkpoint.format=full under FSDP2"),
])
def test_combinations_that_cannot_work_are_refused_before_any_work(tmp_path: Path, overrides: dict,
                                                                   words: str) -> None:
    cfg = tiny_config(tmp_path, **{"optim.name": OptimizerName.adamw8bit, "optim.lr": None, "model.dropout": 0.0,
                                   **overrides})
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert words in str(refused.value) and "optim=adamw" in str(refused.value)


def test_a_missing_torchao_is_refused_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError) as refused:
        validate(tiny_config(tmp_path, **{"optim.name": OptimizerName.adamw4bit}))
    assert "torchao package is not installed; pip install 'llmtrain[ao]'" in str(refused.value)


@pytest.mark.parametrize("name", LOW_BIT)
def test_the_lr_defaults_as_adamws_and_fsdp_passes(tmp_path: Path, name: OptimizerName) -> None:
    cfg = tiny_config(tmp_path, **{"optim.name": name, "optim.lr": None, "parallel.dp_shard": -1,
                                   "parallel.nproc": 2})
    validate(cfg)
    adamw = tiny_config(tmp_path, **{"optim.lr": None})
    validate(adamw)
    assert cfg.optim.lr == adamw.optim.lr


def test_a_compiling_first_step_does_not_set_the_eta() -> None:
    now = [0.0]
    clock = StepClock(100, estimate_s=0.5, clock=lambda: now[0], first_step_compiles=True)
    now[0] = 40.0  # step 1: the optimizer's compile
    clock.step_done(1)
    assert clock.eta_text() == "ETA ~0:50", "the estimate's rate, not the compile's 40 s x 99 steps"
    now[0] = 40.5
    clock.step_done(2)
    assert clock.eta_text() == "ETA 0:49"


@pytest.mark.parametrize("name", LOW_BIT)
def test_the_estimate_counts_quantized_moments_by_their_bytes(tmp_path: Path, name: OptimizerName) -> None:
    """Without a step: torchao's own buffers for each parameter, as its first step makes them."""
    cfg = tiny_config(tmp_path, **{"optim.name": name, **WIDE})
    model = GPT(cfg.model, VOCAB)
    optimizer = build_optimizer(model, OptimConfig(name=name, lr=1e-3), "cpu")
    actual = sum(tensor_bytes(optimizer._new_buffer(p, signed)) for p in model.parameters() for signed in (True, False))
    estimated = 4.0 * model_shape(cfg, VOCAB).optimizer_state_elements
    assert estimated == pytest.approx(actual, rel=0.05)
    adamw = 4.0 * model_shape(tiny_config(tmp_path, **WIDE), VOCAB).optimizer_state_elements
    assert estimated < 0.45 * adamw  # at width 64 the float32 moments of biases, norms and positions weigh in


@pytest.mark.parametrize("name", LOW_BIT)
def test_moments_read_back_as_floats_are_quantized_again(name: OptimizerName) -> None:
    """A sharded checkpoint read whole in one process hands the moments over dequantized: they are put
    back into torchao's form (the state stays small); small tensors keep their float32 moments."""
    from llmtrain.engine.optim import requantize_state

    model = _model()
    optimizer = build_optimizer(model, OptimConfig(name=name, lr=1e-3), "cpu")
    big, small = model.blocks[0].mlp.up.weight, model.blocks[0].mlp.up.bias
    torch.manual_seed(1)
    floats = {p: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p) * 1e-3,
                  "exp_avg_sq": torch.rand_like(p) * 1e-6} for p in (big, small)}
    for p, state in floats.items():
        optimizer.state[p] = dict(state)
    requantize_state(optimizer)
    assert type(optimizer.state[big]["exp_avg"]).__name__.startswith("OptimState")
    assert type(optimizer.state[small]["exp_avg"]) is torch.Tensor
    for key in ("exp_avg", "exp_avg_sq"):
        restored = optimizer.state[big][key].dequantize()
        tolerance = 0.2 if name is OptimizerName.adamw4bit else 0.02  # a 4-bit code: 16 levels per block
        assert (restored - floats[big][key]).abs().max() <= tolerance * floats[big][key].abs().max()


# ---------------------------------------------------------------------------------------------
# slow: these step (the first step compiles)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stepped() -> dict[OptimizerName, tuple[GPT, torch.optim.Optimizer, list[float]]]:
    """A 256-wide model, trained 6 steps with each optimizer: (model, optimizer, losses)."""
    out = {}
    for name in [OptimizerName.adamw, *LOW_BIT]:
        model = _model(width=256, layers=1)
        optimizer = build_optimizer(model, OptimConfig(name=name, lr=3e-3), "cpu")
        losses = [_step(model, optimizer, seed=0) for _ in range(6)]  # one batch, again and again: it must fall
        out[name] = (model, optimizer, losses)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", LOW_BIT)
def test_state_is_a_fraction_of_adamws_and_the_loss_falls(stepped: dict, name: OptimizerName) -> None:
    _, optimizer, losses = stepped[name]
    _, adamw, adamw_losses = stepped[OptimizerName.adamw]
    assert state_bytes(optimizer) <= 0.30 * state_bytes(adamw)
    kinds = {type(value).__name__ for state in optimizer.state.values() for value in state.values()}
    assert kinds >= {"OptimState8bit" if name is OptimizerName.adamw8bit else "OptimState4bit", "Tensor"}
    assert losses[-1] < losses[0] - 0.5, losses
    assert adamw_losses[-1] < adamw_losses[0] - 0.5, adamw_losses


@pytest.mark.slow
@pytest.mark.parametrize("name", LOW_BIT)
def test_the_estimate_matches_the_state_torchao_holds(tmp_path: Path, stepped: dict, name: OptimizerName) -> None:
    model, optimizer, _ = stepped[name]
    cfg = tiny_config(tmp_path, **{"optim.name": name, "model.n_embd": 256, "model.n_layer": 1})
    estimated = 4.0 * model_shape(cfg, VOCAB).optimizer_state_elements
    assert estimated == pytest.approx(state_bytes(optimizer), rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", LOW_BIT)
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      name: OptimizerName) -> None:
    """A full checkpoint holds torchao's quantized state (loaded weights_only) and resumes bit for bit."""
    overrides = {"optim.name": name, "max_steps": 6, "checkpoint.every_steps": 3, **WIDE}
    reference = train(tiny_config(tmp_path / "ref", **overrides))
    run = tmp_path / "run"
    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "3")
    with pytest.raises(Interrupted):
        train(tiny_config(run, **overrides))
    monkeypatch.delenv("LLMTRAIN_TEST_STOP_AT_STEP")
    saved = torch.load(run / "checkpoints" / "step_00000003" / "optimizer.pt", weights_only=True)
    assert any(type(v).__name__.startswith("OptimState") for s in saved["optimizer"]["state"].values()
               for v in s.values())
    resumed = train(tiny_config(run, **overrides))
    for step in range(4, 7):
        assert resumed.train_losses[step] == reference.train_losses[step], f"loss differs at step {step}"
    a, b = (torch.load(d / "model.pt", weights_only=True) for d in (run, tmp_path / "ref"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    exported = run_cli("export", str(run), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr


# FSDP2 over 2 gloo processes: sharded parameters (DTensors) step, and the sharded checkpoint
# (torch.distributed.checkpoint) resumes bit for bit.
FSDP_RUN = ["data=text", "data.tokenizer=char", "model.n_layer=2", "model.n_embd=128", "model.n_head=4",
            "model.block_size=32", "model.dropout=0.0", "micro_batch_size=2", "global_batch_size=8", "max_steps=4",
            "schedule.warmup_steps=1", "eval_interval=2", "log_interval=1", "checkpoint.every_steps=2", "threads=1",
            "optim=adamw8bit", "parallel=fsdp", "parallel.nproc=2"]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


@pytest.mark.slow
def test_fsdp_trains_and_its_sharded_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    args = [*FSDP_RUN, f"data.path={TINY_CORPUS}"]
    reference = run_cli("train", *args, f"hydra.run.dir={tmp_path / 'ref'}", cwd=tmp_path, timeout=600)
    assert reference.returncode == 0, reference.stderr
    assert "AdamW8bit; its step compiles during step 1" in reference.stdout
    run = tmp_path / "run"
    stopped = run_cli("train", *args, f"hydra.run.dir={run}", cwd=tmp_path, timeout=600,
                      env={"LLMTRAIN_TEST_STOP_AT_STEP": "2"})
    assert stopped.returncode == 75, stopped.stderr
    assert (run / "checkpoints" / "step_00000002" / "shards" / "__1_0.distcp").is_file()
    resumed = run_cli("train", *args, f"hydra.run.dir={run}", cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 2" in resumed.stdout
    assert _losses(run) == _losses(tmp_path / "ref")
    losses = _losses(run)
    assert losses[4] < losses[1]


@pytest.mark.slow
def test_adamw8bit_reaches_adamws_val_loss_on_the_default_run(tmp_path: Path) -> None:
    """The default run (gpt_tiny on the embedded python_stdlib source), the same steps with each
    optimizer: 8-bit moments end within 1% of AdamW's val loss."""
    val = {}
    for name in ("adamw", "adamw8bit"):
        run = tmp_path / name
        proc = run_cli("train", f"optim={name}", "max_steps=60", "eval_interval=60", "threads=2",
                       f"hydra.run.dir={run}", cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stderr
        lines = (run / "metrics.jsonl").read_text().splitlines()
        val[name] = [r["val_loss"] for r in map(json.loads, lines) if r["kind"] == "eval"][-1]
    print(f"val loss after 60 steps: adamw {val['adamw']:.4f}, adamw8bit {val['adamw8bit']:.4f}", file=sys.stderr)
    assert math.isfinite(val["adamw8bit"])
    assert abs(val["adamw8bit"] - val["adamw"]) <= 0.01 * val["adamw"], val

