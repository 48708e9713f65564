"""finetune=qlora: LoRA's adapters on a base whose block linears are stored in 4-bit NF4 (torchao).
The layers hold NF4 (about a seventh of fp32's bytes, as the estimate counts them), the model starts
as the dequantized base and trains only its adapters, a stopped run resumes bit for bit (the folder
re-quantized to the same bits, nothing of the base in the checkpoints), readers and the hf export
merge onto the dequantized base with the run's logits, the peft export's adapters reproduce them on
that base; what QLoRA cannot run is refused in one paragraph."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from llmtrain.cli.compose import compose_config
from llmtrain.config.schema import FinetuneConfig, FinetuneMethod, MlpKind, ModelConfig, PositionEncoding
from llmtrain.core.errors import ConfigError, Interrupted
from llmtrain.hf.lora_base import base_weights
from llmtrain.lora import AdapterState, apply_lora, merged_state_dict
from llmtrain.model import GPT
from llmtrain.preflight.estimate import estimate_layout, model_shape
from llmtrain.qlora import NF4_RECORD, dequantized_base, is_nf4, nf4_footprint, to_nf4
from llmtrain.training.loop import train

from .test_hf_init import TEXT, hf_model, llama_config, save_llama

pytest.importorskip("torchao", reason="finetune=qlora needs torchao (pip install torchao)")

# Llama-like, wide enough for NF4's blocks of 64 values (model.n_embd a multiple of 64)
LLAMA = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32, position=PositionEncoding.rope,
                    mlp=MlpKind.swiglu, bias=False, tie_weights=False)
VOCAB = 320
QLORA = FinetuneConfig(method=FinetuneMethod.qlora, rank=4, alpha=8.0, targets=["attn_qkv", "attn_out"])
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.gate", "mlp.up", "mlp.down")


def adapted(finetune: FinetuneConfig = QLORA) -> tuple[GPT, GPT]:
    """(the full-precision base, a copy with QLoRA applied: adapters, and the base in NF4)."""
    torch.manual_seed(0)
    base = GPT(LLAMA, VOCAB).eval()
    model = GPT(LLAMA, VOCAB).eval()
    model.load_state_dict(base.state_dict())
    apply_lora(model, finetune)
    return base, model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def test_the_layers_hold_the_base_in_nf4_at_about_a_seventh_of_fp32() -> None:
    _, model = adapted()
    state = model.state_dict()
    # every linear of every block, adapted (attn) or not (mlp); the embedding and an unadapted head as they were
    for i in range(LLAMA.n_layer):
        assert all(is_nf4(state[f"blocks.{i}.{name}.weight"]) for name in BLOCK_LINEARS)
    assert not is_nf4(state["lm_head.weight"]) and not is_nf4(state["wte.weight"])
    values, stored = nf4_footprint(model)
    assert values == sum(state[f"blocks.{i}.{n}.weight"].numel() for i in range(2) for n in BLOCK_LINEARS)
    print(f"NF4 base: {stored:,} bytes for {values:,} weights, {4 * values / stored:.2f}x smaller than fp32")
    assert 4 * values / 8 < stored < 4 * values / 7  # ~0.52 bytes a weight
    head = adapted(FinetuneConfig(method=FinetuneMethod.qlora, rank=4, alpha=8.0, targets=["head"]))[1]
    assert is_nf4(head.state_dict()["lm_head.weight"])  # an adapted head is quantized too, as torchtune's
    # quantizing is a pure function of the weights: the same bits every time (what resume relies on)
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    a, b = to_nf4(w), to_nf4(w.clone())
    for name in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_it_starts_as_the_dequantized_base_and_trains_only_the_adapters() -> None:
    base, model = adapted()
    plain = GPT(LLAMA, VOCAB).eval()
    plain.load_state_dict(dequantized_base(base.state_dict(), NF4_RECORD))  # no head adapter: the head stays fp32
    x = tokens()
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))  # lora_b starts at zero: the dequantized base exactly
        assert (model(x) - base(x)).abs().max() > 1e-3  # ... which is not the full-precision base
    frozen = {n: t.get_original_weight().clone() for n, t in model.state_dict().items() if is_nf4(t)}
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    assert all(torch.equal(state[n].get_original_weight(), w) for n, w in frozen.items())
    assert state["blocks.0.attn.qkv.lora_b.q"].abs().max() > 0


def test_the_estimate_counts_the_nf4_bytes_the_model_holds() -> None:
    common = ["model=llama_tiny", "device=cpu", "finetune.targets=[attn_qkv,attn_out,mlp]"]
    lora, qlora = compose_config([*common, "finetune=lora"]), compose_config([*common, "finetune=lora"])
    qlora.finetune.method = FinetuneMethod.qlora  # from scratch, which a run refuses: the counts need no folder
    ours, theirs = model_shape(qlora, 256), model_shape(lora, 256)
    model = GPT(qlora.model, 256)
    apply_lora(model, qlora.finetune)
    assert (ours.nf4_params, ours.nf4_bytes) == nf4_footprint(model) and theirs.nf4_params == 0
    low, high = (estimate_layout(c, s, 256, "cpu", c.precision.name) for c, s in ((qlora, ours), (lora, theirs)))
    assert low.weights == high.weights - (4.0 * ours.nf4_params - ours.nf4_bytes)
    assert low.gradients == high.gradients and low.optimizer == high.optimizer


# ---- a run from a Llama-family Hugging Face folder ------------------------------------------------

RUN = FinetuneConfig(method=FinetuneMethod.qlora, rank=4, alpha=8.0, targets=["attn_qkv", "attn_out", "mlp"],
                     dropout=0.1)  # dropout draws from the RNG: the resume restores it too


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def runs(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A QLoRA run from the folder straight through, and one stopped at step 3 and resumed."""
    root = tmp_path_factory.mktemp("qlora")

    def config(out: Path) -> object:
        return llama_config(folder, out, finetune=FinetuneConfig(**vars(RUN)))

    reference = train(config(root / "ref"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "3")
        with pytest.raises(Interrupted):
            train(config(root / "run"))
    resumed = train(config(root / "run"))
    return {"reference": reference, "resumed": resumed, "ref": root / "ref", "run": root / "run"}


def test_a_stopped_qlora_run_resumes_bit_for_bit_without_the_base_in_its_files(runs: dict) -> None:
    reference, resumed = runs["reference"], runs["resumed"]
    assert sorted(resumed.train_losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.train_losses[step] == reference.train_losses[step], step
    ours = torch.load(runs["run"] / "model.pt", weights_only=True)
    theirs = torch.load(runs["ref"] / "model.pt", weights_only=True)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    checkpoint = torch.load(runs["run"] / "checkpoints" / "step_00000003" / "model.pt", weights_only=True)
    assert checkpoint and all(".lora_" in name for name in checkpoint)  # adapters alone, never the NF4 base
    record = json.loads((runs["ref"] / "lora_base.json").read_text())
    assert record["quantized"] == NF4_RECORD
    trainer = json.loads((runs["run"] / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert trainer["lora_base"] == record


def test_readers_and_the_hf_export_merge_onto_the_dequantized_base(folder: Path, runs: dict) -> None:
    from llmtrain.runs.artifacts import load_run
    from llmtrain.runs.export import export_run

    run = runs["ref"]
    ours = load_run(run).model
    weights = torch.load(run / "model.pt", weights_only=True)
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(x)
        trained = GPT(ours.cfg, ours.vocab_size).eval()  # the model as the run held it: NF4 base, adapters beside
        trained.load_state_dict(base_weights(folder))
        apply_lora(trained, RUN)
        trained.eval()  # the adapters' dropout layers are new, in training mode
        AdapterState(trained).load_state_dict(weights)
        torch.testing.assert_close(trained(x), expected, rtol=0, atol=1e-5)
        on_full = GPT(ours.cfg, ours.vocab_size).eval()  # merged onto the folder's own weights instead
        on_full.load_state_dict(merged_state_dict({**base_weights(folder), **weights}))
        assert (on_full(x) - expected).abs().max() > 1e-3  # the quantization error: the base matters
        got = hf_model(export_run(run, fmt="hf"))(x).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_the_peft_export_holds_the_adapters_as_trained(folder: Path, runs: dict, tmp_path: Path) -> None:
    """peft puts the adapters on a transformers base: on the dequantized base (written here as an hf
    folder) they give the run's logits; peft's own QLoRA base (bitsandbytes) differs from it by the
    quantization error, as the full-precision folder does."""
    peft = pytest.importorskip("peft", reason="peft is not installed: the round trip needs it")
    from safetensors import safe_open

    from llmtrain.hf.export import export_hf
    from llmtrain.runs.artifacts import load_run
    from llmtrain.runs.export import export_run

    run = runs["ref"]
    out = export_run(run, fmt="peft")
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as handle:
        assert handle.metadata()["llmtrain_base_quantization"] == "nf4"
    trained = load_run(run)
    base = GPT(trained.model.cfg, trained.model.vocab_size).eval()
    adapters = torch.load(run / "model.pt", weights_only=True)
    state = dequantized_base({**base_weights(folder), **adapters}, NF4_RECORD)
    base.load_state_dict({n: t for n, t in state.items() if ".lora_" not in n})
    export_hf(base, trained.tokenizer.to_dict(), trained.context, tmp_path / "nf4-base")
    x = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf_model(tmp_path / "nf4-base"), str(out)).eval()(x).logits
        expected = trained.model(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_a_folder_is_quantized_as_it_is_read_to_the_bits_of_the_whole_base(folder: Path, tmp_path: Path) -> None:
    """folder_model with QLoRA's settings quantizes each weight as it is read (its full-precision copy
    is never held with the others): the same NF4 bits, and the same other tensors, as quantizing
    the whole loaded base after (what the run did before, and what readers rebuild)."""
    from llmtrain.training.setup import folder_model

    cfg = llama_config(folder, tmp_path, finetune=FinetuneConfig(**vars(RUN)))
    vocab, cpu = cfg.model.vocab_size, torch.device("cpu")
    torch.manual_seed(5)
    ours = folder_model(cfg.model, vocab, cpu, cfg.finetune)
    assert any(is_nf4(t) for t in ours.state_dict().values())  # before the adapters: quantized as read
    apply_lora(ours, cfg.finetune)
    torch.manual_seed(5)
    whole = folder_model(cfg.model, vocab, cpu)
    assert not any(is_nf4(t) for t in whole.state_dict().values())
    apply_lora(whole, cfg.finetune)
    a, b = ours.state_dict(), whole.state_dict()
    assert list(a) == list(b)
    for name, tensor in b.items():
        assert is_nf4(a[name]) == is_nf4(tensor), name
        if is_nf4(tensor):
            for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
                assert torch.equal(getattr(a[name], part), getattr(tensor, part)), (name, part)
        else:
            assert torch.equal(a[name], tensor), name


def test_a_failure_to_store_a_tensor_is_not_called_a_damaged_folder(folder: Path, tmp_path: Path) -> None:
    """Only a failed read says the folder is damaged; quantizing (or the device) failing shows as itself."""
    from llmtrain.hf.folder import load_weights
    from llmtrain.hf.init import open_folder

    cfg = llama_config(folder, tmp_path)
    model = GPT(cfg.model, cfg.model.vocab_size)

    def fails(name: str, value: torch.Tensor) -> bool:
        raise RuntimeError("quantizing failed")

    with pytest.raises(RuntimeError, match="quantizing failed"):
        load_weights(model, open_folder(str(folder)), store=fails)


def test_moving_to_a_device_leaves_nf4_where_it_is_and_keeps_tied_weights_tied() -> None:
    """The rest of a QLoRA model moves to the run's device after the folder is read; its NF4 weights
    were quantized there already. (The meta device stands in for a GPU.)"""
    from llmtrain.qlora import store_nf4, to_device_but_nf4

    gpt = ModelConfig(n_layer=1, n_head=2, n_embd=64, block_size=16, tie_weights=True)
    model = GPT(gpt, VOCAB)
    store_nf4(model, "blocks.0.attn.qkv.weight", model.blocks[0].attn.qkv.weight.detach())
    to_device_but_nf4(model, torch.device("meta"))
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.is_meta
    assert is_nf4(model.blocks[0].attn.qkv.weight) and model.blocks[0].attn.qkv.weight.device.type == "cpu"
    assert all(t.is_meta for n, t in model.state_dict().items() if n != "blocks.0.attn.qkv.weight")
    assert not model.blocks[0].attn.qkv.weight.requires_grad and model.blocks[0].mlp.up.weight.requires_grad


_BUILD_PEAK = """
import json, sys
import torch
from llmtrain.cli.compose import compose_config
from llmtrain.config.schema import FinetuneConfig, FinetuneMethod
from llmtrain.lora import apply_lora
from llmtrain.qlora import import_nf4
from llmtrain.training.setup import folder_model

import_nf4()  # torchao's modules, loaded by either path
cfg = compose_config(json.loads(sys.argv[1]))
qlora = FinetuneConfig(method=FinetuneMethod.qlora, targets=["attn_qkv"])
status = lambda key: int(dict(l.split(":", 1) for l in open("/proc/self/status"))[key].split()[0]) * 1024
before = status("VmRSS")
if sys.argv[2] == "as-read":
    model = folder_model(cfg.model, cfg.model.vocab_size, torch.device("cpu"), qlora)
else:  # the whole base loaded, then quantized (the way before)
    model = folder_model(cfg.model, cfg.model.vocab_size, torch.device("cpu"))
apply_lora(model, qlora)
print(json.dumps({"rise": status("VmHWM") - before}))
"""


@pytest.mark.slow  # two fresh processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status: Linux")
def test_reading_a_folder_for_qlora_never_holds_its_full_precision_base(tmp_path: Path) -> None:
    """A 24 x 384 Llama (block linears 144 MiB in fp32, 19 MiB in NF4). Quantized as read, building
    the model raises the process's peak by far less than loading the whole base first (the way
    before) does. Measured here: 139-140 MiB against 203-209: the rest of the rise is torchao's
    transients for one tensor (~16 floats a value) and what its first call loads, both paths alike."""
    import subprocess

    import transformers

    from .test_hf_init import randomized, tiny_tokenizer

    layers, width, hidden = 24, 384, 1024
    eos = tiny_tokenizer(tmp_path / "big")
    config = transformers.LlamaConfig(hidden_size=width, num_attention_heads=width // 64, num_key_value_heads=2,
                                      intermediate_size=hidden, num_hidden_layers=layers, max_position_embeddings=64,
                                      vocab_size=320, tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos)
    randomized(transformers.LlamaForCausalLM(config)).save_pretrained(tmp_path / "big")
    overrides = [f"model.init_from={tmp_path / 'big'}", *TEXT, "data.seq_len=32", f"out_dir={tmp_path / 'run'}"]
    kv = 2 * 2 * 64  # k and v: 2 heads of 64
    fp32 = 4 * layers * (width * (width + kv) + width * width + 3 * width * hidden)  # the block linears NF4 stores
    rises = {}
    for way in ("as-read", "whole"):
        proc = subprocess.run([sys.executable, "-c", _BUILD_PEAK, json.dumps(overrides), way],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        rises[way] = json.loads(proc.stdout.strip().splitlines()[-1])["rise"]
    shown = {way: f"{rise / 2**20:.0f} MiB" for way, rise in rises.items()} | {"fp32 base": f"{fp32 / 2**20:.0f} MiB"}
    print(shown)
    assert rises["whole"] - rises["as-read"] > 0.3 * fp32, shown


# ---- refusals ---------------------------------------------------------------------------------------

def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as refused:
        compose_config(["finetune=qlora", *TEXT, *overrides])
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_qlora_without_torchao_is_refused(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec  # as the low-bit optimizers' test hides it: the one check both use
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    message = refusal([f"model.init_from={folder}"])
    for piece in ("finetune.method=qlora", "torchao package is not installed", "pip install 'llmtrain[ao]'",
                  "finetune=lora"):
        assert piece in message, f"{piece!r} not in: {message}"


def test_qlora_on_a_random_init_is_refused() -> None:
    message = refusal([])
    for piece in ("needs model.init_from", "randomly initialized", "finetune=full", "finetune=lora"):
        assert piece in message, f"{piece!r} not in: {message}"


@pytest.mark.parametrize("layout", [["parallel=ddp", "parallel.nproc=2"], ["parallel=fsdp", "parallel.nproc=2"]])
def test_qlora_over_two_processes_is_refused(folder: Path, layout: list[str]) -> None:
    message = refusal([f"model.init_from={folder}", *layout])
    for piece in ("runs in one process", "this run has 2", "parallel=single", "finetune=lora"):
        assert piece in message, f"{piece!r} not in: {message}"


def test_a_width_nf4_blocks_do_not_fit_is_refused(folder: Path) -> None:
    from llmtrain.config.finetune import validate_finetune

    cfg = compose_config(["finetune=qlora", *TEXT, f"model.init_from={folder}"])
    cfg.model.n_embd = 96  # a folder of that width: its layers do not split into blocks of 64 values
    with pytest.raises(ConfigError, match="model.n_embd=96 is not a multiple of 64.*finetune=lora"):
        validate_finetune(cfg, 1, 1)
