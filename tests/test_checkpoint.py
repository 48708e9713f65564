"""Checkpoints: exact resume, integrity checks, retention, failed saves, non-finite policies."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console

from llmtrain.checkpoint.layout import LATEST
from llmtrain.checkpoint.read import find_good_checkpoint, list_checkpoints, load_checkpoint, verify
from llmtrain.checkpoint.write import CheckpointContents, save_checkpoint
from llmtrain.config.schema import NonFinitePolicy, SaveErrorPolicy
from llmtrain.core.errors import CheckpointError, ConfigError, Interrupted, NonFiniteStop, RunStopped
from llmtrain.engine.state import TrainState
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.model import GPT
from llmtrain.training.loop import train

from .conftest import tiny_config

ACCUMULATED = {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 12, "checkpoint.every_steps": 3}


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def quiet() -> Dashboard:
    return Dashboard(0, Console(file=io.StringIO(), width=200))


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = train(tiny_config(tmp_path / "ref", **ACCUMULATED))
    run = tmp_path / "run"
    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "5")
    with pytest.raises(Interrupted) as stopped:
        train(tiny_config(run, **ACCUMULATED))
    assert stopped.value.checkpoint == run / "checkpoints" / "step_00000005"
    monkeypatch.delenv("LLMTRAIN_TEST_STOP_AT_STEP")
    resumed = train(tiny_config(run, **ACCUMULATED))
    for step in range(6, 13):
        assert resumed.train_losses[step] == reference.train_losses[step], f"loss differs at step {step}"
    assert_bitwise_equal(params(run), params(tmp_path / "ref"))
    starts = records(run, "start")
    assert [s["step"] for s in starts] == [0, 5] and starts[1]["resumed_from"].endswith("step_00000005")


def test_checkpoint_holds_the_full_state(tmp_path: Path) -> None:
    train(tiny_config(tmp_path / "run", max_steps=4, **{"checkpoint.every_steps": 2}))
    checkpoint = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000004")
    trainer = checkpoint.trainer
    assert checkpoint.state.step == 4 and checkpoint.state.tokens == 4 * 8 * 32
    assert set(trainer) >= {"state", "sampler", "rng", "config", "versions"}
    assert trainer["sampler"]["bit_generator"]["bit_generator"] == "PCG64"
    assert trainer["config"]["model"]["n_layer"] == 2 and trainer["versions"]["torch"] == torch.__version__
    assert "state" in checkpoint.optimizer and checkpoint.optimizer["state"], "AdamW moments must be saved"
    assert checkpoint.rng["torch"].dtype == torch.uint8
    assert (tmp_path / "run" / "checkpoints" / LATEST).read_text() == "step_00000004"


def _save_two(tmp_path: Path) -> Path:
    model = GPT(tiny_config(tmp_path).model, 11)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (2, 4):
        save_checkpoint(tmp_path, CheckpointContents(state=TrainState(step=step), config={}, sampler={},
                                                     model=model.state_dict(), optimizer=optimizer.state_dict()))
    return tmp_path


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_latest_falls_back_to_the_previous_checkpoint(tmp_path: Path, damage: str) -> None:
    run = _save_two(tmp_path)
    target = run / "checkpoints" / "step_00000004" / "model.pt"
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match="model.pt"):
        verify(target.parent)
    warnings: list[str] = []
    assert find_good_checkpoint(run, warnings.append) == run / "checkpoints" / "step_00000002"
    assert len(warnings) == 1 and "step_00000004" in warnings[0] and "model.pt" in warnings[0]


def test_resume_uses_the_older_checkpoint_when_the_latest_is_corrupt(tmp_path: Path) -> None:
    overrides = {"max_steps": 6, "checkpoint.every_steps": 2, "checkpoint.keep_last": 3}
    train(tiny_config(tmp_path / "run", **overrides))
    latest = tmp_path / "run" / "checkpoints" / "step_00000006" / "optimizer.pt"
    latest.write_bytes(latest.read_bytes()[:100])
    output = io.StringIO()
    result = train(tiny_config(tmp_path / "run", **overrides), console=Dashboard(6, Console(file=output, width=300)))
    text = output.getvalue()
    assert "optimizer.pt" in text and "trying an older one" in text
    assert "resumed from" in text and "step_00000004" in text
    assert sorted(result.train_losses) == [5, 6]
    assert_bitwise_equal(params(tmp_path / "run"), train_reference(tmp_path, overrides))


def train_reference(tmp_path: Path, overrides: dict) -> dict[str, torch.Tensor]:
    train(tiny_config(tmp_path / "reference", **overrides))
    return params(tmp_path / "reference")


def test_keep_last_and_keep_best(tmp_path: Path) -> None:
    overrides = {"max_steps": 10, "checkpoint.every_steps": 2, "checkpoint.keep_last": 2, "eval_interval": 2,
                 "eval_batches": 2}
    result = train(tiny_config(tmp_path / "run", **overrides))
    best_step = min(result.val_losses, key=result.val_losses.get)
    kept = {p.name for p in list_checkpoints(tmp_path / "run")}
    assert {"step_00000010", "step_00000008", f"step_{best_step:08d}"} == kept
    no_best = train(tiny_config(tmp_path / "nobest", **overrides, **{"checkpoint.keep_best": False}))
    assert no_best.steps == 10
    assert {p.name for p in list_checkpoints(tmp_path / "nobest")} == {"step_00000010", "step_00000008"}


def test_a_failed_save_warns_and_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import llmtrain.checkpoint.write as checkpoint_module

    real = checkpoint_module.write_file
    calls = {"n": 0}

    def failing_after_first_checkpoint(path: Path, write):  # noqa: ANN001, ANN202
        if "step_00000004" in str(path.parent.name) or ".tmp-step_00000004" in str(path):
            calls["n"] += 1
            raise OSError(28, "No space left on device")
        return real(path, write)

    monkeypatch.setattr(checkpoint_module, "write_file", failing_after_first_checkpoint)
    output = io.StringIO()
    result = train(tiny_config(tmp_path / "run", max_steps=5, **{"checkpoint.every_steps": 2}),
                   console=Dashboard(5, Console(file=output, width=300)))
    assert result.steps == 5 and calls["n"] == 1
    assert "No space left on device" in output.getvalue()
    names = {p.name for p in list_checkpoints(tmp_path / "run")}
    assert names == {"step_00000002", "step_00000005"}
    verify(tmp_path / "run" / "checkpoints" / "step_00000002")
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*")), "the failed save left its temp folder"
    assert records(tmp_path / "run", "checkpoint_error")[0]["step"] == 4

    monkeypatch.setattr(checkpoint_module, "write_file", failing_after_first_checkpoint)
    with pytest.raises(RunStopped, match="on_save_error=stop"):
        train(tiny_config(tmp_path / "stop", max_steps=5, **{"checkpoint.every_steps": 2,
                                                              "checkpoint.on_save_error": SaveErrorPolicy.stop}))


def test_config_changes_on_resume_are_shown_or_refused(tmp_path: Path) -> None:
    train(tiny_config(tmp_path / "run", max_steps=4))
    output = io.StringIO()
    result = train(tiny_config(tmp_path / "run", max_steps=6, **{"optim.lr": 1e-3}),
                   console=Dashboard(6, Console(file=output, width=300)))
    text = output.getvalue()
    assert "max_steps: 4 -> 6" in text and "optim.lr: 0.003 -> 0.001" in text
    assert result.steps == 6 and sorted(result.train_losses) == [5, 6]
    config_before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"model\.n_embd: 32 -> 64"):
        train(tiny_config(tmp_path / "run", max_steps=8, **{"model.n_embd": 64}))
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before, (
        "a refused resume must not rewrite the run dir"
    )


def test_resume_never_refuses_to_overwrite_and_a_path_resumes_elsewhere(tmp_path: Path) -> None:
    train(tiny_config(tmp_path / "run", max_steps=4))
    with pytest.raises(ConfigError, match="resume=never"):
        train(tiny_config(tmp_path / "run", max_steps=4, resume="never"))
    result = train(tiny_config(tmp_path / "other", max_steps=6, resume=str(tmp_path / "run")))
    assert sorted(result.train_losses) == [5, 6]
    with pytest.raises(ConfigError, match="neither a checkpoint folder"):
        train(tiny_config(tmp_path / "third", resume=str(tmp_path / "nothing-here")))


# ---------------------------------------------------------------------------------------------
# non-finite loss or gradient (LLMTRAIN_TEST_NAN_AT_STEPS poisons the loss of those steps)
# ---------------------------------------------------------------------------------------------


def assert_all_finite(state: dict[str, torch.Tensor]) -> None:
    for key, value in state.items():
        assert torch.isfinite(value).all(), f"{key} holds a NaN/Inf"


def test_skip_drops_the_update_and_logs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRAIN_TEST_NAN_AT_STEPS", "3")
    result = train(tiny_config(tmp_path / "run", max_steps=6))
    assert result.steps == 6
    events = records(tmp_path / "run", "nonfinite")
    assert [(e["step"], e["action"]) for e in events] == [(3, "skip")]
    assert events[0]["loss"] == "nan", "non-finite values are written as strings: metrics.jsonl stays strict JSON"
    assert 3 not in result.train_losses and all(math.isfinite(v) for v in result.train_losses.values())
    assert_all_finite(params(tmp_path / "run"))


def test_consecutive_skips_escalate_to_rollback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRAIN_TEST_NAN_AT_STEPS", "5,6,7")
    result = train(tiny_config(tmp_path / "run", max_steps=10,
                               **{"checkpoint.every_steps": 4, "checkpoint.rollback_lr_factor": 0.5}))
    events = records(tmp_path / "run", "nonfinite")
    assert [(e["step"], e["action"]) for e in events] == [(5, "skip"), (6, "skip"), (7, "rollback")]
    rollback = records(tmp_path / "run", "rollback")[0]
    assert rollback["to_step"] == 4 and rollback["lr_scale"] == 0.5
    assert result.steps == 10
    assert_all_finite(params(tmp_path / "run"))


def test_rollback_then_stop_when_it_recurs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Step 6 fails, the rollback goes to 4, step 6 fails again: the second time, stop.
    monkeypatch.setenv("LLMTRAIN_TEST_NAN_AT_STEPS", "6,6")
    overrides = {"max_steps": 10, "checkpoint.every_steps": 4, "checkpoint.on_nonfinite": NonFinitePolicy.rollback,
                 "checkpoint.max_rollbacks": 1}
    with pytest.raises(NonFiniteStop, match="recurred") as stopped:
        train(tiny_config(tmp_path / "run", **overrides))
    actions = [e["action"] for e in records(tmp_path / "run", "nonfinite")]
    assert actions == ["rollback", "stop"]
    assert records(tmp_path / "run", "rollback")[0]["to_step"] == 4
    assert_all_finite(load_checkpoint(stopped.value.checkpoint).model)


def test_stop_saves_a_clean_checkpoint_and_explains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRAIN_TEST_NAN_AT_STEPS", "3")
    with pytest.raises(NonFiniteStop) as stopped:
        train(tiny_config(tmp_path / "run", max_steps=6, **{"checkpoint.on_nonfinite": NonFinitePolicy.stop}))
    message = str(stopped.value)
    assert "step 3" in message and "LR too high" in message
    assert stopped.value.exit_code == 3
    assert_all_finite(load_checkpoint(stopped.value.checkpoint).model)
    assert [e["action"] for e in records(tmp_path / "run", "nonfinite")] == ["stop"]


def test_rollback_without_any_checkpoint_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRAIN_TEST_NAN_AT_STEPS", "2")
    with pytest.raises(NonFiniteStop, match="no checkpoint to roll back to"):
        train(tiny_config(tmp_path / "run", max_steps=6, **{"checkpoint.on_nonfinite": NonFinitePolicy.rollback}))


def test_sample_and_export_work_on_an_interrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrain.runs.artifacts import load_run
    from llmtrain.runs.export import export_run
    from llmtrain.runs.sample import sample_text

    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "3")
    with pytest.raises(Interrupted):
        train(tiny_config(tmp_path / "run", max_steps=6))
    assert not (tmp_path / "run" / "model.pt").exists()
    text = sample_text(tmp_path / "run", prompt="A", max_new_tokens=20, seed=1)
    out = export_run(tmp_path / "run")
    assert ((out / "model.safetensors").is_file()
            and json.loads((out / "model_config.json").read_text())["context"] == 32)
    assert sample_text(out, prompt="A", max_new_tokens=20, seed=1) == text, "the export samples like the run"
    exported = load_run(out).model.state_dict()
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000003").model
    assert_bitwise_equal(exported, saved)


def test_a_damaged_checkpoint_named_by_path_is_a_user_error(tmp_path: Path) -> None:
    from llmtrain.core.errors import UserError

    train(tiny_config(tmp_path / "run", max_steps=3))
    target = tmp_path / "run" / "checkpoints" / "step_00000003"
    (target / "rng.pt").write_bytes(b"not a tensor")
    with pytest.raises(UserError, match=r"rng\.pt"):
        train(tiny_config(tmp_path / "other", max_steps=4, resume=str(target)))


def test_time_based_checkpoints(tmp_path: Path) -> None:
    result = train(tiny_config(tmp_path / "run", max_steps=4, **{
        "checkpoint.every_steps": None, "checkpoint.every_minutes": 1e-9, "checkpoint.keep_last": 10}))
    assert result.steps == 4
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == [f"step_{s:08d}" for s in (4, 3, 2, 1)]


def test_an_optimizer_grouping_change_is_refused_before_the_run_dir_changes(tmp_path: Path) -> None:
    train(tiny_config(tmp_path / "run", max_steps=3))
    before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="optim.decay_embeddings"):
        train(tiny_config(tmp_path / "run", max_steps=4, **{"optim.decay_embeddings": False}))
    assert (tmp_path / "run" / "config.yaml").read_text() == before
