"""`llmtrain export --format hf`: folders transformers loads with no llmtrain code, giving llmtrain's
logits, greedy text and token ids; HF -> llmtrain -> HF keeps every tensor; what has no HF form is
refused before anything is written. Offline: HF models are built from their config classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmtrain.config.schema import (
    MlpKind,
    ModelConfig,
    NormKind,
    NormPosition,
    PositionEncoding,
    TokenizerKind,
)
from llmtrain.core.errors import UserError
from llmtrain.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    PretrainedTokenizer,
    gpt2_tokenizer,
)
from llmtrain.generation import generate
from llmtrain.hf.export import export_hf
from llmtrain.hf.layouts import UnsupportedModel
from llmtrain.hf.tokenizer_files import tokenizer_files
from llmtrain.model import GPT
from llmtrain.runs.artifacts import load_run
from llmtrain.runs.export import export_run
from llmtrain.runs.sample import sample_text
from llmtrain.training.loop import train

from .conftest import tiny_config
from .test_prepare import GPT2_MERGES, gpt2_format_files

transformers = pytest.importorskip("transformers")

# conf/model/llama_tiny.yaml's recipe at test size, with a rope_theta, norm_eps and MLP width of its own
LLAMA_STYLE = {"model.position": PositionEncoding.rope, "model.norm": NormKind.rmsnorm, "model.mlp": MlpKind.swiglu,
               "model.bias": False, "model.tie_weights": False, "model.n_head": 4, "model.n_kv_head": 2,
               "model.rope_theta": 500000.0, "model.norm_eps": 1e-5, "model.intermediate_size": 48}
MIXED = "def f(x):\n    return x  # it's 42\n\n\tnaïve café – hello world 🙂  spaces   end\n helloworld wor ."


def trained(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides: object) -> Path:
    """A tiny run trained 20 steps, with its --format hf export in RUN_DIR/export-hf."""
    run = tmp_path_factory.mktemp(name) / "run"
    train(tiny_config(run, max_steps=20, **overrides))
    export_run(run, fmt="hf")
    return run


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt_tiny's recipe (learned positions, LayerNorm, GELU, biases, tied head) on byte tokens."""
    return trained(tmp_path_factory, "gpt2", **{"data.tokenizer": TokenizerKind.byte})


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """modern_tiny's recipe with grouped-query attention (4 query, 2 key/value heads) and an untied
    head, on char tokens with the embedding padded past the tokenizer (vocab_multiple 64)."""
    return trained(tmp_path_factory, "llama", **LLAMA_STYLE, **{"model.vocab_multiple": 64})


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.slow
@pytest.mark.parametrize(("fixture", "architecture"), [("gpt2_run", "GPT2LMHeadModel"),
                                                       ("llama_run", "LlamaForCausalLM")])
def test_transformers_reproduces_the_logits_greedy_text_and_token_ids(fixture: str, architecture: str,
                                                                      request: pytest.FixtureRequest) -> None:
    run_dir = request.getfixturevalue(fixture)
    export = run_dir / "export-hf"
    run, model = load_run(run_dir), hf_model(export)
    assert type(model).__name__ == architecture
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    ids = run.tokenizer.encode(text)[:32]
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert tokenizer(text)["input_ids"] == run.tokenizer.encode(text), "the same ids, no BOS added"
    assert tokenizer.decode(ids) == run.tokenizer.decode(ids)
    with torch.no_grad():
        ours, theirs = run.model(torch.tensor([ids])), model(torch.tensor([ids])).logits
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max().item() < 1e-4

    prompt = ids[:6]
    greedy = generate(run.model, prompt, 20, temperature=0, context=run.context, vocab_limit=run.tokenizer.vocab_size,
                      stop_id=run.tokenizer.eos_id)  # HF stops at eos_token_id too
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=20)
    assert out[0, len(prompt):].tolist() == greedy


@pytest.mark.slow
def test_the_export_records_the_padded_vocabulary_and_special_ids(llama_run: Path) -> None:
    export = llama_run / "export-hf"
    config = json.loads((export / "config.json").read_text())
    generation = json.loads((export / "generation_config.json").read_text())
    tokenizer = load_run(llama_run).tokenizer
    assert isinstance(tokenizer, CharTokenizer)
    assert config["vocab_size"] == 64 * -(-tokenizer.vocab_size // 64) > tokenizer.vocab_size  # the embedding's rows
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    assert (config["rope_theta"], config["rms_norm_eps"], config["intermediate_size"]) == (500000.0, 1e-5, 48)
    assert config["eos_token_id"] == generation["eos_token_id"] == generation["pad_token_id"] == tokenizer.eos_id
    assert generation["suppress_tokens"] == list(range(tokenizer.vocab_size, config["vocab_size"]))
    with open(export / "model.safetensors", "rb") as handle:  # safetensors: 8-byte header length, JSON header
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"} and "lm_head.weight" in header


@pytest.mark.slow
def test_sample_reads_the_hf_export_as_it_reads_the_run(gpt2_run: Path) -> None:
    run_text = sample_text(gpt2_run, prompt="First", max_new_tokens=30, seed=3)
    assert sample_text(gpt2_run / "export-hf", prompt="First", max_new_tokens=30, seed=3) == run_text
    tied = json.loads((gpt2_run / "export-hf" / "config.json").read_text())
    assert tied["tie_word_embeddings"] is True and tied["activation_function"] == "gelu_new"


@pytest.mark.slow
def test_cli_says_what_it_wrote_and_how_to_load_it(gpt2_run: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from llmtrain.cli import main

    out = tmp_path / "mine"
    main(["export", str(gpt2_run), "--format", "hf", "--out", str(out)])
    printed = capsys.readouterr().out
    written = sorted(p.name for p in out.iterdir())
    assert written == ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                       "tokenizer.json", "tokenizer_config.json"]
    assert f"exported to {out} as a Hugging Face GPT2LMHeadModel" in printed
    assert all(name in printed for name in written)
    assert f"AutoModelForCausalLM.from_pretrained('{out}')" in printed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging folder left"

    main(["export", str(gpt2_run), "--format", "hf", "--out", str(out)])  # a previous export is replaced
    assert sorted(p.name for p in out.iterdir()) == written
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(gpt2_run), "--format", "hf", "--out", str(out)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "holds files an export does not write (notes.txt)" in error and "\n" not in error.strip()
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()


# ---- tokenizers -----------------------------------------------------------------------------------

def autotokenizer(tokenizer, folder: Path):
    """`tokenizer` written as HF files into `folder`, read back by AutoTokenizer."""
    folder.mkdir()
    for name, text in tokenizer_files(tokenizer.to_dict(), context=64)[1].items():
        (folder / name).write_text(text)
    return transformers.AutoTokenizer.from_pretrained(folder)


def small_gpt2(tmp_path: Path):
    folder = gpt2_format_files(tmp_path / "gpt2", GPT2_MERGES)
    return gpt2_tokenizer([folder / "vocab.bpe", folder / "encoder.json"])


def pretrained(tmp_path: Path) -> PretrainedTokenizer:
    """A folder tokenizer whose post-processor adds <s> (as Llama's does): llmtrain encodes without it."""
    from tokenizers import AddedToken, processors

    inner = BPETokenizer.fit([MIXED * 3], 300).inner
    inner.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    inner.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                         special_tokens=[("<s>", inner.token_to_id("<s>"))])
    (tmp_path / "src").mkdir()
    inner.save(str(tmp_path / "src" / "tokenizer.json"))
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return PretrainedTokenizer.from_folder(str(tmp_path / "src"))


@pytest.mark.parametrize("kind", ["byte", "char", "bpe", "tiktoken", "pretrained"])
def test_autotokenizer_encodes_and_decodes_like_llmtrain(kind: str, tmp_path: Path) -> None:
    tokenizer = {"byte": lambda: ByteTokenizer(), "char": lambda: CharTokenizer.fit(set(MIXED)),
                 "bpe": lambda: BPETokenizer.fit([MIXED * 3, "hello world " * 20], 300),
                 "tiktoken": lambda: small_gpt2(tmp_path), "pretrained": lambda: pretrained(tmp_path)}[kind]()
    hf = autotokenizer(tokenizer, tmp_path / "hf")
    ids = tokenizer.encode(MIXED)
    assert len(ids) < len(MIXED.encode()) or kind in ("byte", "char")  # the BPEs do merge
    assert hf(MIXED)["input_ids"] == ids
    assert hf.eos_token_id == tokenizer.eos_id is not None
    assert hf.decode(ids + [tokenizer.eos_id], skip_special_tokens=True) == tokenizer.decode(ids) == MIXED


def test_gpt2_bpe_gets_tiktokens_ids_through_derived_merges(tmp_path: Path) -> None:
    tiktoken_bpe = small_gpt2(tmp_path)
    hf = autotokenizer(tiktoken_bpe, tmp_path / "hf")
    merges = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["model"]["merges"]
    assert [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges] == GPT2_MERGES
    for text in ("hello world", " hello  world\n\nworld wor w or", "hellohello, orwor!"):
        assert hf(text)["input_ids"] == tiktoken_bpe.inner.encode_ordinary(text)


# ---- HF -> llmtrain -> HF ---------------------------------------------------------------------------

def hf_folder(tmp_path: Path, layout: str) -> Path:
    """A random GPT2LMHeadModel, or LlamaForCausalLM with GQA and an untied head, saved with a byte tokenizer."""
    torch.manual_seed(0)
    if layout == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=256,
                                         bos_token_id=255, eos_token_id=255)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          hidden_size=32, intermediate_size=48, max_position_embeddings=32,
                                          vocab_size=256, tie_word_embeddings=False, bos_token_id=255,
                                          eos_token_id=255)
        model = transformers.LlamaForCausalLM(config)
    folder = tmp_path / layout
    model.save_pretrained(folder)
    for name, text in tokenizer_files(ByteTokenizer().to_dict(), context=32)[1].items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_hf_to_llmtrain_to_hf_keeps_every_tensor(layout: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source = hf_folder(tmp_path, layout)
    out = export_run(source, tmp_path / "again", fmt="hf")  # load_run: HFFolder + GPT + load_weights
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == json.loads((source / "config.json").read_text())["architectures"]
    mine = load_run(export_run(source, tmp_path / "llmtrain-format"))  # the folder's tokenizer goes along
    assert mine.tokenizer.encode(MIXED) == ByteTokenizer().encode(MIXED) and mine.context == 32


# ---- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "named"), [
    ({"norm_position": NormPosition.post}, "model.norm_position=post (needs pre)"),
    ({"position": PositionEncoding.rope, "norm": NormKind.layernorm}, "model.norm=layernorm (needs rmsnorm)"),
])
def test_a_model_with_no_hf_equivalent_is_refused_before_anything_is_written(change: dict, named: str,
                                                                             tmp_path: Path) -> None:
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, **change), 256)
    with pytest.raises(UnsupportedModel, match="no Hugging Face equivalent") as refused:
        export_hf(model, ByteTokenizer().to_dict(), 16, tmp_path / "out")
    assert named in str(refused.value)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_previous_export_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16), 256)
    out = tmp_path / "out"
    export_hf(model, ByteTokenizer().to_dict(), 16, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    with pytest.raises(UserError, match=r"writing the export into .*out failed \(OSError: \[Errno 28\] No space left"):
        export_hf(model, ByteTokenizer().to_dict(), 16, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "no staging folder left"


def test_cli_refuses_a_post_norm_run_in_one_paragraph(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llmtrain.cli import main

    train(tiny_config(tmp_path / "run", max_steps=3, **{"model.norm_position": NormPosition.post}))
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "run"), "--format", "hf"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "no Hugging Face equivalent" in error and "norm_position=post" in error
    assert "Traceback" not in error and "\n" not in error.strip()
    assert not (tmp_path / "run" / "export-hf").exists()


def test_a_file_as_out_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("")
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16), 256)
    with pytest.raises(UserError, match="is a file"):
        export_hf(model, ByteTokenizer().to_dict(), 16, tmp_path / "out")


def test_a_save_pretrained_folder_is_not_replaced(tmp_path: Path) -> None:
    """The folder a run started from has an export's file names but not its mark: left as it is."""
    source = hf_folder(tmp_path, "gpt2")
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    with pytest.raises(UserError, match="exported_by_llmtrain"):
        export_run(source, source, fmt="hf")
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    again = export_run(source, tmp_path / "export", fmt="hf")
    assert export_run(again, again, fmt="hf") == again  # a previous export is replaced whole


def test_out_as_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16), 256)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    export_hf(model, ByteTokenizer().to_dict(), 16, Path("."))
    assert (tmp_path / "here" / "config.json").is_file() and (tmp_path / "here" / "model.safetensors").is_file()
