"""Data preparation (cache, staleness, split), tokenizers and the window sampler."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from llmtrain.config.schema import DataConfig, DataSource, TokenizerKind
from llmtrain.data import RandomWindowSampler, prepare_data
from llmtrain.data.tokenizers import ByteTokenizer, CharTokenizer, tokenizer_from_dict


def text_config(path: Path, cache: Path, tokenizer: TokenizerKind = TokenizerKind.byte) -> DataConfig:
    return DataConfig(source=DataSource.text, path=str(path), tokenizer=tokenizer, val_fraction=0.1,
                      cache_dir=str(cache))


def test_prepare_once_then_reuse_then_rebuild_on_change(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 500)
    cfg = text_config(corpus, tmp_path / "cache")
    messages: list[str] = []
    first = prepare_data(cfg, log=messages.append)
    assert len(messages) == 1 and "preparing" in messages[0]
    assert first.meta["train_tokens"] + first.meta["val_tokens"] == 12 * 500 + 1  # + end-of-text
    built = (first.directory / "train.bin").stat().st_mtime_ns

    again = prepare_data(cfg, log=messages.append)
    assert len(messages) == 1, "unchanged input must not be prepared again"
    assert again.directory == first.directory

    os.utime(corpus, ns=(built + 10**9, built + 10**9))  # touched, same content: no rebuild
    prepare_data(cfg, log=messages.append)
    assert len(messages) == 1
    assert (first.directory / "train.bin").stat().st_mtime_ns == built

    corpus.write_text("something else entirely\n" * 500)
    changed = prepare_data(cfg, log=messages.append)
    assert len(messages) == 2 and "changed" in messages[1]
    assert changed.meta["train_tokens"] + changed.meta["val_tokens"] == 24 * 500 + 1
    assert not list((tmp_path / "cache" / "data").glob("*.tmp-*")), "no temp folders left behind"


def test_tokens_memmap_matches_the_text_and_split_is_tail(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    text = "".join(f"line {i}\n" for i in range(1000))
    corpus.write_text(text)
    data = prepare_data(text_config(corpus, tmp_path / "cache"), log=lambda _: None)
    train, val = data.tokens("train"), data.tokens("val")
    assert isinstance(train, np.memmap) and train.dtype == np.uint16
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == text.encode() + b"\xff"  # end-of-text: byte 255
    assert train[-1] == ord("\n"), "a single file's split falls on a line break"
    assert 0.08 < val.size / (train.size + val.size) < 0.12
    counts = np.bincount(train, minlength=256)
    p = counts[counts > 0] / counts.sum()
    assert data.unigram_entropy == pytest.approx(float(-(p * np.log(p)).sum()))


def test_char_tokenizer_vocab_from_corpus_and_round_trip(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcabc\nxyz é\n" * 100)
    data = prepare_data(text_config(corpus, tmp_path / "cache", TokenizerKind.char), log=lambda _: None)
    tok = data.tokenizer()
    assert isinstance(tok, CharTokenizer) and data.vocab_size == len(set("abcabc\nxyz é\n")) + 1  # + end-of-text
    assert tok.decode(tok.encode("zé a")) == "zé a"
    assert tok.encode_array("zé a").tolist() == tok.encode("zé a")
    assert data.tokens("val")[-1] == tok.eos_id == data.meta["end_of_text_id"]
    assert tok.decode([*tok.encode("ab"), tok.eos_id]) == "ab"
    assert tokenizer_from_dict(tok.to_dict()).chars == tok.chars
    with pytest.raises(ValueError, match="not in this char tokenizer"):
        tok.encode("Q")
    with pytest.raises(ValueError, match="'Q' is not in this char tokenizer"):
        tok.encode_array("abQ")
    assert ByteTokenizer().decode(ByteTokenizer().encode("é ok")) == "é ok"


def test_sampler_windows_are_contiguous_shifted_slices() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = RandomWindowSampler(tokens, batch_size=5, seq_len=16, seed=0)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (5, 16) and x.dtype.is_floating_point is False
    assert (y[:, :-1] == x[:, 1:]).all() and (y[:, 0] == x[:, 0] + 1).all()
    assert (x[:, 1:] - x[:, :-1] == 1).all()


def test_sampler_same_windows_whatever_the_split_and_state_round_trip() -> None:
    tokens = np.arange(5000, dtype=np.uint16)
    whole = RandomWindowSampler(tokens, 8, 16, seed=7).next_batch()[0]
    split = RandomWindowSampler(tokens, 2, 16, seed=7)
    parts = [split.next_batch()[0] for _ in range(4)]
    assert (np.concatenate(parts) == whole.numpy()).all()

    a = RandomWindowSampler(tokens, 4, 16, seed=1)
    a.next_batch()
    state = a.state_dict()
    expected = a.next_batch()[0]
    b = RandomWindowSampler(tokens, 4, 16, seed=99)
    b.load_state_dict(state)
    assert (b.next_batch()[0] == expected).all()


def test_missing_text_file_is_a_config_error(tmp_path: Path) -> None:
    from llmtrain.core.errors import ConfigError

    with pytest.raises(ConfigError, match="data.path"):
        prepare_data(text_config(tmp_path / "absent.txt", tmp_path / "cache"))
