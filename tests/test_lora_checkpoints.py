"""LoRA's adapter-only checkpoints and peft export: a LoRA run on a folder's weights saves its
adapters alone (a small fraction of a full fine-tune's checkpoint) with the base folder's identity,
resumes bit for bit, rolls back, refuses a base whose weights changed (resume and readers), and
`export --format peft` writes adapters that peft loads onto the base with llmtrain's logits (Llama,
and GPT-2's fused c_attn as one stacked adapter); what has no adapters is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmtrain.cli import main
from llmtrain.config.schema import FinetuneConfig, FinetuneMethod, NonFinitePolicy
from llmtrain.core.errors import ConfigError, Interrupted, UserError
from llmtrain.runs.artifacts import load_run
from llmtrain.runs.export import export_run
from llmtrain.training.loop import train

from .test_hf_init import TEXT, hf_model, llama_config, save_gpt2, save_llama

LORA = FinetuneConfig(method=FinetuneMethod.lora, rank=4, alpha=8.0, targets=["attn_qkv", "attn_out", "mlp"])


def lora(folder: Path, out_dir: Path, **overrides: object) -> object:
    return llama_config(folder, out_dir, finetune=LORA, **overrides)


def sizes(checkpoint: Path) -> dict[str, int]:
    return {name: (checkpoint / name).stat().st_size for name in ("model.pt", "optimizer.pt")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("hf") / "llama")


def test_an_adapter_only_checkpoint_is_a_small_fraction_of_a_full_one(folder: Path, tmp_path: Path) -> None:
    train(lora(folder, tmp_path / "lora"))
    train(llama_config(folder, tmp_path / "full"))
    ours = sizes(tmp_path / "lora" / "checkpoints" / "step_00000006")
    full = sizes(tmp_path / "full" / "checkpoints" / "step_00000006")
    print(f"checkpoint sizes: LoRA {ours}, full fine-tune {full}")
    weights = torch.load(tmp_path / "lora" / "checkpoints" / "step_00000006" / "model.pt", weights_only=True)
    assert all(".lora_" in name for name in weights)  # adapters and their scalings, no base tensor
    assert sum(ours.values()) < 0.15 * sum(full.values())
    trainer = json.loads((tmp_path / "lora" / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    record = json.loads((tmp_path / "lora" / "lora_base.json").read_text())
    assert trainer["lora_base"] == record and record["path"] == str(folder.resolve())
    assert len(record["sha256"]) == 64
    # the final model.pt is adapters alone too; readers put them on the folder's base
    final = torch.load(tmp_path / "lora" / "model.pt", weights_only=True)
    assert set(final) == set(weights)
    assert load_run(tmp_path / "lora").model.lm_head.weight.shape[0] > 0


def test_a_resume_on_a_changed_base_is_refused_in_one_paragraph(folder: Path, tmp_path: Path) -> None:
    base = shutil.copytree(folder, tmp_path / "base")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "3")
        with pytest.raises(Interrupted):
            train(lora(base, tmp_path / "run"))
    # a moved copy of the same weights is the same base: checked by content, not by path or mtime
    moved = shutil.copytree(base, tmp_path / "moved")
    before = json.loads((tmp_path / "run" / "lora_base.json").read_text())
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4 - i for i in range(4))  # one weight's bytes, the file's size unchanged
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as refused:
        train(lora(base, tmp_path / "run"))
    message = str(refused.value)
    assert "\n" not in message
    for piece in ("Cannot resume from", "not the ones its LoRA adapters were trained on", before["sha256"][:16],
                  "restore its safetensors files", "new run dir"):
        assert piece in message, f"{piece!r} not in: {message}"
    with pytest.raises(UserError, match="not the ones its LoRA adapters were trained on"):
        load_run(tmp_path / "run")  # readers refuse it too
    resumed = train(lora(moved, tmp_path / "run"))
    assert sorted(resumed.train_losses) == [4, 5, 6]


def test_a_rollback_restores_the_adapters(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = lora(folder, tmp_path / "run", max_steps=5)
    cfg.checkpoint.every_steps = 2
    cfg.checkpoint.on_nonfinite = NonFinitePolicy.rollback
    monkeypatch.setenv("LLMTRAIN_TEST_NAN_AT_STEPS", "3")
    result = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rollbacks = [r for r in records if r.get("kind") == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 2, rollbacks
    assert all(torch.isfinite(torch.tensor(loss)) for loss in result.train_losses.values())


# ---- peft --------------------------------------------------------------------------------------

def peft_logits(base: Path, adapter: Path, x: torch.Tensor) -> torch.Tensor:
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft): the round trip needs it")
    model = peft.PeftModel.from_pretrained(hf_model(base), str(adapter)).eval()
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("layout", ["llama", "gpt2"])
def test_peft_loads_the_exported_adapters_with_llmtrains_logits(layout: str, tmp_path: Path) -> None:
    base = (save_llama if layout == "llama" else save_gpt2)(tmp_path / layout)
    run = tmp_path / "run"
    main(["train", f"model.init_from={base}", "finetune=lora", "finetune.rank=4", "finetune.alpha=8",
          "finetune.targets=[attn_qkv,attn_out,mlp]", *TEXT,
          "data.seq_len=32", "global_batch_size=4", "max_steps=8", "optim.lr=1e-2", "eval_interval=0",
          "report=false", "seed=5", f"hydra.run.dir={run}"])
    out = export_run(run, fmt="peft")
    assert out == run / "export-peft"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 4
    x = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    got = peft_logits(base, out, x)
    with torch.no_grad():
        expected = load_run(run).model(x)
        assert (expected - hf_model(base)(x).logits).abs().max() > 1e-3  # the adapters changed the model
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    main(["export", str(run), "--format", "peft"])  # the CLI; a previous peft export is replaced
    if layout == "gpt2":  # c_attn: one adapter of rank 3r, its scaling alpha / r kept
        assert config["rank_pattern"] == {"attn.c_attn": 12} and config["alpha_pattern"] == {"attn.c_attn": 24.0}


def test_peft_export_is_refused_for_a_run_without_adapters_on_a_folder(folder: Path, tmp_path: Path) -> None:
    train(llama_config(folder, tmp_path / "full", max_steps=2))
    with pytest.raises(UserError) as refused:
        export_run(tmp_path / "full", fmt="peft")
    assert "full fine-tune" in str(refused.value) and "--format hf" in str(refused.value)
    assert "\n" not in str(refused.value)
    scratch = tmp_path / "scratch"
    main(["train", "finetune=lora", *TEXT, "data.seq_len=32", "global_batch_size=4", "max_steps=2",
          "eval_interval=0", "report=false", f"hydra.run.dir={scratch}"])
    # from scratch: whole-model files, its base exists nowhere else
    assert "wte.weight" in torch.load(scratch / "model.pt", weights_only=True)
    assert not (scratch / "lora_base.json").exists()
    with pytest.raises(UserError, match="randomly initialized model"):
        export_run(scratch, fmt="peft")


# ---- FSDP2 (parallel=fsdp) -----------------------------------------------------------------------

FSDP_RUN = ["finetune=lora", "finetune.rank=4", "finetune.alpha=8", "finetune.targets=[attn_qkv,attn_out,mlp]",
            *TEXT, "data.seq_len=32", "micro_batch_size=1", "global_batch_size=4", "max_steps=10",
            "checkpoint.every_steps=5", "eval_interval=0", "log_interval=1", "optim.lr=3e-3",
            "schedule.warmup_steps=1", "monitor.interval=2", "report=false", "seed=5"]
FSDP = ["parallel=fsdp", "parallel.nproc=2"]


def train_losses(run: Path) -> dict[int, float]:
    """Train loss by step; a step taken twice (before a stop and after the resume) keeps the last."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


@pytest.fixture(scope="module")
def fsdp_runs(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same LoRA run from the folder in one process and under FSDP2 on 2 gloo ranks."""
    from .conftest import run_cli

    root = tmp_path_factory.mktemp("fsdp")
    runs = {"one": root / "one", "fsdp": root / "fsdp"}
    for name, extra in (("one", []), ("fsdp", FSDP)):
        done = run_cli("train", f"model.init_from={folder}", *FSDP_RUN, *extra, f"hydra.run.dir={runs[name]}",
                       cwd=root)
        assert done.returncode == 0, done.stderr
        assert name == "one" or "FSDP2 (parameters, gradients and optimizer state sharded)" in done.stdout
    return runs


@pytest.mark.slow
def test_lora_under_fsdp_trains_like_one_process(fsdp_runs: dict[str, Path]) -> None:
    """Frozen weights and adapters share each block's FSDP2 unit: only the adapters' gradients are
    reduce-scattered, clipped and stepped; checkpoints hold the adapters alone, in whole files."""
    one, fsdp = train_losses(fsdp_runs["one"]), train_losses(fsdp_runs["fsdp"])
    assert sorted(one) == sorted(fsdp) == list(range(1, 11))
    assert all(fsdp[k] == pytest.approx(one[k], rel=1e-5) for k in one), (one, fsdp)
    checkpoint = fsdp_runs["fsdp"] / "checkpoints" / "step_00000005"
    assert not (checkpoint / "shards").exists()
    saved = torch.load(checkpoint / "model.pt", weights_only=True)
    assert saved and all(".lora_" in name for name in saved)
    final = torch.load(fsdp_runs["fsdp"] / "model.pt", weights_only=True)
    assert set(final) == set(saved)
    ours, theirs = (load_run(fsdp_runs[name]).model.state_dict() for name in ("one", "fsdp"))
    assert ours.keys() == theirs.keys()
    for name in ours:  # the merged models: the folder's weights plus the adapters' deltas
        torch.testing.assert_close(theirs[name], ours[name], rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
def test_a_stopped_lora_run_under_fsdp_resumes_as_if_never_stopped(folder: Path, fsdp_runs: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    from .conftest import run_cli

    argv = ["train", f"model.init_from={folder}", *FSDP_RUN, *FSDP, f"hydra.run.dir={tmp_path / 'run'}"]
    stopped = run_cli(*argv, cwd=tmp_path, env={"LLMTRAIN_TEST_STOP_AT_STEP": "5"})
    assert stopped.returncode == 75, stopped.stderr
    resumed = run_cli(*argv, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    got, uninterrupted = train_losses(tmp_path / "run"), train_losses(fsdp_runs["fsdp"])
    assert sorted(got) == list(range(1, 11))
    assert all(got[k] == pytest.approx(uninterrupted[k], rel=1e-5) for k in uninterrupted), (got, uninterrupted)
    ours = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    theirs = torch.load(fsdp_runs["fsdp"] / "model.pt", weights_only=True)
    assert set(ours) == set(theirs)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)
