"""`llmtrain prepare` and the data sources behind it: folders and globs of text files, JSON lines,
the byte-level BPE tokenizer, undecodable bytes and the errors a user can act on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmtrain.config import DataConfig, DataSource, DecodeErrors, TokenizerKind
from llmtrain.data.prepare import prepare_data
from llmtrain.data.tokenizers import BPETokenizer, load_tokenizer
from llmtrain.errors import ConfigError

from .conftest import TINY_CORPUS


def corpus_folder(root: Path, n: int = 6) -> Path:
    text = TINY_CORPUS.read_text()
    size = len(text) // n
    for i in range(n):
        path = root / ("sub" if i % 2 else "") / f"doc{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text[i * size:(i + 1) * size])
    (root / "notes.bin").write_bytes(b"\x00\x01")  # not a text suffix: ignored in a folder
    return root


def data_config(tmp_path: Path, path: Path | str, **kwargs) -> DataConfig:
    return DataConfig(source=kwargs.pop("source", DataSource.text), path=str(path), cache_dir=str(tmp_path / "cache"),
                      val_fraction=kwargs.pop("val_fraction", 0.2), **kwargs)


def test_a_folder_is_split_by_document_and_reused_until_it_changes(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "corpus")
    cfg = data_config(tmp_path, folder)
    data = prepare_data(cfg, log=lambda m: None)
    assert data.meta["documents"] == 6 and data.meta["val_documents"] >= 1
    assert data.meta["train_documents"] + data.meta["val_documents"] == 6
    meta_mtime = (data.directory / "meta.json").stat().st_mtime_ns
    logs: list[str] = []
    again = prepare_data(cfg, log=logs.append)
    assert logs == [] and (again.directory / "meta.json").stat().st_mtime_ns == meta_mtime  # nothing rebuilt
    (folder / "doc0.txt").write_text("something else entirely\n" * 50)
    changed = prepare_data(cfg, log=logs.append)
    assert any("changed" in m for m in logs) and changed.meta["content_sha256"] != data.meta["content_sha256"]


def test_a_glob_picks_its_files_only(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "corpus")
    data = prepare_data(data_config(tmp_path, f"{folder}/sub/*.txt"), log=lambda m: None)
    assert data.meta["documents"] == 3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "absent", "not a file, a folder or a glob"),
        (lambda root: (root / "empty_dir").mkdir() or root / "empty_dir", "has no .txt"),
        (lambda root: str(root / "*.nothing"), "matches no file"),
    ],
)
def test_inputs_that_do_not_exist_are_one_paragraph_errors(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        prepare_data(data_config(tmp_path, make(tmp_path)), log=lambda m: None)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_documents_come_from_the_text_field(tmp_path: Path) -> None:
    lines = [{"content": f"document number {i}: " + "words " * 40, "id": i} for i in range(10)]
    path = write_jsonl(tmp_path / "docs.jsonl", [*lines[:5], "", *lines[5:]])  # a blank line is skipped
    data = prepare_data(data_config(tmp_path, path, source=DataSource.jsonl, text_field="content"), log=lambda m: None)
    assert data.meta["documents"] == 10
    text = data.tokenizer().decode(np.concatenate([data.tokens("train"), data.tokens("val")]).tolist())
    assert "document number 7" in text and '"id"' not in text


@pytest.mark.parametrize(
    ("bad", "message"),
    [("{not json", r"docs.jsonl:3 is not valid JSON"), ({"body": "x"}, r"docs.jsonl:3 has no string field 'text' \(it has: body\)")],
)
def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path: Path, bad, message: str) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "fine"}, {"text": "also fine"}, bad])
    with pytest.raises(ConfigError, match=message):
        prepare_data(data_config(tmp_path, path, source=DataSource.jsonl), log=lambda m: None)


def test_bpe_round_trips_any_text_and_marks_document_ends(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "corpus")
    data = prepare_data(data_config(tmp_path, folder, tokenizer=TokenizerKind.bpe, bpe_vocab_size=600), log=lambda m: None)
    tokenizer = data.tokenizer()
    assert isinstance(tokenizer, BPETokenizer) and 257 <= tokenizer.vocab_size <= 600
    for text in ("def f(x):\n    return x  # ok", "naïve café – 数据 🙂", ""):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    eos = tokenizer.inner.token_to_id(BPETokenizer.END_OF_TEXT)
    train = data.tokens("train")
    assert int((train == eos).sum()) == data.meta["train_documents"] and train[-1] == eos
    assert tokenizer.encode("return") != list(b"return")  # merges learned: fewer tokens than bytes
    reloaded = load_tokenizer(data.directory / "tokenizer.json")
    assert reloaded.encode("def f(x): return x") == tokenizer.encode("def f(x): return x")


@pytest.mark.parametrize(("policy", "documents"), [(DecodeErrors.replace, 6), (DecodeErrors.skip, 5)])
def test_undecodable_bytes_are_replaced_or_skipped_and_counted(tmp_path: Path, policy, documents: int) -> None:
    folder = corpus_folder(tmp_path / "corpus")
    (folder / "doc0.txt").write_bytes(b"valid text \xff\xfe then more text\n" * 20)
    logs: list[str] = []
    data = prepare_data(data_config(tmp_path, folder, decode_errors=policy), log=logs.append)
    assert data.meta["undecodable_documents"] == 1 and data.meta["documents"] == documents
    assert any("not valid UTF-8" in m and "doc0.txt" in m for m in logs)


def llmtrain(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "llmtrain", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_cli_prepare_then_train_and_sample_with_bpe(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "corpus")
    data = ["data=text", f"data.path={folder}", "data.tokenizer=bpe", "data.bpe_vocab_size=512"]
    prepared = llmtrain(tmp_path, "prepare", *data)
    assert prepared.returncode == 0, prepared.stderr
    assert "6 documents" in prepared.stdout and "tokenizer bpe" in prepared.stdout
    run = tmp_path / "run"
    trained = llmtrain(tmp_path, "train", *data, "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                       "model.block_size=32", "micro_batch_size=4", "global_batch_size=4", "max_steps=3",
                       "schedule.warmup_steps=1", "eval_interval=0", f"hydra.run.dir={run}")
    assert trained.returncode == 0, trained.stderr
    assert "preparing" not in trained.stdout  # prepared once, reused
    sampled = llmtrain(tmp_path, "sample", str(run), "--max-new-tokens", "20", "--prompt", "The ")
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("The ")


def test_cli_prepare_bad_path_is_exit_2(tmp_path: Path) -> None:
    proc = llmtrain(tmp_path, "prepare", "data=jsonl", f"data.path={tmp_path / 'nope.jsonl'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "'data.path'" in proc.stderr


def test_char_tokens_over_jsonl_documents_without_newlines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"line {i} without a newline"} for i in range(20)])
    data = prepare_data(data_config(tmp_path, path, source=DataSource.jsonl, tokenizer=TokenizerKind.char),
                        log=lambda m: None)
    assert "\n" in data.tokenizer().chars  # the blank line that joins documents is in the vocabulary


# ---------------------------------------------------------------------------------------------
# epoch sampling
# ---------------------------------------------------------------------------------------------


def epoch_windows(sampler, batches: int) -> list[list[int]]:
    return [sampler.next_batch()[0][:, 0].tolist() for _ in range(batches)]


def test_epochs_visit_every_window_once_in_a_new_reproducible_order() -> None:
    from llmtrain.data.sampler import EpochSampler

    tokens = np.arange(1001, dtype=np.uint16)  # 100 windows of 10 (+1 target)
    sampler = EpochSampler(tokens, 8, 10, seed=3)
    first = [w for batch in epoch_windows(sampler, 12) for w in batch]  # 96 windows: 4 dropped (drop_last)
    assert len(set(first)) == 96 and all(w % 10 == 0 for w in first)
    second = [w for batch in epoch_windows(sampler, 12) for w in batch]
    assert sampler.epoch == 1 and second != first and len(set(second)) == 96
    again = EpochSampler(tokens, 8, 10, seed=3)
    assert [w for batch in epoch_windows(again, 12) for w in batch] == first


def test_rank_shards_are_disjoint_and_cover_the_epoch() -> None:
    from llmtrain.data.sampler import EpochSampler

    tokens = np.arange(1001, dtype=np.uint16)
    shards = [EpochSampler(tokens, 10, 10, seed=1, rank=r, world_size=2) for r in range(2)]
    seen = [{w for batch in epoch_windows(s, 5) for w in batch} for s in shards]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 100


def test_mid_epoch_resume_gives_exactly_the_uninterrupted_batches(tmp_path: Path, monkeypatch) -> None:
    from llmtrain.config import Sampling
    from llmtrain.errors import Interrupted
    from llmtrain.train import train

    from .conftest import tiny_config

    settings = {"data.sampling": Sampling.epoch,
                "max_steps": 40, "schedule.warmup_steps": 2, "data.max_bytes": 8000}  # ~28 steps per epoch
    reference = train(tiny_config(tmp_path / "ref", **settings))
    run = tmp_path / "run"
    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "17")
    with pytest.raises(Interrupted):
        train(tiny_config(run, **settings))
    monkeypatch.delenv("LLMTRAIN_TEST_STOP_AT_STEP")
    resumed = train(tiny_config(run, **settings))
    assert all(resumed.train_losses[s] == reference.train_losses[s] for s in range(18, 41))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["epoch"] for r in records if r["kind"] == "train"]
    assert epochs[16] < 1 < epochs[-1]  # stopped mid-epoch, and the resumed run rolled over into epoch 2


# ---------------------------------------------------------------------------------------------
# instruction data
# ---------------------------------------------------------------------------------------------


def instruction_file(path: Path, n: int = 24) -> Path:
    records = []
    for i in range(n):
        if i % 2:
            records.append({"prompt": f"Q{i}: what is {i} plus one?", "response": f"It is {i + 1}."})
        else:
            records.append({"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": f"Say {i}."},
                                         {"role": "assistant", "content": f"{i}!"}]})
    return write_jsonl(path, records)


@pytest.mark.parametrize("tokenizer", [TokenizerKind.byte, TokenizerKind.bpe])
def test_only_response_tokens_are_targets(tmp_path: Path, tokenizer: TokenizerKind) -> None:
    from llmtrain.data.sampler import IGNORE_INDEX, InstructionSampler

    path = instruction_file(tmp_path / "pairs.jsonl")
    data = prepare_data(data_config(tmp_path, path, source=DataSource.instruct, tokenizer=tokenizer, bpe_vocab_size=300),
                        log=lambda m: None)
    assert data.meta["loss_mask"] and 0 < data.meta["train_target_tokens"] < data.meta["train_tokens"]
    tok = data.tokenizer()
    sampler = InstructionSampler(data.tokens("train"), data.loss_mask("train"), data.offsets("train"), 4, 64, seed=0)
    x, y = sampler.next_batch()
    for row in range(4):
        targets = [int(t) for t in y[row] if t != IGNORE_INDEX]
        text = tok.decode(targets)
        assert text and "what is" not in text and "Say" not in text and "Be brief" not in text  # no prompt tokens
        assert text.startswith(("It is", "0", "1", "2")) or text[0].isdigit()
        real = int((x[row] != 0).sum()) if tokenizer is TokenizerKind.byte else None
        if real is not None:
            assert (y[row, real:] == IGNORE_INDEX).all()  # padding is never a target


def test_instruction_data_trains_from_the_cli(tmp_path: Path) -> None:
    path = instruction_file(tmp_path / "pairs.jsonl", n=40)
    run = tmp_path / "run"
    proc = llmtrain(tmp_path, "train", "data=instruct", f"data.path={path}", "model.n_layer=1", "model.n_embd=32",
                    "model.n_head=2", "model.block_size=64", "micro_batch_size=4", "global_batch_size=4", "max_steps=6",
                    "schedule.warmup_steps=1", "eval_interval=3", "eval_batches=1", "optim.label_smoothing=0.1",
                    f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
    assert all(0 < r["loss"] < 10 for r in records if r["kind"] == "train")


def test_a_bad_instruction_line_names_its_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "response": "b"}, {"question": "a", "answer": "b"}])
    with pytest.raises(ConfigError, match=r"pairs.jsonl:2 has neither 'messages' nor .*it has: answer, question"):
        prepare_data(data_config(tmp_path, path, source=DataSource.instruct), log=lambda m: None)


def test_label_smoothing_raises_the_training_loss_of_a_confident_model() -> None:
    import torch

    from llmtrain.train import loss_sum

    logits = torch.full((1, 4, 10), -5.0)
    targets = torch.tensor([[1, 2, 3, 4]])
    logits[0, torch.arange(4), targets[0]] = 5.0
    assert loss_sum(logits, targets, label_smoothing=0.1) > loss_sum(logits, targets) > 0
