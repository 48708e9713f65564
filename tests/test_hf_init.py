"""model.init_from=FOLDER: a local Hugging Face checkpoint (built here from transformers' config
classes with random weights, never downloaded) becomes an llmtrain model with the same logits,
trains and resumes bit for bit, and brings its tokenizer to prepare and sample; bad folders and
contradicting keys are refused through the CLI before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmtrain.cli import main
from llmtrain.cli.compose import compose_config
from llmtrain.config.schema import Config, PositionEncoding, TokenizerKind
from llmtrain.core.errors import ConfigError, Interrupted
from llmtrain.data.prepare import prepare_data
from llmtrain.data.tokenizers import PretrainedTokenizer
from llmtrain.distributed.layout import Layout
from llmtrain.hf.init import apply_init_from
from llmtrain.training.loop import train
from llmtrain.training.setup import build_model, build_runtime

from .conftest import TINY_CORPUS

transformers = pytest.importorskip("transformers")

EOT = "<|endoftext|>"
HF_VOCAB = 384  # config.json's vocab_size: more rows than the tokenizer's 320 tokens, as real checkpoints pad
TEXT = ["data=text", f"data.path={TINY_CORPUS}", "device=cpu", "threads=1"]


def tiny_tokenizer(folder: Path, vocab_size: int = 320, specials: tuple[str, ...] = (EOT,)) -> int | None:
    """A byte-level BPE trained on the tiny corpus, saved as the folder's tokenizer.json; its EOT id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TINY_CORPUS.read_text()], trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer.token_to_id(EOT)


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Every tensor random (biases and norm gains too: transformers inits them to 0 and 1, which
    would hide a bias or norm loaded into the wrong place)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            gain = 1.0 if ("ln" in name or "norm" in name) and name.endswith("weight") else 0.0
            param.copy_(gain + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def save_gpt2(folder: Path) -> Path:
    eos = tiny_tokenizer(folder)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=512, vocab_size=HF_VOCAB,
                                     bos_token_id=eos, eos_token_id=eos)
    randomized(transformers.GPT2LMHeadModel(config)).save_pretrained(folder)
    return folder


def save_llama(folder: Path) -> Path:
    """Grouped-query attention (4 query heads, 2 kv heads), untied head, as llama_tiny."""
    eos = tiny_tokenizer(folder)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=160, num_hidden_layers=2, max_position_embeddings=64,
                                      vocab_size=HF_VOCAB, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                      bos_token_id=eos, eos_token_id=eos)
    randomized(transformers.LlamaForCausalLM(config)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"gpt2": save_gpt2(root / "gpt2"), "llama": save_llama(root / "llama")}


def hf_model(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_logits_equal_transformers(folders: dict[str, Path], layout: str) -> None:
    cfg = compose_config([f"model.init_from={folders[layout]}", *TEXT])
    runtime = build_runtime(cfg, Layout())
    normal_init = torch.nn.init.normal_
    ours = build_model(cfg, cfg.model.vocab_size, runtime, Layout()).model.eval()
    assert torch.nn.init.normal_ is normal_init, "the init skipped while loading must be back"
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(folders[layout])(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape == (2, 48, HF_VOCAB)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_the_config_takes_the_folders_shape_and_tokenizer(folders: dict[str, Path]) -> None:
    cfg = compose_config([f"model.init_from={folders['llama']}", "data.seq_len=64", *TEXT])
    m = cfg.model
    assert (m.name, m.n_layer, m.n_head, m.n_kv_head, m.n_embd, m.block_size, m.vocab_size) == (
        "llama", 2, 4, 2, 64, 64, HF_VOCAB)
    assert (m.intermediate_size, m.norm_eps, m.tie_weights, m.bias, m.position) == (
        160, 1e-5, False, False, PositionEncoding.rope)
    assert cfg.data.tokenizer is TokenizerKind.pretrained and cfg.data.tokenizer_dir == str(folders["llama"])
    before = repr(cfg)
    apply_init_from(cfg)  # build_run applies it again to a config composed this way
    assert repr(cfg) == before
    with pytest.raises(ConfigError, match=r"'data.seq_len' \(65\) is longer than the model's context"):
        compose_config([f"model.init_from={folders['llama']}", "data.seq_len=65", *TEXT])
    # validated with the folder's context (512), not the default model's (256)
    assert compose_config([f"model.init_from={folders['gpt2']}", "data.seq_len=400", *TEXT]).model.block_size == 512


def llama_config(folder: Path, out_dir: Path, **overrides: object) -> Config:
    cfg = compose_config([f"model.init_from={folder}", *TEXT, "data.seq_len=32", "micro_batch_size=2",
                          "global_batch_size=4", "max_steps=6", "checkpoint.every_steps=3", "eval_interval=0",
                          "log_interval=1", "optim.lr=1e-3", "schedule.warmup_steps=1", "seed=7", "report=false",
                          f"out_dir={out_dir}"])
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="module")
def llama_runs(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run from the Llama folder straight through, and one interrupted at step 3 and resumed."""
    root = tmp_path_factory.mktemp("runs")
    reference = train(llama_config(folders["llama"], root / "ref"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "3")
        with pytest.raises(Interrupted):
            train(llama_config(folders["llama"], root / "run"))
    resumed = train(llama_config(folders["llama"], root / "run"))
    return {"reference": reference, "resumed": resumed, "ref": root / "ref", "run": root / "run"}


def test_training_from_a_folder_resumes_bit_for_bit(folders: dict[str, Path], llama_runs: dict) -> None:
    reference, resumed = llama_runs["reference"], llama_runs["resumed"]
    assert sorted(resumed.train_losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.train_losses[step] == reference.train_losses[step], step
    ours = torch.load(llama_runs["run"] / "model.pt", weights_only=True)
    theirs = torch.load(llama_runs["ref"] / "model.pt", weights_only=True)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # It trained from the folder's weights: 6 Adam steps of lr 1e-3 move each weight by < 0.01, and the
    # folder's RMSNorm gains are 1 +- 0.1 noise (a random init would have them at exactly 1).
    hf = hf_model(folders["llama"]).state_dict()
    started = hf["model.layers.0.input_layernorm.weight"]
    assert (started - 1).abs().max() > 0.1
    assert (ours["blocks.0.norm1.weight"] - started).abs().max() < 0.01
    assert (ours["lm_head.weight"] - hf["lm_head.weight"]).abs().max() < 0.01


def test_sample_works_on_a_run_trained_from_a_folder(llama_runs: dict, capsys: pytest.CaptureFixture) -> None:
    main(["sample", str(llama_runs["run"]), "--prompt", "First Citizen:", "--max-new-tokens", "12",
          "--temperature", "0"])
    out = capsys.readouterr().out
    assert out.startswith("First Citizen:") and len(out) > len("First Citizen:")
    saved = json.loads((llama_runs["run"] / "tokenizer.json").read_text())
    assert (saved["kind"], saved["eos_id"]) == ("pretrained", 0)


def test_prepared_data_uses_the_folders_tokenizer(folders: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    cfg = compose_config([f"model.init_from={folders['gpt2']}", *TEXT])
    data = prepare_data(cfg.data, log=lambda _: None)
    reference = Tokenizer.from_file(str(folders["gpt2"] / "tokenizer.json"))
    text = TINY_CORPUS.read_text()
    expected = reference.encode(text[:2000], add_special_tokens=False).ids
    assert [int(t) for t in data.tokens("train")[:200]] == expected[:200]
    tokenizer = data.tokenizer()
    assert isinstance(tokenizer, PretrainedTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (320, reference.token_to_id(EOT))
    sample = "Speak, speak. We know't!"
    assert tokenizer.encode(sample) == reference.encode(sample, add_special_tokens=False).ids
    assert tokenizer.decode([*tokenizer.encode(sample), tokenizer.eos_id]) == sample


def test_instruction_data_uses_the_folders_tokenizer(folders: dict[str, Path], tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    pairs = [{"prompt": f"Question {i}: who speaks?", "response": f" First Citizen, {i} times."} for i in range(8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = compose_config([f"model.init_from={folders['llama']}", "data=instruct", f"data.path={path}", "device=cpu"])
    data = prepare_data(cfg.data, log=lambda _: None)
    reference = Tokenizer.from_file(str(folders["llama"] / "tokenizer.json"))
    tokens, mask, offsets = data.tokens("train"), data.loss_mask("train"), data.offsets("train")

    def ids(text: str) -> list[int]:
        return reference.encode(text, add_special_tokens=False).ids

    # each example: its prompt (not trained on), response and end-of-text, each part ending in a blank line
    expected = {p["prompt"]: (ids(p["prompt"] + "\n\n"), ids(p["response"] + "\n\n")) for p in pairs}
    first = [int(t) for t in tokens[offsets[0]:offsets[1]]]
    prompt, response = next(parts for parts in expected.values() if first[:len(parts[0])] == parts[0])
    assert first == [*prompt, *response, reference.token_to_id(EOT)]
    assert [int(m) for m in mask[offsets[0]:offsets[1]]] == [0] * len(prompt) + [1] * (len(response) + 1)


def test_prepare_standalone_and_the_cache_follows_the_tokenizers_content(tmp_path: Path) -> None:
    """data.tokenizer=pretrained without init_from: a folder with only tokenizer.json (+ its
    tokenizer_config.json naming the end-of-text token); another tokenizer.json at the same path
    prepares again."""
    folder = tmp_path / "tok"
    tiny_tokenizer(folder, specials=("<pad>", "</s>"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    overrides = ["data.tokenizer=pretrained", f"data.tokenizer_dir={folder}", *TEXT]
    main(["prepare", *overrides])
    first = prepare_data(compose_config(overrides).data, log=lambda _: None)
    assert first.meta["end_of_text_id"] == 1 and first.meta["vocab_size"] == 320
    tiny_tokenizer(folder, vocab_size=300, specials=("<pad>", "</s>"))
    second = prepare_data(compose_config(overrides).data, log=lambda _: None)
    assert second.directory != first.directory and second.meta["vocab_size"] == 300


def test_a_tokenizer_without_end_of_text_is_refused(tmp_path: Path) -> None:
    tiny_tokenizer(tmp_path / "tok", specials=("<pad>",))
    with pytest.raises(ConfigError, match=r"no end-of-text token.*eos_token"):
        PretrainedTokenizer.from_folder(str(tmp_path / "tok"))


def test_check_estimates_the_folders_shapes(folders: dict[str, Path], capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit):
        main(["check", f"model.init_from={folders['gpt2']}", *TEXT])
    out = capsys.readouterr().out
    hf = hf_model(folders["gpt2"])
    body = sum(p.numel() for name, p in hf.named_parameters() if ".wte." not in name and ".wpe." not in name)
    assert body == 25_472  # 2 blocks of width 32 + the final norm
    assert f"{body:,} parameters without embeddings" in out
    assert f"weights from {folders['gpt2']}" in out
    total = sum(p.numel() for p in hf.parameters())  # the tied head is the embedding: counted once
    assert f"weights {total * 4 / 1024:.1f} KiB" in " ".join(out.split())


# ---- refused, through the CLI, before anything is written ------------------------------------------

def damaged(folders: dict[str, Path], tmp_path: Path, damage: str) -> str:
    """A copy of the Llama folder with one thing wrong; the value to give model.init_from."""
    if damage == "hub-name":
        return "HuggingFaceTB/SmolLM-135M"
    folder = tmp_path / "llama"
    shutil.copytree(folders["llama"], folder)
    if damage in ("no-config", "no-weights", "no-tokenizer"):
        name = {"no-config": "config.json", "no-weights": "model.safetensors", "no-tokenizer": "tokenizer.json"}
        (folder / name[damage]).unlink()
    elif damage == "truncated":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:  # config.json changed: another architecture, or a shape its weights do not have
        changes = {"bert": {"architectures": ["BertForMaskedLM"], "model_type": "bert"},
                   "more-layers": {"num_hidden_layers": 3}, "other-width": {"intermediate_size": 128},
                   "no-key": {}}[damage]
        config = {**json.loads((folder / "config.json").read_text()), **changes}
        if damage == "no-key":
            del config["intermediate_size"]
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


REFUSED = [
    pytest.param("ok", ["model=gpt2"], ["model.n_layer is 12 but the folder has 2", "model.n_embd is 768 but the "
                                        "folder has 64", "model=gpt2", "config.json"], id="model-group"),
    pytest.param("ok", ["model.n_layer=7"], ["model.n_layer is 7 but the folder has 2", "drop these overrides"],
                 id="override"),
    pytest.param("ok", ["model.n_layer=4"], ["model.n_layer is 4 but the folder has 2"], id="override-at-default"),
    pytest.param("ok", ["model.tie_weights=true"], ["model.tie_weights is true but the folder has false"],
                 id="bool-override-at-default"),
    pytest.param("ok", ["model.dropout=1.5"], ["'model.dropout' is 1.5; valid range is 0 <= dropout < 1"],
                 id="bad-value"),
    pytest.param("ok", ["data.tokenizer=char"], ["data.tokenizer=char", "tokenizer.json"], id="other-tokenizer"),
    pytest.param("ok", ["data.tokenizer=byte"], ["data.tokenizer=byte", "tokenizer.json"], id="byte-tokenizer-set"),
    pytest.param("no-key", [], ["lacks 'intermediate_size'", "damaged or incomplete"], id="config-lacks-a-key"),
    pytest.param("bert", [], ["BertForMaskedLM", "GPT2LMHeadModel", "LlamaForCausalLM"], id="architecture"),
    pytest.param("no-config", [], ["has no config.json"], id="no-config"),
    pytest.param("no-weights", [], ["has no weights", "model.safetensors"], id="no-weights"),
    pytest.param("no-tokenizer", [], ["has no tokenizer.json", "incomplete"], id="no-tokenizer"),
    pytest.param("truncated", [], ["model.safetensors is not a readable safetensors file", "damaged"],
                 id="truncated-weights"),
    pytest.param("more-layers", [],
                 ["config.json describes 3 layers, but the weights hold 2", "do not belong together"],
                 id="missing-layer"),
    pytest.param("other-width", [], ["model.layers.0.mlp.gate_proj.weight has shape (160, 64)",
                                     "blocks.0.mlp.gate.weight (128, 64)", "do not belong together"], id="wrong-shape"),
    pytest.param("hub-name", [], ["not a folder on this machine", "hf download HuggingFaceTB/SmolLM-135M"],
                 id="hub-name"),
]


@pytest.mark.parametrize(("damage", "overrides", "expected"), REFUSED)
def test_refused_with_one_paragraph_and_no_run_dir(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
    damage: str, overrides: list[str], expected: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    location = str(folders["llama"]) if damage == "ok" else damaged(folders, tmp_path, damage)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(["train", f"model.init_from={location}", *overrides, *TEXT, "max_steps=2", f"hydra.run.dir={run}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("llmtrain: error: ")
    for piece in expected:
        assert piece in message, f"{piece!r} not in: {message}"
    assert not run.exists()


def test_the_same_folder_under_another_spelling_resumes(folders: dict[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """data.tokenizer_dir is stored resolved: a relative path (or a trailing slash) is the same folder."""
    monkeypatch.chdir(folders["llama"].parent)
    relative = compose_config([f"model.init_from={folders['llama'].name}/", *TEXT])
    absolute = compose_config([f"model.init_from={folders['llama']}", *TEXT])
    assert relative.data.tokenizer_dir == absolute.data.tokenizer_dir == str(folders["llama"].resolve())


def test_a_checkpoint_from_before_a_key_existed_resumes() -> None:
    """A key the saved config lacks (added to llmtrain later) counts as its default, not as a change."""
    from llmtrain.checkpoint.resume import SHAPE_KEYS, config_changes
    from llmtrain.config.schema import config_to_dict

    current = config_to_dict(Config())
    saved = json.loads(json.dumps(current))
    for key in ("rope_theta", "n_kv_head", "intermediate_size", "norm_eps", "init_from"):
        del saved["model"][key]
    del saved["data"]["tokenizer_dir"]
    assert config_changes(saved, current) == []
    saved["model"]["n_layer"] = 6
    assert [c for c in config_changes(saved, current) if c[0] in SHAPE_KEYS] == [("model.n_layer", 6, 4)]
