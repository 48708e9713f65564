"""finetune=lora: native LoRA adapters on frozen weights. The adapted model starts as the base model,
trains only its adapters, merges back to a plain GPT (in place or from any saved state dict), its
fused q/k/v adapter is three per-projection adapters; a run from a Llama-family Hugging Face folder
trains, resumes bit for bit, samples and exports a merged model transformers reproduces; what this
version does not support is refused in one paragraph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from llmtrain.cli import main
from llmtrain.cli.compose import compose_config
from llmtrain.config.schema import Config, FinetuneConfig, FinetuneMethod, MlpKind, ModelConfig, PositionEncoding
from llmtrain.core.errors import ConfigError, Interrupted
from llmtrain.hf.lora_base import base_weights
from llmtrain.lora import (
    AdapterState,
    LoRALinear,
    adapter_shapes,
    apply_lora,
    merge_lora,
    merged_state_dict,
    trainable_count,
)
from llmtrain.model import GPT
from llmtrain.preflight.estimate import estimate_layout, model_shape
from llmtrain.training.loop import train

from .test_hf_init import TEXT, hf_model, llama_config, save_llama

# Llama-like: RoPE, SwiGLU, grouped-query attention (4 query heads, 2 kv heads), untied head.
LLAMA = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=32, position=PositionEncoding.rope,
                    mlp=MlpKind.swiglu, bias=False, tie_weights=False)
ALL = FinetuneConfig(method=FinetuneMethod.lora, rank=4, alpha=8.0, targets=["attn_qkv", "attn_out", "mlp", "head"])
VOCAB = 48


def tokens(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(3))


def adapted(finetune: FinetuneConfig = ALL, random_b: bool = False) -> tuple[GPT, GPT]:
    """(base model, a copy with adapters); random_b: B drawn too, so the adapters change the output."""
    torch.manual_seed(0)
    base = GPT(LLAMA, VOCAB).eval()
    model = GPT(LLAMA, VOCAB).eval()
    model.load_state_dict(base.state_dict())
    apply_lora(model, finetune)
    if random_b:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_b." in name:
                    param.normal_(0, 0.05)
    return base, model


def test_the_adapted_model_starts_as_the_base_model() -> None:
    base, model = adapted()
    with torch.no_grad():
        assert torch.equal(model(tokens()), base(tokens()))
    adapted_layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(adapted_layers) == 2 * (1 + 1 + 3) + 1  # per block: qkv, proj, gate/up/down; and the head
    # the base tensors keep their state-dict names: a checkpoint of the base model still names them
    assert set(base.state_dict()) <= set(model.state_dict())


def test_only_the_adapters_train_and_the_base_weights_stay() -> None:
    base, model = adapted()
    trainable, total = trainable_count(model)
    shapes = adapter_shapes(LLAMA, ALL, VOCAB)
    assert trainable == sum(torch.Size(s).numel() for s in shapes.values())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(shapes)
    assert total == trainable + sum(p.numel() for p in base.parameters())
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = tokens()
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = model.state_dict()
    for name, tensor in base.state_dict().items():
        assert torch.equal(after[name], tensor), name
    assert any(after[name].abs().sum() > 0 for name in shapes if ".lora_b." in name)  # B moved off zero


def test_merged_equals_unmerged() -> None:
    _, model = adapted(random_b=True)
    x = tokens()
    with torch.no_grad():
        unmerged = model(x)
        from_state = merged_state_dict(model.state_dict())
        merge_lora(model)
        merged = model(x)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-5)
    plain = model.state_dict()
    assert set(from_state) == set(plain)
    assert all(torch.equal(from_state[k], plain[k]) for k in plain)


def test_the_fused_qkv_adapter_is_three_per_projection_adapters() -> None:
    torch.manual_seed(1)
    q_rows, kv_rows, width, rank = 32, 16, 32, 4  # grouped-query: k and v narrower than q
    fused = nn.Linear(width, q_rows + 2 * kv_rows, bias=True)
    lora = LoRALinear(fused, {"q": q_rows, "k": kv_rows, "v": kv_rows}, rank, alpha=8.0, dropout=0.0)
    separate = {}
    start = 0
    for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        linear = nn.Linear(width, rows, bias=True)
        with torch.no_grad():
            linear.weight.copy_(fused.weight[start:start + rows])
            linear.bias.copy_(fused.bias[start:start + rows])
            lora.lora_b[part].normal_()
        separate[part] = LoRALinear(linear, {"w": rows}, rank, alpha=8.0, dropout=0.0)
        with torch.no_grad():
            separate[part].lora_a["w"].copy_(lora.lora_a[part])
            separate[part].lora_b["w"].copy_(lora.lora_b[part])
        start += rows
    x = torch.randn(3, 5, width)
    with torch.no_grad():
        got = lora(x)
        expected = torch.cat([separate[p](x) for p in ("q", "k", "v")], dim=-1)
        assert torch.equal(got, expected)
        delta = torch.cat([separate[p].delta_weight() for p in ("q", "k", "v")])
        assert torch.equal(lora.delta_weight(), delta)


def test_the_estimate_counts_gradients_and_state_for_the_adapters_only() -> None:
    cfg = compose_config(["model=llama_tiny", "device=cpu"])
    lora = compose_config(["model=llama_tiny", "device=cpu", "finetune=lora"])
    full_shape, lora_shape = model_shape(cfg, 256), model_shape(lora, 256)
    adapters = sum(torch.Size(s).numel() for s in adapter_shapes(lora.model, lora.finetune, 256).values())
    assert lora_shape.adapter_params == adapters > 0 and full_shape.adapter_params == 0
    assert lora_shape.optimizer_state_elements == 2 * adapters  # AdamW: two moments
    full, ours = (estimate_layout(c, s, 256, "cpu", c.precision.name) for c, s in ((cfg, full_shape),
                                                                                   (lora, lora_shape)))
    assert ours.gradients == 4.0 * adapters and ours.optimizer == 8.0 * adapters
    assert ours.weights == full.weights + 4.0 * adapters
    assert ours.peak < full.peak


REFUSED = [
    (["finetune.rank=0"], ["'finetune.rank' is 0", "positive adapter rank"]),
    (["finetune.alpha=0"], ["'finetune.alpha' is 0.0", "finite number > 0"]),
    (["finetune.dropout=1.0"], ["'finetune.dropout' is 1.0", "0 <= dropout < 1"]),
    (["finetune.targets=[attn_qkv,mlps]"], ["'mlps'", "valid targets: attn_qkv, attn_out, mlp, head"]),
    (["finetune.targets=[]"], ["'finetune.targets' is empty", "train nothing"]),
    (["finetune.targets=[head]"], ["model.tie_weights=true", "untie"]),  # gpt_tiny ties its head
    (["parallel=tp", "parallel.nproc=2"], ["tensor or pipeline parallel", "parallel.tp=2"]),
    (["parallel=pp", "parallel.nproc=2", "parallel.pp=2"], ["tensor or pipeline parallel", "parallel.pp=2"]),
    (["parallel=zero1", "parallel.nproc=2"], ["parallel.zero1 (ZeRO-1)", "use parallel=ddp, or parallel=fsdp"]),
    (["parallel=hsdp", "parallel.nproc=4"], ["under HSDP yet (2 replicas x 2 shards)", "parallel=fsdp (shards only)"]),
    (["parallel=fsdp", "parallel.nproc=2", "checkpoint.format=sharded"],
     ["writes whole checkpoint files", "checkpoint.format=sharded is not supported"]),
]


@pytest.mark.parametrize(("overrides", "expected"), REFUSED)
def test_refusals_name_the_value_and_what_is_valid(overrides: list[str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as refused:
        compose_config(["finetune=lora", *overrides])
    message = str(refused.value)
    assert "\n" not in message
    for piece in expected:
        assert piece in message, f"{piece!r} not in: {message}"


def test_the_doctor_refuses_lora(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "overfit", "finetune=lora", *TEXT, "--out", str(tmp_path / "doctor")])
    assert exited.value.code == 2
    assert "does not run with finetune=lora yet" in capsys.readouterr().err


def test_lora_on_a_model_from_scratch_trains_with_the_adapters_default_lr(tmp_path: Path) -> None:
    cfg = compose_config(["finetune=lora", *TEXT, "data.seq_len=32", "global_batch_size=4", "max_steps=4",
                          "eval_interval=0", "log_interval=1", "report=false", f"out_dir={tmp_path}"])
    assert cfg.optim.lr == 2e-4
    result = train(cfg)
    assert sorted(result.train_losses) == [1, 2, 3, 4]


# ---- a run from a Llama-family Hugging Face folder ------------------------------------------------

LORA_RUN = {"finetune": FinetuneConfig(method=FinetuneMethod.lora, rank=4, alpha=8.0,
                                       targets=["attn_qkv", "attn_out", "mlp"])}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def cli_run(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`llmtrain train finetune=lora` from the folder, 30 steps, then `export --format hf`."""
    run = tmp_path_factory.mktemp("cli") / "run"
    main(["train", f"model.init_from={folder}", "finetune=lora", "finetune.targets=[attn_qkv,attn_out,mlp]",
          *TEXT, "data.seq_len=32", "global_batch_size=8", "max_steps=30", "optim.lr=1e-2",
          "schedule.warmup_steps=2", "eval_interval=0", "log_interval=1", "report=false", "seed=5",
          f"hydra.run.dir={run}"])
    main(["export", str(run), "--format", "hf"])
    return run


def losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("kind") == "train"]


def test_a_lora_run_from_a_folder_learns_and_exports_the_merged_model(folder: Path, cli_run: Path) -> None:
    seen = losses(cli_run)
    assert len(seen) == 30
    assert sum(seen[-5:]) / 5 < sum(seen[:5]) / 5 - 0.3, seen
    weights = torch.load(cli_run / "model.pt", weights_only=True)
    # model.pt holds the adapters alone (the frozen base is the folder's), and they moved
    assert weights and all(".lora_" in name for name in weights)
    assert weights["blocks.0.attn.qkv.lora_b.q"].abs().max() > 0
    # the export is the merged model: transformers gives llmtrain's logits
    from llmtrain.runs.artifacts import load_run, run_config

    ours = load_run(cli_run).model
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(x)
        got = hf_model(cli_run / "export-hf")(x).logits
        unmerged = GPT(ours.cfg, ours.vocab_size).eval()
        unmerged.load_state_dict(base_weights(folder))
        apply_lora(unmerged, run_config(cli_run).finetune)
        AdapterState(unmerged).load_state_dict(weights)
        torch.testing.assert_close(unmerged(x), expected, rtol=0, atol=1e-5)
        assert (expected - hf_model(folder)(x).logits).abs().max() > 1e-3  # the adapters changed the model
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_sample_works_on_a_lora_run(cli_run: Path, capsys: pytest.CaptureFixture) -> None:
    main(["sample", str(cli_run), "--prompt", "First Citizen:", "--max-new-tokens", "12", "--temperature", "0"])
    out = capsys.readouterr().out
    assert out.startswith("First Citizen:") and len(out) > len("First Citizen:")


def lora_config(folder: Path, out_dir: Path) -> Config:
    cfg = llama_config(folder, out_dir, **LORA_RUN)
    cfg.finetune.dropout = 0.1  # dropout draws from the RNG: the resume must restore it too
    return cfg


def test_a_stopped_lora_run_resumes_bit_for_bit(folder: Path, tmp_path: Path) -> None:
    reference = train(lora_config(folder, tmp_path / "ref"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "3")
        with pytest.raises(Interrupted):
            train(lora_config(folder, tmp_path / "run"))
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "step_00000003" / "optimizer.pt", weights_only=True)
    cfg = lora_config(folder, tmp_path / "run")
    adapters = len(adapter_shapes(cfg.model, cfg.finetune, cfg.model.vocab_size))
    assert len(checkpoint["optimizer"]["state"]) == adapters  # optimizer state for the adapters only
    resumed = train(lora_config(folder, tmp_path / "run"))
    assert sorted(resumed.train_losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.train_losses[step] == reference.train_losses[step], step
    ours = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    theirs = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_lora_under_ddp_and_fsdp_trains_like_one_process(tmp_path: Path) -> None:
    """Two DDP ranks all-reduce only the adapters' gradients (the frozen weights have none); two
    FSDP2 ranks reduce-scatter them. From scratch: the files hold the whole model (under fsdp
    gathered to rank 0 for each save). tests/test_lora_checkpoints.py tests fsdp on a folder."""
    from .conftest import run_cli

    common = ["finetune=lora", *TEXT, "data.seq_len=32", "global_batch_size=4", "max_steps=6", "eval_interval=0",
              "log_interval=1", "optim.lr=3e-3", "checkpoint.every_steps=3", "report=false"]
    layouts = {"one": [], "ddp": ["parallel=ddp", "parallel.nproc=2"], "fsdp": ["parallel=fsdp", "parallel.nproc=2"]}
    for name, extra in layouts.items():
        done = run_cli("train", *common, *extra, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    one = losses(tmp_path / "one")
    assert len(one) == 6
    for name in ("ddp", "fsdp"):
        theirs = losses(tmp_path / name)
        assert len(theirs) == 6 and all(abs(a - b) < 1e-5 for a, b in zip(one, theirs, strict=True)), (name, one,
                                                                                                          theirs)
    whole = torch.load(tmp_path / "fsdp" / "model.pt", weights_only=True)
    expected = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    assert whole.keys() == expected.keys() and "wte.weight" in whole
    assert all(torch.allclose(whole[k], expected[k], atol=1e-5) for k in expected)
