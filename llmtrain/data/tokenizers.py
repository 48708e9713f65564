"""Tokenizers that travel with the prepared data (and into the run dir, for `sample`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def to_dict(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, lossless."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": "byte"}


class CharTokenizer:
    """One token per distinct character of the corpus; vocabulary from the data, sorted."""

    def __init__(self, chars: list[str]) -> None:
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)

    @classmethod
    def fit(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.index[c] for c in text]
        except KeyError as err:
            known = "".join(self.chars[:40])
            raise ValueError(
                f"character {err.args[0]!r} is not in this char tokenizer's vocabulary "
                f"({self.vocab_size} characters, starting {known!r})"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": "char", "chars": self.chars}


class BPETokenizer:
    """Byte-level BPE trained on the corpus with Hugging Face `tokenizers` (Rust, parallel): any
    text encodes (the 256 bytes are in the alphabet), and decoding is lossless."""

    END_OF_TEXT = "<|endoftext|>"

    def __init__(self, inner) -> None:  # inner: tokenizers.Tokenizer
        self.inner = inner
        self.vocab_size = inner.get_vocab_size()

    @classmethod
    def fit(cls, texts: list[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        inner = HFTokenizer(models.BPE())
        inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        inner.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[cls.END_OF_TEXT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        inner.train_from_iterator(texts, trainer=trainer)
        return cls(inner)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(list(ids))

    def to_dict(self) -> dict:
        return {"kind": "bpe", "tokenizer": json.loads(self.inner.to_str())}


def tokenizer_from_dict(data: dict) -> Tokenizer:
    if data["kind"] == "byte":
        return ByteTokenizer()
    if data["kind"] == "char":
        return CharTokenizer(list(data["chars"]))
    if data["kind"] == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        return BPETokenizer(HFTokenizer.from_str(json.dumps(data["tokenizer"])))
    raise ValueError(f"unknown tokenizer kind {data['kind']!r}; valid: byte, char, bpe")


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    path.write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False))


def load_tokenizer(path: Path) -> Tokenizer:
    return tokenizer_from_dict(json.loads(path.read_text()))
