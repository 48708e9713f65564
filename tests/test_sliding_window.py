"""model.sliding_window: each token attends to itself and the sliding_window - 1 tokens before it.
A window that covers the sequence is the plain causal path, bit for bit; a shorter one equals a
hand-written band-masked attention, hides exactly the tokens outside it (one layer), is what
evaluation and KV-cached generation see, trains, is refused when not positive, and exports as a
Mistral that transformers runs to the same logits (a GPT-2-style model with a window is refused; so
is a Hugging Face config whose window its architecture would ignore)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmtrain import model as gpt
from llmtrain.config.schema import MlpKind, ModelConfig, NormKind, PositionEncoding
from llmtrain.config.validate import validate_model
from llmtrain.core.errors import ConfigError
from llmtrain.data.tokenizers import ByteTokenizer
from llmtrain.evaluation.scoring import Scorer
from llmtrain.generation import generate
from llmtrain.hf.export import export_hf
from llmtrain.hf.layouts import UnsupportedModel, model_fields
from llmtrain.model import GPT

from .conftest import TINY_CORPUS, run_cli

VOCAB = 256  # the byte tokenizer's, so the model exports with it
# Llama's recipe (RoPE, RMSNorm, SwiGLU, no biases) with grouped-query attention, as a Mistral has it
LLAMA_STYLE = {"position": PositionEncoding.rope, "norm": NormKind.rmsnorm, "mlp": MlpKind.swiglu, "bias": False,
               "tie_weights": False, "n_kv_head": 2, "intermediate_size": 48}


def models(window: int | None, n_layer: int = 2, **shape: object) -> tuple[GPT, GPT]:
    """(the model without a window, the same weights with `window`), both in eval mode."""
    cfg = {"n_layer": n_layer, "n_head": 4, "n_embd": 32, "block_size": 64, **shape}
    torch.manual_seed(0)
    full = GPT(ModelConfig(**cfg), VOCAB).eval()
    with torch.no_grad():  # weights well away from the init (a zero-ish head would hide differences)
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    windowed = GPT(ModelConfig(**cfg, sliding_window=window), VOCAB).eval()
    windowed.load_state_dict(full.state_dict())
    return full, windowed


def tokens(length: int, seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


SHAPES = [pytest.param({}, id="gpt2-style"), pytest.param(LLAMA_STYLE, id="llama-style-gqa")]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_window_covering_the_sequence_is_the_causal_path_bit_for_bit(shape: dict,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def no_mask(*args: object) -> torch.Tensor:
        raise AssertionError("a window covering the sequence builds no mask")

    monkeypatch.setattr(gpt, "band_mask", no_mask)
    idx = tokens(40)
    for window in (40, 64, 1000):
        full, windowed = models(window, **shape)
        with torch.no_grad():
            assert torch.equal(windowed(idx), full(idx))
        full.train(), windowed.train()  # the training forward and its gradients too
        for m in (full, windowed):
            m(idx).square().mean().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(full.parameters(), windowed.parameters()))


@pytest.mark.parametrize("shape", SHAPES)
def test_window_one_sees_only_its_own_token(shape: dict) -> None:
    _, windowed = models(1, **shape)
    a = tokens(24, seed=1, batch=1)
    b = tokens(24, seed=2, batch=1)
    b[0, 12] = a[0, 12]  # every earlier (and later) token differs, position 12's own is the same
    with torch.no_grad():
        logits_a, logits_b = windowed(a), windowed(b)
    torch.testing.assert_close(logits_a[0, 12], logits_b[0, 12], rtol=0, atol=1e-6)
    assert (logits_a[0, 11] - logits_b[0, 11]).abs().max() > 1e-3  # not a model that ignores its input


def reference_attention(attn: gpt.CausalSelfAttention, x: torch.Tensor, window: int) -> torch.Tensor:
    """Attention written out in float64 from the module's own weights: softmax(q k^T / sqrt(d)) over
    the keys j with i - window < j <= i, for every query i."""
    B, T, C = x.shape
    heads, kv_heads = attn.n_head, attn.n_kv_head
    d = C // heads
    qkv = torch.nn.functional.linear(x.double(), attn.qkv.weight.double())
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = q.view(B, T, heads, d).transpose(1, 2)
    k = k.view(B, T, kv_heads, d).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v = v.view(B, T, kv_heads, d).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    allowed = (j <= i) & (j > i - window)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
    return torch.nn.functional.linear(y, attn.proj.weight.double())


@pytest.mark.parametrize("n_kv_head", [None, 2])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_a_window_equals_a_hand_written_band_masked_attention(window: int, n_kv_head: int | None) -> None:
    _, windowed = models(window, n_layer=1, bias=False, n_kv_head=n_kv_head)
    attn = windowed.blocks[0].attn
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = attn(x, None)
    torch.testing.assert_close(got.double(), reference_attention(attn, x, window), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_tokens_beyond_the_window_do_not_change_a_position_and_tokens_inside_do(shape: dict) -> None:
    """One layer sees exactly the window; n layers see n x (window - 1) tokens back."""
    window, at = 4, 30
    for n_layer in (1, 2):
        _, windowed = models(window, n_layer=n_layer, **shape)
        reach = n_layer * (window - 1)  # the farthest token back that can reach position `at`
        idx = tokens(40, batch=1)
        with torch.no_grad():
            before = windowed(idx)[0, at]
            for back in range(1, at + 1):
                changed = idx.clone()
                changed[0, at - back] = (changed[0, at - back] + 1) % VOCAB
                differs = (windowed(changed)[0, at] - before).abs().max().item()
                if back > reach:
                    assert differs == 0.0, f"{n_layer} layer(s): the token {back} back is outside the window"
                else:
                    assert differs > 1e-6, f"{n_layer} layer(s): the token {back} back is inside the window"


@pytest.mark.parametrize("shape", SHAPES)
def test_cached_greedy_generation_equals_recomputing_the_whole_sequence(shape: dict) -> None:
    _, windowed = models(5, **shape)
    prompt = [3, 1, 4, 1, 5, 9, 2]  # longer than the window: the prefill is masked too
    cached = generate(windowed, prompt, 40, temperature=0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(40):
            seq.append(int(windowed(torch.tensor([seq]))[0, -1].argmax()))
    assert cached == seq[len(prompt):]
    assert len(set(cached)) > 1, "a degenerate model would pass any comparison"


def test_several_tokens_after_cached_ones_see_their_own_windows() -> None:
    """A continuation of several tokens after a prefill (start > 0, more than one query) matches the
    whole sequence's forward at every one of its positions."""
    _, windowed = models(6, **LLAMA_STYLE)
    idx = tokens(40)
    with torch.no_grad():
        whole = windowed(idx)
        for split in (3, 10, 25):
            for end in (split + 1, split + 4, 40):
                cache = windowed.new_cache()
                windowed(idx[:, :split], cache)
                last = windowed(idx[:, split:end], cache)[:, -1]
                torch.testing.assert_close(last, whole[:, end - 1], rtol=0, atol=1e-5)


def test_evaluation_scores_with_the_window() -> None:
    """The scorer (perplexity and multiple choice) reads hidden states: the window applies there as in
    the forward, and changes the scores."""
    full, windowed = models(4)
    context, continuation = tokens(30, batch=1)[0].tolist(), [7, 8, 9]

    def expected(model: GPT) -> float:
        whole = torch.tensor([context + continuation])
        with torch.no_grad():
            logprobs = model(whole[:, :-1]).log_softmax(dim=-1)[0]
        return sum(logprobs[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))

    scores = {}
    for name, model in (("full", full), ("windowed", windowed)):
        score = Scorer(model, window=64).loglikelihood([(context, continuation)])[0]
        assert score.logprob == pytest.approx(expected(model), abs=1e-4)
        scores[name] = score.logprob
    assert abs(scores["full"] - scores["windowed"]) > 1e-3


@pytest.mark.parametrize("value", [0, -1, -128])
def test_a_window_that_is_not_positive_is_refused_in_one_paragraph(value: int) -> None:
    with pytest.raises(ConfigError) as refused:
        validate_model(ModelConfig(sliding_window=value))
    message = str(refused.value)
    assert message.startswith(f"'model.sliding_window' is {value}; use a positive token count")
    assert "or null for full causal attention" in message and "\n" not in message


def test_a_tiny_training_run_with_a_window_learns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    gpt._BAND_MASKS.clear()
    done = run_cli("train", "data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=1",
                   "model.n_embd=32", "model.n_head=2", "model.block_size=32", "model.sliding_window=16",
                   "micro_batch_size=4", "global_batch_size=8", "max_steps=15", "optim.lr=3e-3",
                   "schedule.warmup_steps=2", "eval_interval=0", "log_interval=1", "threads=1", "report=false",
                   "checkpoint=none", f"hydra.run.dir={run}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "sliding_window: 16" in (run / "config.yaml").read_text()
    assert (32, 32, 16, torch.device("cpu")) in gpt._BAND_MASKS, "the 32-token sequences went through the window"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 15 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3


# ---- Hugging Face -----------------------------------------------------------------------------------

def test_a_gpt2_style_model_with_a_window_is_refused_by_name(tmp_path: Path) -> None:
    _, windowed = models(8)
    with pytest.raises(UnsupportedModel) as refused:
        export_hf(windowed, ByteTokenizer().to_dict(), 64, tmp_path / "out")
    message = str(refused.value)
    assert "model.sliding_window=8 (GPT-2 has no sliding-window attention: needs null)" in message
    assert "\n" not in message and not (tmp_path / "out").exists()


def test_a_llama_style_model_with_a_window_and_biases_is_refused_by_name(tmp_path: Path) -> None:
    _, windowed = models(8, **{**LLAMA_STYLE, "bias": True})
    with pytest.raises(UnsupportedModel, match=r"model\.bias=true \(with model\.sliding_window=8 it is a Mistral, "
                       r"whose projections have no biases: needs false\)"):
        export_hf(windowed, ByteTokenizer().to_dict(), 64, tmp_path / "out")


def test_a_llama_style_model_with_a_window_exports_as_a_mistral_with_the_same_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from llmtrain.runs.artifacts import load_run

    full, windowed = models(8, **LLAMA_STYLE)
    out = tmp_path / "export"
    export_hf(windowed, ByteTokenizer().to_dict(), 64, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    idx = tokens(48)
    with torch.no_grad():
        theirs, ours = hf(idx).logits, windowed(idx)
        assert (full(idx) - ours).abs().max() > 1e-3, "the window binds at this length"
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    out_ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    assert out_ids[0, len(prompt):].tolist() == generate(windowed, prompt, 30, temperature=0)
    back = load_run(out)  # llmtrain reads the Mistral folder back, window included
    assert back.model.cfg.sliding_window == 8
    with torch.no_grad():
        assert torch.equal(back.model(idx), ours)


def llama_json(**changes: object) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 48,
              "max_position_embeddings": 64, "vocab_size": 256}
    return {**config, **changes}


def test_a_config_json_window_is_read_from_a_mistral_and_never_dropped_elsewhere() -> None:
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert model_fields(llama_json(**mistral, sliding_window=16), "config.json")["sliding_window"] == 16
    assert model_fields(llama_json(**mistral, sliding_window=None), "config.json")["sliding_window"] is None
    assert model_fields(llama_json(**mistral), "config.json")["sliding_window"] == 4096  # MistralConfig's default
    assert model_fields(llama_json(sliding_window=None), "config.json")["sliding_window"] is None
    with pytest.raises(UnsupportedModel) as refused:
        model_fields(llama_json(sliding_window=16), "config.json")
    message = str(refused.value)
    assert message.startswith("config.json: sliding_window is 16, but LlamaForCausalLM has no sliding-window")
    assert "MistralForCausalLM" in message and "\n" not in message
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "sliding_window": 16}
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel has no sliding-window attention"):
        model_fields(gpt2, "config.json")
    with pytest.raises(UnsupportedModel, match="sliding_window is 0; it must be a positive number of tokens"):
        model_fields(llama_json(**mistral, sliding_window=0), "config.json")


def saved_folder(folder: Path, **config: object) -> Path:
    """A random Llama or Mistral of llama_json's shape saved by transformers, with a byte tokenizer."""
    transformers = pytest.importorskip("transformers")
    from llmtrain.hf.tokenizer_files import tokenizer_files

    values = {k: v for k, v in llama_json(**config).items() if k not in ("architectures", "model_type")}
    mistral = config.get("model_type") == "mistral"
    cls, cfg_cls = ((transformers.MistralForCausalLM, transformers.MistralConfig) if mistral
                    else (transformers.LlamaForCausalLM, transformers.LlamaConfig))
    torch.manual_seed(0)
    cls(cfg_cls(**values)).save_pretrained(folder)
    for name, text in tokenizer_files(ByteTokenizer().to_dict(), context=64)[1].items():
        (folder / name).write_text(text)
    return folder


def test_a_mistral_folder_keeps_its_window_through_init_from_and_a_round_trip(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from llmtrain.cli.compose import compose_config
    from llmtrain.runs.export import export_run

    folder = saved_folder(tmp_path / "mistral", architectures=["MistralForCausalLM"], model_type="mistral",
                          sliding_window=8)
    text = ["data=text", f"data.path={TINY_CORPUS}"]
    assert compose_config([f"model.init_from={folder}", *text]).model.sliding_window == 8
    with pytest.raises(ConfigError, match="model.sliding_window is 16 but the folder has 8"):
        compose_config([f"model.init_from={folder}", "model.sliding_window=16", *text])
    out = export_run(folder, tmp_path / "again", fmt="hf")  # Hugging Face -> llmtrain -> Hugging Face
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == 8
    before, after = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before) and all(torch.equal(after[n], t) for n, t in before.items())


def test_init_from_a_llama_folder_whose_config_has_a_window_is_refused(tmp_path: Path) -> None:
    folder = saved_folder(tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    done = run_cli("train", f"model.init_from={folder}", "data=text", f"data.path={TINY_CORPUS}", "max_steps=2",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    message = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "sliding_window is 16, but LlamaForCausalLM has no sliding-window attention" in message
    assert not (tmp_path / "run").exists()
