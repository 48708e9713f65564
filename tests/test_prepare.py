"""`llmtrain prepare` and the data sources behind it: folders and globs of text files, JSON lines,
the byte-level BPE tokenizer, undecodable bytes and the errors a user can act on."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llmtrain.config.schema import DataConfig, DataSource, DecodeErrors, TokenizerKind
from llmtrain.core.errors import ConfigError
from llmtrain.data.prepare import prepare_data
from llmtrain.data.tokenizers import BPETokenizer, load_tokenizer

from .conftest import TINY_CORPUS, run_cli


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
    [("{not json", r"docs.jsonl:3 is not valid JSON"),
     ({"body": "x"}, r"docs.jsonl:3 has no string field 'text' \(it has: body\)")],
)
def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path: Path, bad, message: str) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "fine"}, {"text": "also fine"}, bad])
    with pytest.raises(ConfigError, match=message):
        prepare_data(data_config(tmp_path, path, source=DataSource.jsonl), log=lambda m: None)


def test_bpe_round_trips_any_text_and_marks_document_ends(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "corpus")
    data = prepare_data(data_config(tmp_path, folder, tokenizer=TokenizerKind.bpe, bpe_vocab_size=600),
                        log=lambda m: None)
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


def test_trained_bpe_encodes_through_tiktoken_with_the_same_tokens(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "corpus")
    data = prepare_data(data_config(tmp_path, folder, tokenizer=TokenizerKind.bpe, bpe_vocab_size=800),
                        log=lambda m: None)
    tokenizer = data.tokenizer()
    assert tokenizer._tiktoken() is not None, "the fast path agreed with tokenizers on the probe"
    texts = ([p.read_text() for p in sorted(folder.rglob("*.txt"))]
             + ["  x\n\n\n\ty  ", "ünïcödé 数据 🙂🙂", "it's I'll"])
    assert ([ids.tolist() for ids in tokenizer.encode_arrays(texts)]
            == [e.ids for e in tokenizer.inner.encode_batch(texts)])


# ---------------------------------------------------------------------------------------------
# GPT-2 BPE through tiktoken, from local files only
# ---------------------------------------------------------------------------------------------


def gpt2_format_files(folder: Path, merges: list[tuple[str, str]]) -> Path:
    """A small vocab.bpe + encoder.json pair in GPT-2's release format (the real pair is 1.5 MB and
    needs the network): all 256 bytes in GPT-2's byte alphabet, then `merges` in order."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    order = printable + [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(order[len(printable):])}
    encoder = {char[b]: rank for rank, b in enumerate(order)}
    for first, second in merges:
        encoder[first + second] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (folder / "encoder.json").write_text(json.dumps(encoder))
    return folder


GPT2_MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or")]


def test_gpt2_bpe_from_a_folder_prepares_and_round_trips(tmp_path: Path) -> None:
    from llmtrain.data.tokenizers import TiktokenTokenizer

    folder = gpt2_format_files(tmp_path / "gpt2", GPT2_MERGES)
    (tmp_path / "c.txt").write_text("hello world\n" * 200 + "naïve 🙂\n")
    logs: list[str] = []
    data = prepare_data(data_config(tmp_path, tmp_path / "c.txt", tokenizer=TokenizerKind.gpt2, gpt2_dir=str(folder)),
                        log=logs.append)
    assert any("not the published GPT-2 files" in m for m in logs)
    tokenizer = load_tokenizer(data.directory / "tokenizer.json")  # saved whole: no files needed to load
    assert isinstance(tokenizer, TiktokenTokenizer) and tokenizer.vocab_size == 256 + len(GPT2_MERGES) + 1
    assert tokenizer.eos_id == data.meta["end_of_text_id"] == 256 + len(GPT2_MERGES)
    assert len(tokenizer.encode("hello")) == 1 and len(tokenizer.encode(" wor")) == 1
    assert tokenizer.decode(tokenizer.encode("hello world naïve 🙂")) == "hello world naïve 🙂"
    stream = np.concatenate([data.tokens("train"), data.tokens("val")]).tolist()
    assert tokenizer.decode(stream) == "hello world\n" * 200 + "naïve 🙂\n" and stream[-1] == tokenizer.eos_id


def test_gpt2_bpe_is_found_in_tiktokens_cache(tmp_path: Path, monkeypatch) -> None:
    import hashlib
    import shutil

    from llmtrain.data.tokenizers import GPT2_URL

    folder = gpt2_format_files(tmp_path / "gpt2", GPT2_MERGES)
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    for name in ("vocab.bpe", "encoder.json"):  # where tiktoken.get_encoding("gpt2") leaves its downloads
        shutil.copy(folder / name, cache / hashlib.sha1((GPT2_URL + name).encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    (tmp_path / "c.txt").write_text("hello world\n" * 100)
    data = prepare_data(data_config(tmp_path, tmp_path / "c.txt", tokenizer=TokenizerKind.gpt2), log=lambda m: None)
    assert data.vocab_size == 256 + len(GPT2_MERGES) + 1


def test_gpt2_without_its_files_is_a_clear_error_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("hello world\n" * 100)
    env_cache = tmp_path / "empty-cache"
    env_cache.mkdir()
    proc = llmtrain(tmp_path, "train", "data=text", f"data.path={tmp_path / 'c.txt'}", "data.tokenizer=gpt2",
                    f"out_dir={tmp_path / 'run'}",
                    env={"TIKTOKEN_CACHE_DIR": str(env_cache), "LLMTRAIN_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data.gpt2_dir" in proc.stderr and "openaipublic" in proc.stderr and not (tmp_path / "run").exists()
    bad = gpt2_format_files(tmp_path / "bad", GPT2_MERGES)
    (bad / "encoder.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a matching GPT-2 vocab.bpe / encoder.json pair"):
        prepare_data(data_config(tmp_path, tmp_path / "c.txt", tokenizer=TokenizerKind.gpt2, gpt2_dir=str(bad)),
                     log=lambda m: None)


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets (the hf extra)
# ---------------------------------------------------------------------------------------------


def hf_config(tmp_path: Path, name: str, **kwargs) -> DataConfig:
    import llmtrain.data.cache as cache

    cache._load_hf.cache_clear()  # a test rewrites datasets in place; a run loads each once
    return data_config(tmp_path, kwargs.pop("path", None), source=DataSource.hf, hf_name=name, **kwargs)


def test_a_saved_hf_dataset_prepares_row_by_row_and_rebuilds_when_it_changes(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [f"row {i}: " + "some text " * (i % 7 + 1) for i in range(60)] + ["", None]
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": rows, "id": list(range(62))}).save_to_disk(str(folder))
    logs: list[str] = []
    data = prepare_data(hf_config(tmp_path, str(folder)), log=logs.append)
    assert data.meta["documents"] == 60 and data.meta["val_documents"] >= 1  # the empty and missing rows left out
    stream = np.concatenate([data.tokens("train"), data.tokens("val")])
    assert stream.size == sum(len(r) + 1 for r in rows if r) and int((stream == 255).sum()) == 60
    prepare_data(hf_config(tmp_path, str(folder)), log=logs.append)
    assert len(logs) == 1, "unchanged: reused"
    datasets.Dataset.from_dict({"text": ["other text"] * 30}).save_to_disk(str(tmp_path / "saved2"))
    shutil.rmtree(folder)
    (tmp_path / "saved2").rename(folder)
    changed = prepare_data(hf_config(tmp_path, str(folder)), log=logs.append)
    assert any("changed" in m for m in logs) and changed.meta["documents"] == 30


def test_an_hf_builder_reads_the_files_in_data_path(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    path = write_jsonl(tmp_path / "docs.jsonl", [{"content": f"document {i}\n" * 5} for i in range(20)])
    data = prepare_data(hf_config(tmp_path, "json", path=str(path), text_field="content"), log=lambda m: None)
    assert data.meta["documents"] == 20


def test_hf_mistakes_are_one_paragraph_errors(tmp_path: Path, monkeypatch) -> None:
    datasets = pytest.importorskip("datasets")
    import huggingface_hub

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Both libraries read these when imported: an import before this test (another test's) would
    # otherwise try the network, which waits ~20 s for a timeout on a machine without one.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="data.hf_name=nobody/no-such-dataset .* could not be loaded"):
        prepare_data(hf_config(tmp_path, "nobody/no-such-dataset"), log=lambda m: None)
    datasets.Dataset.from_dict({"body": ["x"] * 4}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ConfigError, match=r"has no column 'text' \(it has: body\); set data.text_field"):
        prepare_data(hf_config(tmp_path, str(tmp_path / "saved")), log=lambda m: None)


def test_cli_trains_on_a_saved_hf_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(
        {"text": [TINY_CORPUS.read_text()[i:i + 500] for i in range(0, 20000, 500)]}
    ).save_to_disk(str(tmp_path / "saved"))
    run = tmp_path / "run"
    proc = llmtrain(tmp_path, "train", "data=hf", f"data.hf_name={tmp_path / 'saved'}", "model.block_size=64",
                    "max_steps=2", "eval_interval=0", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    assert "gpt_tiny on hf" in proc.stdout and (run / "model.pt").is_file()
    missing = llmtrain(tmp_path, "train", "data=hf", "max_steps=2", f"hydra.run.dir={tmp_path / 'run2'}")
    assert missing.returncode == 2 and "'data.hf_name'" in missing.stderr and not (tmp_path / "run2").exists()


def test_resuming_onto_data_with_another_tokenizer_is_refused(tmp_path: Path) -> None:
    """Same settings, same vocabulary size, but the corpus changed: BPE learned other merges, so
    every token id would mean something else to the saved model."""
    from llmtrain.training.loop import train

    from .conftest import tiny_config

    folder = corpus_folder(tmp_path / "corpus")
    settings = {"data.path": str(folder), "data.tokenizer": TokenizerKind.bpe, "data.bpe_vocab_size": 300,
                "data.cache_dir": str(tmp_path / "cache"), "max_steps": 3}
    train(tiny_config(tmp_path / "run", **settings))
    for doc in folder.rglob("doc*.txt"):
        doc.write_text(doc.read_text().upper())
    with pytest.raises(ConfigError, match="the data's tokenizer is not the one this run was trained with"):
        train(tiny_config(tmp_path / "run", **{**settings, "max_steps": 5}))


def test_documents_that_are_all_empty_are_refused_as_such(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": ""}] * 3)
    with pytest.raises(ConfigError, match=r"holds no text: every document is empty"):
        prepare_data(data_config(tmp_path, path, source=DataSource.jsonl), log=lambda m: None)


def test_a_jsonl_field_that_is_not_text_is_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "fine"}, {"text": ["a", "list"]}])
    with pytest.raises(ConfigError, match=r"docs.jsonl:2: the field 'text' is an array, not a string"):
        prepare_data(data_config(tmp_path, path, source=DataSource.jsonl), log=lambda m: None)


# ---------------------------------------------------------------------------------------------
# streaming: files are read in pieces, never whole
# ---------------------------------------------------------------------------------------------


def expected_byte_stream(folder: Path, val_fraction: float = 0.2) -> tuple[bytes, bytes]:
    """The train and val byte streams that whole-file reading gives: each document + byte 255, split
    by the hash of its name (the lowest hash goes to validation when none is below the fraction)."""
    import hashlib

    from llmtrain.data.corpus import input_files

    files = input_files(str(folder), "text")
    buckets = [int.from_bytes(hashlib.sha256(f.name.encode()).digest()[:8], "little") / 2**64 for f in files]
    val = {i for i, b in enumerate(buckets) if b < val_fraction} or {buckets.index(min(buckets))}
    streams = [b"", b""]
    for i, f in enumerate(files):
        streams[i in val] += f.path.read_bytes() + b"\xff"
    return streams[0], streams[1]


@pytest.mark.parametrize("piece_bytes", [7, 64, 4096])
def test_tokens_do_not_depend_on_the_reading_piece_size(tmp_path: Path, monkeypatch, piece_bytes: int) -> None:
    import llmtrain.data.corpus as corpus
    import llmtrain.data.token_files as token_files

    folder = corpus_folder(tmp_path / "corpus")
    (folder / "doc5.txt").write_text("é€😀 no line break here at all " * 40)  # pieces must cut between characters
    whole = {kind: prepare_data(data_config(tmp_path / "whole", folder, tokenizer=kind), log=lambda m: None)
             for kind in (TokenizerKind.byte, TokenizerKind.char)}
    monkeypatch.setattr(corpus, "PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(token_files, "PIECE_BYTES", piece_bytes)
    for kind, reference in whole.items():
        pieces = prepare_data(data_config(tmp_path / f"pieces{piece_bytes}", folder, tokenizer=kind),
                              log=lambda m: None)
        assert pieces.meta["undecodable_documents"] == 0
        for split in ("train", "val"):
            assert np.array_equal(pieces.tokens(split), reference.tokens(split))
    train, val = expected_byte_stream(folder)
    assert bytes(whole[TokenizerKind.byte].tokens("train").astype(np.uint8)) == train
    assert bytes(whole[TokenizerKind.byte].tokens("val").astype(np.uint8)) == val


@pytest.mark.parametrize("piece_bytes", [5, 100, 1 << 20])
def test_a_single_file_splits_at_a_line_break_whatever_the_piece_size(tmp_path: Path, monkeypatch, piece_bytes) -> None:
    import llmtrain.data.corpus as corpus

    text = "".join(f"line {i} ünïcode\n" for i in range(300))
    (tmp_path / "one.txt").write_text(text)
    monkeypatch.setattr(corpus, "PIECE_BYTES", piece_bytes)
    data = prepare_data(data_config(tmp_path, tmp_path / "one.txt", val_fraction=0.1), log=lambda m: None)
    train, val = (bytes(data.tokens(s).astype(np.uint8)) for s in ("train", "val"))
    assert train + val == text.encode() + b"\xff"
    assert train.endswith(b"\n") and 0.08 < len(val) / len(text.encode()) < 0.12
    assert data.meta["train_documents"] == data.meta["val_documents"] == 1


def test_max_bytes_cuts_between_characters(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("€" * 100)  # 3 bytes each
    data = prepare_data(data_config(tmp_path, tmp_path / "a.txt", max_bytes=100), log=lambda m: None)
    stream = bytes(np.concatenate([data.tokens("train"), data.tokens("val")]).astype(np.uint8))
    assert stream == ("€" * 33).encode() + b"\xff" and data.meta["undecodable_documents"] == 0
    (tmp_path / "b.txt").write_text("next file\n" * 10)  # the cap ends inside a.txt: nothing of b.txt
    data = prepare_data(data_config(tmp_path, f"{tmp_path}/*.txt", max_bytes=100), log=lambda m: None)
    assert data.meta["documents"] == 1 and data.meta["source_bytes"] == 99


def test_a_jsonl_error_late_in_the_file_leaves_the_previous_data_intact(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document {i}\n" * 20} for i in range(30)])
    cfg = data_config(tmp_path, path, source=DataSource.jsonl)
    good = prepare_data(cfg, log=lambda m: None)
    before = {p.name: p.read_bytes() for p in good.directory.iterdir()}
    with open(path, "a") as fh:
        fh.write('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(ConfigError, match=r"docs.jsonl:32 is not valid JSON"):
        prepare_data(cfg, log=lambda m: None)
    assert {p.name: p.read_bytes() for p in good.directory.iterdir()} == before
    assert sorted(p.name for p in good.directory.parent.iterdir()) == [good.directory.name], "no half-built folder"


def test_an_interrupted_build_leaves_no_folder_that_looks_prepared(tmp_path: Path, monkeypatch) -> None:
    import llmtrain.data.token_files as token_files

    folder = corpus_folder(tmp_path / "corpus")
    cfg = data_config(tmp_path, folder)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(token_files, "encode_pieces", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, log=lambda m: None)
    data_root = tmp_path / "cache" / "data"
    assert not [p for p in data_root.iterdir() if (p / "meta.json").exists()] and not list(data_root.glob("*.tmp-*"))
    monkeypatch.undo()
    assert prepare_data(cfg, log=lambda m: None).meta["documents"] == 6


def test_token_ids_beyond_the_models_vocabulary_stop_training_and_keep_the_data(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "corpus")
    proc = llmtrain(tmp_path, "train", "data=text", f"data.path={folder}", "data.tokenizer=bpe",
                    "data.bpe_vocab_size=600", "model.vocab_size=300", "max_steps=2",
                    f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'model.vocab_size' (300) is smaller than the data's vocabulary (600" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    prepared = list((tmp_path / "cache" / "data").glob("text-bpe-*/meta.json"))
    assert len(prepared) == 1 and json.loads(prepared[0].read_text())["vocab_size"] == 600  # kept for the next try


def test_a_corpus_smaller_than_one_sequence_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "small.txt").write_text("just a few words\n" * 3)
    proc = llmtrain(tmp_path, "train", "data=text", f"data.path={tmp_path / 'small.txt'}", "model.block_size=64",
                    "max_steps=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "fewer than one sequence of 64 (+1 target)" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def llmtrain(cwd: Path, *args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """`llmtrain ARGS` in this process (conftest.run_cli: the same output, no new interpreter)."""
    return run_cli(*args, cwd=cwd, env=env, columns=200)


def test_cli_prepare_says_whether_it_built_or_reused_and_what_bpe_read(tmp_path: Path) -> None:
    """One size per BPE line (the whole split, or the sample and the split it is cut from); a second
    call says it reused the data, and where."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_CORPUS.read_text() * 4)  # 200 KB: more than the smallest sample, 64 KiB
    data = ["prepare", "data=text", f"data.path={corpus}", "data.tokenizer=bpe", "data.bpe_vocab_size=300"]

    def bpe_line(output: str) -> str:
        return next(line for line in output.splitlines() if line.startswith("training a byte-level BPE"))

    first = run_cli(*data, cwd=tmp_path, columns=400)
    assert first.returncode == 0, first.stderr
    assert re.fullmatch(r"training a byte-level BPE tokenizer \(vocabulary 300\) on the whole train split "
                        r"\(\d+\.\d KB\)", bpe_line(first.stdout))
    directory = re.search(r"^prepared text data in (\S+)$", first.stdout, re.MULTILINE)[1]
    again = run_cli(*data, cwd=tmp_path, columns=400)
    assert again.stdout.startswith(f"reused the text data prepared in {directory} (its inputs are unchanged)\n")
    assert "preparing" not in again.stdout and "training" not in again.stdout
    os.utime(corpus, (time.time() + 10, time.time() + 10))  # touched, the same content: reused too
    touched = run_cli(*data, cwd=tmp_path, columns=400)
    assert touched.stdout.startswith(f"reused the text data prepared in {directory} (its inputs are unchanged)\n")
    sampled = run_cli(*data, "data.bpe_sample_bytes=65536", cwd=tmp_path, columns=400)
    assert re.fullmatch(r"training a byte-level BPE tokenizer \(vocabulary 300\) on about 64\.0 KB of the train "
                        r"split's \d+\.\d KB \(data\.bpe_sample_bytes=65536\)", bpe_line(sampled.stdout))


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


def test_char_tokens_over_jsonl_documents_end_with_end_of_text(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"line {i} without a newline"} for i in range(20)])
    data = prepare_data(data_config(tmp_path, path, source=DataSource.jsonl, tokenizer=TokenizerKind.char),
                        log=lambda m: None)
    tok = data.tokenizer()
    assert "\n" not in tok.chars and data.vocab_size == len(tok.chars) + 1
    tokens = np.concatenate([data.tokens("train"), data.tokens("val")])
    assert int((tokens == tok.eos_id).sum()) == 20  # one per document


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
    from llmtrain.config.schema import Sampling
    from llmtrain.core.errors import Interrupted
    from llmtrain.training.loop import train

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


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_through_the_cli_sees_the_uninterrupted_batches(tmp_path: Path) -> None:
    """The acceptance test: the process is killed outright (no handler runs) in its first epoch; the
    resumed run must take exactly the steps of an uninterrupted run, into and past the second epoch."""
    import torch

    from .test_resume_kill import logged_step

    args = [sys.executable, "-m", "llmtrain", "train", "data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char",
            "data.sampling=epoch", "data.max_bytes=6000", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
            "model.block_size=32", "model.dropout=0.1", "micro_batch_size=2", "global_batch_size=8", "max_steps=30",
            "eval_interval=0", "log_interval=1", "threads=1", "checkpoint.every_steps=1", "checkpoint.keep_last=2"]
    env = {**os.environ, "LLMTRAIN_CACHE": str(tmp_path / "cache")}
    # The uninterrupted reference and the resume run in this process (the same CLI); the killed one in its own.
    ref = run_cli(*args[3:], f"hydra.run.dir={tmp_path / 'ref'}", cwd=tmp_path,
                  env={"LLMTRAIN_CACHE": env["LLMTRAIN_CACHE"]})
    assert ref.returncode == 0, ref.stderr
    run = tmp_path / "run"
    proc = subprocess.Popen([*args, f"hydra.run.dir={run}"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while logged_step(run) < 9 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    resumed = run_cli(*args[3:], f"hydra.run.dir={run}", cwd=tmp_path, env={"LLMTRAIN_CACHE": env["LLMTRAIN_CACHE"]})
    assert resumed.returncode == 0, resumed.stderr

    def train_records(folder: Path) -> dict[int, dict]:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}  # a resumed step: the last

    reference, after = train_records(tmp_path / "ref"), train_records(run)
    assert 0 < reference[9]["epoch"] < 1 < reference[30]["epoch"], "killed inside the first epoch, ending in the second"
    assert [after[s]["loss"] for s in range(1, 31)] == [reference[s]["loss"] for s in range(1, 31)]
    ref_weights, run_weights = (torch.load(f / "model.pt", weights_only=True) for f in (tmp_path / "ref", run))
    assert all(torch.equal(ref_weights[k], run_weights[k]) for k in ref_weights)


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
    data = prepare_data(
        data_config(tmp_path, path, source=DataSource.instruct, tokenizer=tokenizer, bpe_vocab_size=300),
        log=lambda m: None,
    )
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
    # tokens (and tokens/s) count the trained response tokens: not prompts, not padding
    tokens = [0] + [r["tokens"] for r in records if r["kind"] == "train"]
    assert all(0 < b - a < 4 * 64 for a, b in zip(tokens, tokens[1:]))


def test_a_bad_instruction_line_names_its_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "response": "b"}, {"question": "a", "answer": "b"}])
    with pytest.raises(ConfigError, match=r"pairs.jsonl:2 has neither 'messages' nor .*it has: answer, question"):
        prepare_data(data_config(tmp_path, path, source=DataSource.instruct), log=lambda m: None)


def test_label_smoothing_raises_the_training_loss_of_a_confident_model() -> None:
    import torch

    from llmtrain.engine.step import loss_sum

    logits = torch.full((1, 4, 10), -5.0)
    targets = torch.tensor([[1, 2, 3, 4]])
    logits[0, torch.arange(4), targets[0]] = 5.0
    assert loss_sum(logits, targets, label_smoothing=0.1) > loss_sum(logits, targets) > 0
