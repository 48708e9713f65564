"""Model folders and run dirs from someone else: whatever their config.json, config.yaml, weights
or tokenizer say, `sample`, `eval`, `export` and `train model.init_from=` refuse them in one
paragraph (exit 2) before building anything of the size they claim, read nothing outside the
folder, never block on a FIFO, and change nothing that was written; a run dir's unusable final
weights are passed over for its good checkpoints."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from llmtrain.config.schema import ModelConfig
from llmtrain.data.tokenizers import ByteTokenizer, Utf8Guard
from llmtrain.generation import generate
from llmtrain.model import GPT

from ..conftest import TINY_CORPUS, run_cli
from ..test_cli_run import TINY
from .test_hostile_checkpoints import sha256s

transformers = pytest.importorskip("transformers")

from ..test_hf_init import save_gpt2, save_llama  # noqa: E402 - needs transformers

TEXT = ["data=text", f"data.path={TINY_CORPUS}", "device=cpu", "threads=1", "max_steps=1", "report=false"]


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """A guard, not a speed check: a hostile file once made these commands run for minutes (or
    forever); if one ever does again, the test fails instead of hanging the suite."""
    def stop(*_: object) -> None:
        raise TimeoutError("a command on a hostile file ran for more than 120 s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"gpt2": save_gpt2(root / "gpt2"), "llama": save_llama(root / "llama")}


def copy_of(source: Path, tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def refused(proc, *pieces: str) -> str:
    """One paragraph on stderr, exit 2, no traceback; returns the message."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("llmtrain: error: "), proc.stderr[-2000:]
    for piece in pieces:
        assert piece in message, f"{piece!r} not in: {message}"
    return message


RAW_1E400 = "<1e400>"  # written as the JSON number 1e400, which Python reads as inf (json.dumps cannot write it)


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config).replace(f'"{RAW_1E400}"', "1e400"))


def rewrite_header(file: Path, edit: Callable[[dict], None]) -> None:
    """Change a safetensors header (what a forger edits: the bytes stay)."""
    raw = file.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


# ---- a Hugging Face folder's config.json ------------------------------------------------------------

GPT2_CONFIGS = [
    pytest.param({"n_layer": 10**9}, "describes 1,000,000,000 layers, but the weights hold 2", id="billion-layers"),
    pytest.param({"n_layer": 1}, "describes 1 layer, but the weights hold 2", id="fewer-layers-than-weights"),
    pytest.param({"n_layer": True}, "n_layer is true; it must be an integer", id="layers-true"),
    pytest.param({"n_layer": 2.5}, "n_layer is 2.5; it must be an integer", id="layers-fraction"),
    pytest.param({"n_layer": "2"}, 'n_layer is "2"; it must be an integer', id="layers-text"),
    pytest.param({"tie_word_embeddings": "no"}, 'tie_word_embeddings is "no"; it must be true or false', id="tie-text"),
    pytest.param({"architectures": 5}, "architectures is 5; it lists model class names", id="architectures-number"),
    pytest.param({"architectures": [["GPT2LMHeadModel"]]}, "it lists model class names", id="architectures-nested"),
    pytest.param({"architectures": ["BertModel"]}, "describes a BertModel model", id="architectures-other"),
    pytest.param({"vocab_size": -1}, "'model.vocab_size' is -1", id="vocab-negative"),
    pytest.param({"n_head": 0}, "'model.n_head' is 0", id="heads-zero"),
    pytest.param({"n_embd": -32}, "'model.n_embd' is -32", id="width-negative"),
    pytest.param({"n_embd": 10**6}, "do not belong together", id="width-million"),
    pytest.param({"n_positions": 10**12}, "do not belong together", id="context-trillion"),
    pytest.param({"layer_norm_epsilon": -1e-5}, "'model.norm_eps' is -1e-05", id="eps-negative"),
    pytest.param({"layer_norm_epsilon": RAW_1E400}, "layer_norm_epsilon is inf; it must be a finite number",
                 id="eps-overflows-to-inf"),
    pytest.param({"n_inner": [1]}, "n_inner is [1]; it must be an integer", id="mlp-list"),
]


@pytest.mark.parametrize(("changes", "piece"), GPT2_CONFIGS)
def test_sample_refuses_a_config_json_that_does_not_describe_its_weights(
        folders: dict[str, Path], tmp_path: Path, changes: dict, piece: str) -> None:
    folder = copy_of(folders["gpt2"], tmp_path)
    edit_config(folder, **changes)
    before = sha256s(folder)
    refused(run_cli("sample", str(folder), "--max-new-tokens", "3", cwd=tmp_path), piece)
    assert sha256s(folder) == before


@pytest.mark.parametrize(("changes", "piece"), [GPT2_CONFIGS[i] for i in (0, 1, 2, 5, 6)])
def test_train_refuses_them_before_any_run_dir(folders: dict[str, Path], tmp_path: Path, changes: dict,
                                               piece: str) -> None:
    folder = copy_of(folders["gpt2"], tmp_path)
    edit_config(folder, **changes)
    proc = run_cli("train", f"model.init_from={folder}", *TEXT, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    refused(proc, piece)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("text", "piece"), [
    pytest.param('{"n_layer": Infinity}', "Infinity is not a JSON number", id="infinity"),
    pytest.param('{"n_layer": NaN}', "NaN is not a JSON number", id="nan"),
    pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="nested"),
    pytest.param("[1, 2]", "holds a JSON list, not an object", id="a-list"),
    pytest.param(b"\xff\xfe{}", "is not UTF-8 text", id="not-utf8"),
])
def test_a_config_json_that_is_not_a_config(folders: dict[str, Path], tmp_path: Path, text: str | bytes,
                                            piece: str) -> None:
    folder = copy_of(folders["gpt2"], tmp_path)
    target = folder / "config.json"
    target.write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(run_cli("sample", str(folder), cwd=tmp_path), piece)


def test_a_config_json_larger_than_any_config(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_of(folders["gpt2"], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "padding": "x" * (9 << 20)}))
    refused(run_cli("sample", str(folder), cwd=tmp_path), "is larger than 8 MB")


def test_fifos_are_never_opened(folders: dict[str, Path], tmp_path: Path) -> None:
    """A FIFO in place of config.json, the weights or the tokenizer would block the reader forever."""
    for name, piece in (("config.json", "is a FIFO"), ("model.safetensors", "is a FIFO"),
                        ("tokenizer.json", "is a FIFO")):
        folder = copy_of(folders["gpt2"], tmp_path, name)
        (folder / name).unlink()
        os.mkfifo(folder / name)
        refused(run_cli("sample", str(folder), cwd=tmp_path), piece, name)


def test_llama_config_values_of_the_wrong_type(folders: dict[str, Path], tmp_path: Path) -> None:
    for changes, piece in (({"rope_parameters": "yes"}, 'rope_parameters is "yes"; it must be an object'),
                           ({"rope_scaling": [1]}, "rope_scaling is [1]"),
                           ({"num_hidden_layers": 10**9}, "describes 1,000,000,000 layers"),
                           ({"head_dim": "16"}, 'head_dim is "16"; it must be an integer'),
                           ({"rope_parameters": {"rope_theta": "big"}}, 'rope_theta is "big"')):
        folder = copy_of(folders["llama"], tmp_path, f"{next(iter(changes))}-{piece[-4:]}")
        edit_config(folder, **changes)
        refused(run_cli("sample", str(folder), cwd=tmp_path), piece)


def test_a_single_architecture_name_is_read_as_one_name(folders: dict[str, Path], tmp_path: Path) -> None:
    """transformers writes a list; a string is one name, not a list of letters."""
    folder = copy_of(folders["gpt2"], tmp_path)
    edit_config(folder, architectures="GPT2LMHeadModel")
    proc = run_cli("sample", str(folder), "--max-new-tokens", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


# ---- a Hugging Face folder's weights -------------------------------------------------------------------


def test_weights_stored_as_integers_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    """F32 bytes labelled I32 read as integers: the model trained to a loss of 3e10 with exit 0."""
    folder = copy_of(folders["gpt2"], tmp_path)

    def relabel(header: dict) -> None:
        for name, entry in header.items():
            if name != "__metadata__" and entry["dtype"] == "F32":
                entry["dtype"] = "I32"

    rewrite_header(folder / "model.safetensors", relabel)
    piece = "as integers or booleans, not floating point"
    refused(run_cli("sample", str(folder), cwd=tmp_path), piece)
    refused(run_cli("train", f"model.init_from={folder}", *TEXT, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path),
            piece)


def test_weights_holding_nan_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy_of(folders["gpt2"], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"][0, 0] = math.nan
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    piece = "transformer.h.1.mlp.c_fc.weight holds NaN or infinite values"
    refused(run_cli("sample", str(folder), cwd=tmp_path), piece)
    proc = run_cli("train", f"model.init_from={folder}", *TEXT, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    refused(proc, piece)


def test_a_tensor_the_model_would_not_use_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    """Weights a config does not describe would be dropped silently by the load."""
    from safetensors.torch import load_file, save_file

    folder = copy_of(folders["gpt2"], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.extra_adapter.weight"] = torch.zeros(4, 4)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    refused(run_cli("sample", str(folder), cwd=tmp_path), "1 tensor(s) the model of its config.json does not use",
            "transformer.extra_adapter.weight")


@pytest.mark.parametrize(("weight_map", "piece"), [
    pytest.param({"transformer.wte.weight": 5}, "'transformer.wte.weight': 5", id="number"),
    pytest.param([1, 2], 'it needs a "weight_map" object', id="list"),
    pytest.param({}, 'it needs a "weight_map" object', id="empty"),
    pytest.param({"transformer.wte.weight": "../gpt2/model.safetensors"}, "'../gpt2/model.safetensors'", id="outside"),
    pytest.param({"transformer.wte.weight": "/dev/zero"}, "'/dev/zero'", id="absolute"),
    pytest.param({"transformer.wte.weight": ".."}, "'..'", id="parent"),
])
def test_a_shard_index_names_only_files_of_its_folder(folders: dict[str, Path], tmp_path: Path, weight_map: object,
                                                      piece: str) -> None:
    folder = copy_of(folders["gpt2"], tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(run_cli("sample", str(folder), cwd=tmp_path), "model.safetensors.index.json is not a safetensors index",
            piece)


def test_a_shard_that_is_a_fifo_is_never_opened(folders: dict[str, Path], tmp_path: Path) -> None:
    from safetensors import safe_open

    folder = copy_of(folders["gpt2"], tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "shard.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names,
                                                                                              "shard.safetensors")}))
    refused(run_cli("sample", str(folder), cwd=tmp_path), "shard.safetensors (model weights) is a FIFO")


# ---- a run dir -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("old", "new", "piece"), [
    pytest.param("n_layer: 1\n", "n_layer: 1000000000\n", "describes 1,000,000,000 layers (n_layer), but the weights "
                 "hold 1", id="billion-layers"),
    pytest.param("n_embd: 32\n", "n_embd: 1000000\n", "wte.weight is (", id="million-wide"),
    pytest.param("block_size: 32\n", "block_size: 1000000000000\n", "wpe.weight is (32, 32), not (1000000000000, 32)",
                 id="trillion-context"),
    pytest.param("n_head: 2\n", "n_head: 0\n", "'model.n_head' is 0", id="no-heads"),
])
def test_sample_refuses_a_config_yaml_that_does_not_describe_its_weights(trained: Path, tmp_path: Path, old: str,
                                                                         new: str, piece: str) -> None:
    run = copy_of(trained, tmp_path)
    text = (run / "config.yaml").read_text()
    assert old in text
    (run / "config.yaml").write_text(text.replace(old, new, 1))
    before = sha256s(run)
    refused(run_cli("sample", str(run), "--max-new-tokens", "3", cwd=tmp_path), piece)
    assert sha256s(run) == before


def test_a_yaml_alias_bomb_is_refused_before_it_expands(trained: Path, tmp_path: Path) -> None:
    """Nine lines, 10**9 values once the aliases are expanded: `sample` hung on it."""
    run = copy_of(trained, tmp_path)
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)]
    (run / "config.yaml").write_text((run / "config.yaml").read_text() + "\n".join(lines) + "\n")
    for command in (["sample", str(run)], ["export", str(run), "--out", str(tmp_path / "out")], ["report", str(run)]):
        proc = run_cli(*command, cwd=tmp_path)
        if command[0] == "report":  # the report names what it cannot read, and answers what it can
            assert "Traceback" not in proc.stderr and proc.returncode in (0, 1, 2), proc.stderr
        else:
            refused(proc, "expands to more than 100,000 values")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("text", "piece"), [
    pytest.param("[" * 100_000 + "]" * 100_000, "not readable YAML", id="nested"),
    pytest.param("model: [unclosed", "not readable YAML", id="broken"),
    pytest.param("- a\n- b\n", "holds no mapping of config groups", id="a-list"),
])
def test_a_config_yaml_that_is_not_a_config(trained: Path, tmp_path: Path, text: str, piece: str) -> None:
    run = copy_of(trained, tmp_path)
    (run / "config.yaml").write_text(text)
    refused(run_cli("sample", str(run), cwd=tmp_path), piece)


@pytest.mark.parametrize(("content", "piece"), [
    pytest.param('{"kind": "char", "chars": ["a"', "is not valid JSON", id="truncated"),
    pytest.param('{"kind": "zzz"}', "its kind is 'zzz'", id="unknown-kind"),
    pytest.param('{"kind": "char"}', "is not a readable char tokenizer", id="missing-field"),
    pytest.param('{"kind": "bpe", "tokenizer": 5}', "is not a readable bpe tokenizer", id="bad-bpe"),
    pytest.param("[]", "its kind is None", id="a-list"),
])
def test_a_run_tokenizer_that_is_not_one(trained: Path, tmp_path: Path, content: str, piece: str) -> None:
    run = copy_of(trained, tmp_path)
    (run / "tokenizer.json").write_text(content)
    refused(run_cli("sample", str(run), cwd=tmp_path), "tokenizer.json", piece)


def test_unusable_final_weights_are_passed_over_for_good_checkpoints(trained: Path, tmp_path: Path) -> None:
    """model.pt with one wrong-shaped tensor, or NaN in it: the checkpoints are good, so sample uses
    the newest one, with a warning naming model.pt."""
    for name, change in (("wrong-shape", lambda t: t[:-1]), ("nan", lambda t: torch.full_like(t, math.nan))):
        run = copy_of(trained, tmp_path, name)
        state = torch.load(run / "model.pt", weights_only=True)
        state["norm_f.weight"] = change(state["norm_f.weight"])
        torch.save(state, run / "model.pt")
        proc = run_cli("sample", str(run), "--max-new-tokens", "3", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "model.pt" in proc.stderr and "trying the checkpoints instead" in proc.stderr
    shutil.rmtree(run / "checkpoints")
    refused(run_cli("sample", str(run), cwd=tmp_path), "has no usable weights", "NaN or infinite values")


def test_checkpoints_as_a_file_is_refused_and_nothing_changes(trained: Path, tmp_path: Path) -> None:
    """It looked like a run with no checkpoints: the run restarted from step 0, rewrote config.yaml,
    appended to metrics.jsonl and died at its first save."""
    run = copy_of(trained, tmp_path)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a folder")
    before = sha256s(run)
    proc = run_cli("train", *TINY, "max_steps=6", f"hydra.run.dir={run}", cwd=tmp_path)
    refused(proc, "checkpoints is a file, but llmtrain keeps a folder of that name there")
    assert sha256s(run) == before
    (run / "checkpoints").unlink()
    (run / "checkpoints").mkdir()
    (run / "model.pt").rename(tmp_path / "kept.pt")
    (run / "model.pt").mkdir()
    refused(run_cli("train", *TINY, "max_steps=6", f"hydra.run.dir={run}", cwd=tmp_path),
            "model.pt is a folder, but llmtrain keeps a file of that name there")


def test_a_forged_step_in_trainer_state_passes_that_checkpoint_over(trained: Path, tmp_path: Path) -> None:
    from .test_hostile_checkpoints import reseal

    run = copy_of(trained, tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    state = json.loads((newest / "trainer_state.json").read_text())
    state["state"]["step"] = 10**30
    (newest / "trainer_state.json").write_text(json.dumps(state))
    reseal(newest)
    proc = run_cli("train", *TINY, "max_steps=6", "report=false", f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    output = " ".join((proc.stdout + proc.stderr).split())  # the warning wraps on a narrow terminal
    assert "step 1000000000000000000000000000000 in 'state', not the folder's step 4" in output
    assert "step_00000002" in output


def test_an_export_whose_model_config_lies(trained: Path, tmp_path: Path) -> None:
    export = tmp_path / "export"
    assert run_cli("export", str(trained), "--out", str(export), cwd=tmp_path).returncode == 0
    meta = json.loads((export / "model_config.json").read_text())
    for edit, piece in ((lambda m: m["model"].update(n_layer=10**9), "describes 1,000,000,000 layers"),
                        (lambda m: m.update(vocab_size=-1), "its vocab_size is -1"),
                        (lambda m: m.update(model=[1]), 'it needs a "model" object')):
        changed = json.loads(json.dumps(meta))
        edit(changed)
        (export / "model_config.json").write_text(json.dumps(changed))
        refused(run_cli("sample", str(export), cwd=tmp_path), piece)


# ---- sampling ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "-inf"])
def test_a_temperature_that_is_not_one(trained: Path, tmp_path: Path, value: str) -> None:
    refused(run_cli("sample", str(trained), f"--temperature={value}", cwd=tmp_path), f"--temperature is {float(value)}")


def test_a_temperature_too_small_to_divide_by_is_greedy(trained: Path, tmp_path: Path) -> None:
    greedy = run_cli("sample", str(trained), "--temperature", "0", "--max-new-tokens", "20", cwd=tmp_path)
    tiny = run_cli("sample", str(trained), "--temperature", "1e-320", "--max-new-tokens", "20", cwd=tmp_path)
    assert greedy.returncode == tiny.returncode == 0, tiny.stderr
    assert tiny.stdout == greedy.stdout


def test_a_seed_out_of_range(trained: Path, tmp_path: Path) -> None:
    refused(run_cli("sample", str(trained), "--seed", str(2**70), cwd=tmp_path), "--seed is")


def test_a_byte_model_never_samples_broken_utf8() -> None:
    """An untrained byte model puts continuation bytes anywhere; the guard bans every byte that
    would break a character, so the text decodes without a replacement character."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=64), 256).eval()
    tokenizer = ByteTokenizer()
    for seed in range(5):
        guard = Utf8Guard(tokenizer.token_bytes())
        ids = generate(model, [10], 200, generator=torch.Generator().manual_seed(seed), guard=guard)
        ids = ids[:len(ids) - guard.pending] if guard.pending else ids
        text = bytes(i for i in ids if i != tokenizer.eos_id).decode("utf-8")  # strict: raises on broken UTF-8
        assert "\ufffd" not in text
        unguarded = generate(model, [10], 200, generator=torch.Generator().manual_seed(seed))
        assert "\ufffd" in tokenizer.decode(unguarded)  # what the guard prevents


def test_the_guard_allows_every_character_and_nothing_broken() -> None:
    tokens = ByteTokenizer().token_bytes()
    for point in [*range(0, 0xD800, 97), *range(0xE000, 0x110000, 997), 0x7F, 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000,
                  0x10FFFF]:
        guard = Utf8Guard(tokens)
        for byte in chr(point).encode():
            assert not guard.banned(256)[byte], hex(point)
            guard.advance(byte)
        assert guard.pending == 0
    for broken in (b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe0\x80\x80", b"\xf5"):
        guard = Utf8Guard(tokens)
        allowed = True
        for byte in broken:
            allowed = allowed and not guard.banned(256)[byte]
            guard.advance(byte)
        assert not allowed, broken
    guard = Utf8Guard(tokens)
    guard.advance(0xE2)
    assert guard.banned(256)[0xFF], "end-of-text inside a character"


# ---- data files that are not what they claim ----------------------------------------------------------


@pytest.mark.parametrize(("make", "piece"), [
    pytest.param(lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file", id="fifo"),
    pytest.param(lambda p: os.symlink("/dev/zero", p), "is a device, not a regular file", id="device"),
])
def test_a_data_path_that_is_not_a_file_is_never_opened(tmp_path: Path, make: Callable[[Path], None],
                                                        piece: str) -> None:
    make(tmp_path / "corpus.txt")
    proc = run_cli("prepare", "data=text", f"data.path={tmp_path / 'corpus.txt'}", cwd=tmp_path)
    refused(proc, piece)


def test_a_jsonl_line_longer_than_any_document_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A binary file named .jsonl has no line breaks: it was read whole into memory as one line."""
    from llmtrain.data import corpus

    monkeypatch.setattr(corpus, "JSONL_LINE_BYTES", 1000)  # the real bound is 256 MB
    (tmp_path / "docs.jsonl").write_text('{"text": "fine"}\n' + '{"text": "' + "x" * 5000 + '"}\n')
    proc = run_cli("prepare", "data=jsonl", f"data.path={tmp_path / 'docs.jsonl'}", cwd=tmp_path)
    refused(proc, "docs.jsonl:2 (a JSON-lines file) is a line longer than 1,000 bytes")


def test_a_run_log_that_is_a_fifo_or_not_a_log(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`report` and `compare` read metrics.jsonl: a FIFO there blocked them forever, and a binary
    file was read whole."""
    from llmtrain.runs import records

    run = copy_of(trained, tmp_path, "fifo")
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    refused(run_cli("compare", str(run), cwd=tmp_path), "metrics.jsonl (a run's log) is a FIFO")
    run = copy_of(trained, tmp_path, "long")
    monkeypatch.setattr(records, "RECORD_BYTES", 10_000)  # the real bound is 16 MB
    with open(run / "metrics.jsonl", "a") as log:
        log.write("x" * 20_000 + "\n")
    refused(run_cli("report", str(run), cwd=tmp_path), "(a run's log) is a line longer than 10,000 bytes")
