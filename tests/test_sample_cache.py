"""Generation through the KV cache (GPT.forward(idx, cache), llmtrain/generation.py's generate) and
the weights it loads.

Within the window the cache gives the logits and tokens of recomputing the whole sequence for every
token (reference loops written here); past it, the cache is refilled from the last half window and
positions stay inside the trained window. Sampling from a run dir reads only the weights' files of
a checkpoint, each checked against the manifest once: a damaged one is still passed over.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

import llmtrain.checkpoint.read as reader
from llmtrain.checkpoint.read import read_model_weights
from llmtrain.checkpoint.shards import hash_files, write_shards
from llmtrain.checkpoint.write import CheckpointContents, save_checkpoint
from llmtrain.config.schema import (
    Config,
    MlpKind,
    ModelConfig,
    NormKind,
    NormPosition,
    PositionEncoding,
    config_to_dict,
)
from llmtrain.core.errors import CheckpointError, UserError
from llmtrain.data.tokenizers import ByteTokenizer, save_tokenizer
from llmtrain.engine.state import TrainState
from llmtrain.generation import ONE_THREAD_BELOW, _inference_mode, generate, generation_threads, stream_tokens
from llmtrain.model import GPT, KVCache, param_count
from llmtrain.runs.artifacts import load_run
from llmtrain.runs.sample import sample_text

VOCAB = 50
WINDOW = 32
SHAPES = {
    "gpt2": {},  # learned positions, pre-LN layernorm, GELU, tied head
    # RoPE, RMSNorm, SwiGLU, grouped-query attention (4 query heads on 2 key/value heads), as llama_tiny
    "llama": {"position": PositionEncoding.rope, "norm": NormKind.rmsnorm, "mlp": MlpKind.swiglu, "n_kv_head": 2,
              "bias": False, "tie_weights": False},
    "mqa_post_norm": {"n_kv_head": 1, "norm_position": NormPosition.post},
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One thread, as `llmtrain sample` generates with a small model (two on a busy machine cost
    ~20x in waiting for the second one at every op)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def make_model(shape: str = "gpt2", block_size: int = WINDOW) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=block_size, **SHAPES[shape])
    return GPT(cfg, VOCAB).eval()


@torch.no_grad()
def reference(model: GPT, prompt: list[int], n: int, window: int, temperature: float = 0.0, top_k: int | None = None,
              generator: torch.Generator | None = None, refill: bool = True) -> list[int]:
    """The whole window recomputed for every token (no cache). `refill`: the window a cached
    generate reads past the context: it starts again from the last window // 2 tokens when full."""
    seq, start = list(prompt), max(0, len(prompt) - window)
    out = []
    for _ in range(n):
        if len(seq) - start > window:
            start = len(seq) - window // 2 if refill else len(seq) - window
        logits = model(torch.tensor([seq[start:]]))[:, -1].float()
        if temperature <= 0:
            token = int(logits.argmax(-1))
        else:
            logits = logits / temperature
            if top_k is not None:
                logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[:, -1:], float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        seq.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [1, 2])
def test_cached_logits_equal_the_full_forward_at_every_position(shape: str, batch: int) -> None:
    model = make_model(shape)
    ids = torch.randint(0, VOCAB, (batch, WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        got = [model(ids[:, :5], cache=cache)]  # prefill
        got.append(model(ids[:, 5:12], cache=cache))  # several tokens after cached ones: the masked path
        got += [model(ids[:, t:t + 1], cache=cache) for t in range(12, WINDOW)]
    assert all(g.shape == (batch, 1, VOCAB) for g in got), "the last position's logits only"
    positions = [4, 11, *range(12, WINDOW)]
    assert cache.length == WINDOW
    assert torch.allclose(torch.cat(got, 1), full[:, positions], atol=1e-5, rtol=0)


def test_generation_runs_the_block_hooks_at_every_step_and_gives_the_same_tokens() -> None:
    """Every step goes through the modules' calls, so hooks run (FSDP gathers a block's parameters in
    them; a probe reads its output), outside inference mode (FSDP2 fails on inference tensors)."""
    model = make_model("llama")
    prompt = [3, 1, 4, 1, 5, 9]
    plain = generate(model, prompt, 6, temperature=0)
    assert _inference_mode(model) is torch.inference_mode, "no hooks: generation skips the autograd bookkeeping"
    seen: list[tuple[int, int, bool]] = []  # (start, new tokens, inference mode) of every call of block 1

    def hook(module: torch.nn.Module, args: tuple) -> None:
        seen.append((args[3], args[0].shape[1], torch.is_inference_mode_enabled()))

    handle = model.blocks[1].register_forward_pre_hook(hook)
    try:
        hooked = generate(model, prompt, 6, temperature=0)
    finally:
        handle.remove()
    assert hooked == plain
    assert seen == [(0, 6, False), *((t, 1, False) for t in range(6, 11))]


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_generation_within_the_window_equals_recomputing_it(shape: str) -> None:
    model = make_model(shape)
    prompt = [3, 1, 4, 1, 5]
    n = WINDOW - len(prompt)
    assert generate(model, prompt, n, temperature=0) == reference(model, prompt, n, WINDOW)


def test_seeded_sampling_within_the_window_equals_recomputing_it() -> None:
    model = make_model("llama")
    prompt = [7, 8]
    ours = generate(model, prompt, 25, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(3))
    theirs = reference(model, prompt, 25, WINDOW, 0.8, 10, torch.Generator().manual_seed(3))
    assert ours == theirs


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_past_the_window_the_cache_refills_from_the_last_half_window(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(shape, block_size=16)
    reads: list[tuple[int, int]] = []  # (cached tokens, new tokens) of every forward
    forward = GPT.forward

    def spy(self: GPT, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:  # generate's forwards (the reference below reads without a cache)
            reads.append((cache.length, idx.shape[1]))
        return forward(self, idx, cache)

    monkeypatch.setattr(GPT, "forward", spy)
    prompt = [1, 2, 3]
    out = generate(model, prompt, 60, temperature=0)
    assert len(out) == 60
    assert max(cached + new for cached, new in reads) <= 16, "positions stay inside the trained window"
    assert len(reads) == 60, "one prefill, then one forward per token (a refill is one forward)"
    refills = [new for cached, new in reads[1:] if cached == 0]
    assert len(refills) >= 5 and set(refills) == {8}
    assert out == reference(model, prompt, 60, 16)
    assert len(reads) == 60, "the reference's forwards read no cache"
    # a window below the model's context (the run's training length) bounds the cache instead
    reads.clear()
    assert len(generate(model, prompt, 30, temperature=0, context=6)) == 30
    assert max(cached + new for cached, new in reads) <= 6


def test_a_prompt_longer_than_the_window_is_cut_to_its_last_window() -> None:
    model = make_model()
    prompt = list(torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(2)).tolist())
    assert generate(model, prompt, 1, temperature=0) == reference(model, prompt, 1, WINDOW, refill=False)
    assert len(generate(model, prompt, 40, temperature=0)) == 40


def test_the_same_seed_gives_the_same_tokens() -> None:
    model = make_model()
    runs = [generate(model, [5], 80, generator=torch.Generator().manual_seed(seed)) for seed in (0, 0, 1)]
    assert runs[0] == runs[1] != runs[2]


def test_generation_ends_after_the_stop_id_and_keeps_to_the_vocab_limit() -> None:
    model = make_model()
    greedy = generate(model, [5], 20, temperature=0)
    stop = greedy[3]
    assert generate(model, [5], 20, temperature=0, stop_id=stop) == greedy[:greedy.index(stop) + 1]
    sampled = generate(model, [5], 60, temperature=2.0, generator=torch.Generator().manual_seed(0), vocab_limit=7)
    assert len(sampled) == 60 and max(sampled) < 7
    assert list(stream_tokens(model, [5], 0)) == []
    with pytest.raises(ValueError, match="prompt"):
        generate(model, [], 5)


def test_generation_under_bf16_autocast_keeps_the_cache_in_bf16() -> None:
    """The evaluation harness generates under autocast: the cache takes the keys' dtype."""
    model = make_model("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert len(generate(model, [1, 2], 40, temperature=0)) == 40


def test_the_cache_refuses_more_tokens_than_it_holds() -> None:
    model = make_model()
    cache = model.new_cache(4)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError, match="exceed the cache"):
            model(torch.tensor([[4, 5]]), cache=cache)
    assert model.new_cache(1000).capacity == WINDOW, "never past the model's context"


# ---- loading: a run dir without model.pt (an interrupted run) -------------------------------------


def interrupted_run(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A run dir as an interrupted `llmtrain train` leaves it: config.yaml, tokenizer.json and the
    checkpoints of steps 2 and 4 (different weights each), no model.pt."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = Config(model=ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32))
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    save_tokenizer(ByteTokenizer(), run / "tokenizer.json")
    model = GPT(cfg.model, ByteTokenizer.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters())
    saved = {}
    for step in (2, 4):
        torch.manual_seed(step)
        model.reset_parameters()
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        save_checkpoint(run, CheckpointContents(state=TrainState(step=step), config=config_to_dict(cfg), sampler={},
                                                model=model.state_dict(), optimizer=optimizer.state_dict()))
    return run, saved


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_sampling_an_interrupted_run_reads_and_hashes_only_the_newest_model_pt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, saved = interrupted_run(tmp_path)
    checked: list[str] = []
    check_file = reader.check_file
    monkeypatch.setattr(reader, "check_file", lambda path, name, entry: (checked.append(f"{path.name}/{name}"),
                                                                      check_file(path, name, entry)))
    loaded: list[str] = []
    torch_file = reader._torch_file
    monkeypatch.setattr(reader, "_torch_file", lambda path, name, device: (loaded.append(f"{path.name}/{name}"),
                                                                        torch_file(path, name, device))[1])
    assert same(load_run(run).model.state_dict(), saved[4])
    assert checked == loaded == ["step_00000004/model.pt"], "hashed once, read once; no optimizer.pt, rng.pt"


def test_a_damaged_optimizer_does_not_stop_sampling_its_weights(tmp_path: Path) -> None:
    run, saved = interrupted_run(tmp_path)
    flip_a_byte(run / "checkpoints" / "step_00000004" / "optimizer.pt")
    assert same(load_run(run).model.state_dict(), saved[4])


def test_a_damaged_checkpoint_is_still_refused_when_sampling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, saved = interrupted_run(tmp_path)
    flip_a_byte(run / "checkpoints" / "step_00000004" / "model.pt")
    assert same(load_run(run).model.state_dict(), saved[2]), "the older good checkpoint's weights"
    err = capsys.readouterr().err
    assert "step_00000004" in err and "model.pt" in err and "sha256" in err, err
    assert isinstance(sample_text(run, max_new_tokens=5), str)
    flip_a_byte(run / "checkpoints" / "step_00000002" / "model.pt")
    with pytest.raises(UserError, match="every checkpoint is damaged"):
        load_run(run)


def test_a_sharded_checkpoint_reads_its_weights_and_refuses_a_damaged_shard(tmp_path: Path) -> None:
    run, saved = interrupted_run(tmp_path)
    checkpoint = run / "checkpoints" / "step_00000004"
    cfg = Config(model=ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32))
    model = GPT(cfg.model, ByteTokenizer.vocab_size)
    model.load_state_dict(saved[4])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        write_shards(checkpoint / "shards", model, torch.optim.AdamW(model.parameters()))
    (checkpoint / "model.pt").unlink()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"]["model.pt"]
    manifest["layout"] = "sharded"
    manifest["files"].update(hash_files(checkpoint / "shards", 0, 1))
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    assert same(read_model_weights(checkpoint), saved[4])
    data_file = next(p for p in (checkpoint / "shards").iterdir() if p.name != ".metadata")
    flip_a_byte(data_file)
    with pytest.raises(CheckpointError, match="sha256"):
        read_model_weights(checkpoint)
    assert hashlib.sha256(data_file.read_bytes()).hexdigest() != manifest["files"][f"shards/{data_file.name}"]["sha256"]


def test_a_small_model_generates_on_one_thread_and_sample_text_restores_the_count(tmp_path: Path) -> None:
    model = make_model()
    assert generation_threads(model, 2) == 1
    big = GPT(ModelConfig(n_layer=1, n_head=4, n_embd=1024, block_size=8), 20000)
    assert param_count(big) >= ONE_THREAD_BELOW and generation_threads(big, 2) == 2
    run, _ = interrupted_run(tmp_path)
    torch.set_num_threads(2)
    sample_text(run, max_new_tokens=3)
    assert torch.get_num_threads() == 2


FSDP_GENERATION = """
import os, socket, torch, torch.distributed as dist
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import fully_shard
from llmtrain.config.schema import ModelConfig
from llmtrain.model import GPT
from llmtrain.generation import generate
torch.manual_seed(0)
model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=16), 50)
plain = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=16), 50)
plain.load_state_dict(model.state_dict())
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
model.eval(), plain.eval()
assert generate(model, [1, 2, 3], 12, temperature=0) == generate(plain, [1, 2, 3], 12, temperature=0)
model.train()
model(torch.tensor([[1, 2, 3]])).sum().backward()  # the sharded model still trains afterwards
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.slow
def test_generation_on_an_fsdp_sharded_model_matches_and_leaves_it_trainable() -> None:
    """An eval task that generates during parallel=fsdp training runs on the sharded model: FSDP2's
    hooks gather the parameters (they fail under inference_mode, so generation runs under no_grad)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FSDP_GENERATION], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
